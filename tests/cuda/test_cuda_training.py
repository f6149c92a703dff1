"""
CUDA training equivalences: torch.compile vs eager (loss and gradients), fused vs unfused AdamW, padded vs unpadded
vocabulary, accumulated vs one large batch, bitwise resume with deterministic=True, and the data path (pinned
memory, non-blocking copies) against the CPU's batches. TF32 is off in every test (conftest), so float32 compares
at float32 rounding.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from nanogpt.device import autocast_context
from nanogpt.distributed import Dist
from nanogpt.fused_loss import fused_linear_cross_entropy
from nanogpt.checkpoint_file import load_checkpoint
from cuda_helpers import MODEL_TOL, relative_error, requires_cuda
from helpers import tiny_config
from model import GPT, GPTConfig
from nanogpt.config import TrainConfig
from train import train
from nanogpt.step import batch_generator, get_batch, to_device, train_step

pytestmark = requires_cuda

CONFIG = GPTConfig(block_size=64, vocab_size=101, n_layer=2, n_head=2, n_embd=64, bias=True)  # 101: padded to 128


def _model(config: GPTConfig = CONFIG, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).cuda()


def _batch(B: int = 8, T: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CONFIG.vocab_size, (B, T + 1), generator=g)
    return x[:, :-1].cuda(), x[:, 1:].cuda()


def _loss_and_grads(model, x, y, dtype: str = "float32"):
    with autocast_context("cuda", dtype):
        _, loss = model(x, y, return_logits=False)
    loss.backward()
    raw = getattr(model, "_orig_mod", model)
    grads = {n: p.grad.detach().clone() for n, p in raw.named_parameters()}
    raw.zero_grad(set_to_none=True)
    return loss.item(), grads


@pytest.mark.parametrize("fused_loss", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_loss_and_gradients_match_eager(dtype: str, fused_loss: bool) -> None:
    """Both loss paths. The fused loss once came back from torch.compile (2.11, CUDA) with zero gradients for every
    parameter while its loss was right: an in-place add to the autograd.Function's output."""
    if dtype == "bfloat16" and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("no native bfloat16")
    x, y = _batch()
    eager = _model()
    eager.head_loss = fused_linear_cross_entropy if fused_loss else None
    compiled = torch.compile(copy.deepcopy(eager))
    loss_e, grads_e = _loss_and_grads(eager, x, y, dtype)
    loss_c, grads_c = _loss_and_grads(compiled, x, y, dtype)
    tol = MODEL_TOL[{"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]]
    assert loss_c == pytest.approx(loss_e, rel=tol)
    for name in grads_e:
        assert grads_e[name].abs().max() > 0, name
        assert relative_error(grads_c[name], grads_e[name]) < tol, name


def _adamw_steps(fused: bool, steps: int = 5) -> GPT:
    model = _model()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda", fused=fused, verbose=False)
    assert bool(opt.defaults.get("fused")) == fused
    for i in range(steps):
        x, y = _batch(seed=10 + i)
        _, loss = model(x, y, return_logits=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def test_fused_adamw_matches_unfused() -> None:
    fused, unfused = _adamw_steps(True), _adamw_steps(False)
    start = _model()
    for (name, a), b, s in zip(fused.named_parameters(), unfused.parameters(), start.parameters()):
        # the updates agree: float32 kernels in a different order, and AdamW's m / sqrt(v) amplifies the rounding
        # of a tiny v (an H100 gave 1.4e-4 for a bias)
        assert relative_error(a - s, b - s) < 1e-3, name


def test_padded_vocabulary_gives_the_unpadded_loss_and_gradients() -> None:
    x, y = _batch()
    unpadded = _model(dataclasses.replace(CONFIG, vocab_padding_multiple=1))
    padded = GPT(dataclasses.replace(CONFIG, vocab_padding_multiple=64)).cuda()
    with torch.no_grad():  # the same weights; padding rows zero
        for (name, p), q in zip(padded.named_parameters(), unpadded.parameters()):
            p.zero_()
            p[tuple(slice(0, n) for n in q.shape)].copy_(q)
    assert padded.lm_head.weight.shape[0] == 128
    loss_u, grads_u = _loss_and_grads(unpadded, x, y)
    loss_p, grads_p = _loss_and_grads(padded, x, y)
    assert loss_p == pytest.approx(loss_u, rel=1e-6)
    for name, g in grads_u.items():
        real = grads_p[name][tuple(slice(0, n) for n in g.shape)]
        assert relative_error(real, g) < 1e-5, name
    # padding rows get no gradient (the head's weight is tied to the embedding's, whose name it is listed under)
    assert grads_p["transformer.wte.weight"][CONFIG.vocab_size :].abs().max() == 0


def test_accumulated_micro_batches_equal_one_large_batch() -> None:
    x, y = _batch(B=8)
    cfg, dist, ctx = TrainConfig(grad_clip=1.0), Dist(device="cuda"), autocast_context("cuda", "float32")
    results = []
    for batches in ([(x.cpu(), y.cpu())], [(x[i : i + 2].cpu(), y[i : i + 2].cpu()) for i in range(0, 8, 2)]):
        model = _model()
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda", verbose=False)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        f = train_step(model, opt, scaler, batches, ctx, cfg, dist).read()
        loss, norm, applied = f.loss, f.grad_norm, f.applied
        results.append((loss, norm, [p.detach().clone() for p in model.parameters()]))
    (loss_1, norm_1, p_1), (loss_4, norm_4, p_4) = results
    assert applied and loss_4 == pytest.approx(loss_1, rel=1e-6) and norm_4 == pytest.approx(norm_1, rel=1e-5)
    for a, b in zip(p_1, p_4):  # AdamW's first step is ~lr * sign(g): rounding can tip a tiny gradient
        assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("compile", [False, True])
def test_resume_is_bitwise_identical_with_deterministic(char_data, tmp_path, compile: bool) -> None:
    data_dir, _ = char_data
    run = dict(device="cuda", deterministic=True, compile=compile, dropout=0.1, max_iters=12, lr_decay_iters=12,
               eval_interval=6, gradient_accumulation_steps=2)
    full = train(tiny_config(data_dir, tmp_path / "full", **run))
    train(tiny_config(data_dir, tmp_path / "split", **{**run, "max_iters": 6}))
    resumed = train(tiny_config(data_dir, tmp_path / "split", **run, init_from="resume"))
    assert resumed["last_loss"] == full["last_loss"]
    a = load_checkpoint(str(tmp_path / "full" / "ckpt.pt"))["model"]
    b = load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pinned_non_blocking_batches_equal_the_cpu_batches(char_data) -> None:
    data_dir, _ = char_data
    path = str(data_dir / "train.bin")
    batches = [get_batch(path, 16, 64, batch_generator(0, "train", step, 0)) for step in range(20)]
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(10):  # queue GPU work, so that the non-blocking copies wait behind it
        busy = busy @ busy / 45
    on_gpu = [(to_device(x, "cuda"), to_device(y, "cuda")) for x, y in batches]
    for (x, y), (gx, gy) in zip(batches, on_gpu):
        assert gx.device.type == "cuda" and torch.equal(gx.cpu(), x) and torch.equal(gy.cpu(), y)
    # the sums computed on the GPU from the copies equal the CPU's (the copy finished before the kernel read it)
    sums = torch.stack([gx.sum() for gx, _ in on_gpu]).cpu()
    assert torch.equal(sums, torch.stack([x.sum() for x, _ in batches]))
