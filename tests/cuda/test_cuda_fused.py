"""CUDA: the fused, chunked linear + cross-entropy (issue 12) gives the plain path's loss and gradients on the GPU,
compiled too, and cuts the memory of the logits (the CPU checks are in tests/test_fused_loss.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuda_helpers import DTYPES, MODEL_TOL, relative_error, requires_cuda
from nanogpt.fused_loss import fused_linear_cross_entropy
from model import GPT, GPTConfig

pytestmark = requires_cuda

V, VP = 1000, 1024  # a padded vocabulary: 24 rows with no probability and no gradient


def head_case(N=700, C=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(VP, C, generator=g) * 0.1
    t = torch.randint(0, V, (N,), generator=g)
    t[::6] = -1
    return x.cuda(), w.cuda(), t.cuda()


def grads(fn, x, w):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w)
    (3.0 * loss).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fused_head_matches_float64_like_the_plain_path(dtype):
    x, w, t = head_case()
    ref = grads(lambda a, b: F.cross_entropy(a @ b[:V].t(), t, ignore_index=-1, reduction="sum"), x.double(), w.double())
    ctx = lambda: torch.autocast("cuda", dtype=DTYPES[dtype], enabled=dtype != "float32")  # noqa: E731

    def plain(a, b):
        with ctx():
            logits = a @ b.t()
            logits[:, V:] = float("-inf")
            return F.cross_entropy(logits, t, ignore_index=-1, reduction="sum")

    def fused(a, b):
        with ctx():
            return fused_linear_cross_entropy(a, b, t, V, chunk_rows=128)

    p, f = grads(plain, x, w), grads(fused, x, w)
    assert torch.all(f[2][V:] == 0)
    for name, pe, fe, re in zip(("loss", "grad x", "grad w"), p, f, ref):
        plain_err, fused_err = relative_error(pe, re), relative_error(fe, re)
        assert fused_err <= 1.5 * plain_err + 1e-6, (name, fused_err, plain_err)


@pytest.mark.parametrize("compile", [False, True])
def test_fused_model_equals_plain_model_on_cuda_and_saves_logits_memory(compile):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=256, vocab_size=50257, n_layer=1, n_head=4, n_embd=128)
    plain = GPT(cfg).cuda()
    fused = GPT(cfg).cuda()
    fused.head_loss = fused_linear_cross_entropy
    fused.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 50257, (8, 256), device="cuda")
    results = {}
    for name, model in (("plain", plain), ("fused", fused)):
        run = torch.compile(model) if compile else model
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = run(idx, idx, return_logits=False)  # the training step's forward
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        results[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()}, peak)
    (pl, pg, ppeak), (fl, fg, fpeak) = results["plain"], results["fused"]
    assert relative_error(fl, pl) < MODEL_TOL[torch.bfloat16]
    for n in pg:
        assert relative_error(fg[n], pg[n]) < MODEL_TOL[torch.bfloat16], n
    # 2048 tokens x 50304 logits: eager, the bf16 logits, their float32 copy, log-softmax and its gradient (~1 GB)
    # are gone; compiled, inductor already fuses the plain loss's float32 steps, so the bf16 logits are what is left
    # to save (the fused loss runs eagerly inside the compiled model: traced, its chunks' buffers all lived at once)
    assert fpeak < (0.7 if compile else 0.6) * ppeak, (fpeak, ppeak)
