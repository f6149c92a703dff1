"""
CUDA attention: every SDPA kernel (flash, efficient, cudnn, math, auto) against the project's math attention and a
float64 reference, forward and backward, in float32, bfloat16 and float16, causal, with a padding mask, and with
the KV cache. A kernel that cannot run a case is refused by PyTorch (model.py is plain), and in one line by the check
every command runs first (hardware.check_attention_kernel).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cuda_helpers import DTYPES, has_bf16, relative_error, requires_cuda
from nanogpt.errors import UserError
from nanogpt.hardware import check_attention_kernel
from nanogpt.engine import KVCache
from model import GPT, GPTConfig

pytestmark = requires_cuda

BACKENDS = ("flash", "efficient", "cudnn", "math", "auto")
CASES = ("causal", "padding")
# Relative error (norm-wise) allowed against float64, by the dtype the matmuls run in (autocast): float32 with TF32
# off rounds at ~6e-8 per operation; float16 at ~5e-4 and bfloat16 at ~4e-3, and an attention output or gradient
# goes through a few roundings (q/k/v projections, scores, softmax, values, output projection).
REL = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
# head size 64, as GPT-2's (every fused kernel supports it); 128 keys
CONFIG = GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=2, n_embd=128, bias=True, dropout=0.0)


def _attention(config: GPTConfig, dtype: torch.dtype = torch.float32, device: str = "cuda"):
    torch.manual_seed(0)
    return GPT(config).transformer.h[0].attn.to(device=device, dtype=dtype)


def _inputs(case: str, B: int = 3, T: int = 128):
    """x (B, T, C) of unit scale, an upstream gradient, and the padding mask (B, T) of the case (None: causal)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, CONFIG.n_embd, generator=g)
    grad_out = torch.randn(B, T, CONFIG.n_embd, generator=g)
    mask = None
    if case == "padding":  # right padding: 128, 100 and 37 real tokens
        lengths = torch.tensor([T, 100, 37])
        mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T) bool
    return x, grad_out, mask


def _forward_backward(module, x, grad_out, mask, autocast_dtype: str | None):
    """Output and the gradients of (output * grad_out).sum() w.r.t. the input and the module's weights."""
    x = x.clone().requires_grad_(True)
    ctx = (torch.autocast("cuda", dtype=DTYPES[autocast_dtype]) if autocast_dtype not in (None, "float32")
           else torch.autocast("cuda", enabled=False))
    with ctx:
        y = module(x, key_padding_mask=mask)
    (y.float() * grad_out.to(y.device)).sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return y.detach(), grads


def _reference(case: str):
    """float64 math attention of the same weights (the module's parameters are the same for every config)."""
    x, grad_out, mask = _inputs(case)
    ref = _attention(dataclasses.replace(CONFIG, attention="math"), torch.float64)
    return _forward_backward(ref, x.cuda().double(), grad_out.cuda().double(),
                             None if mask is None else mask.cuda(), None)


def _run(config: GPTConfig, case: str, dtype: str):
    x, grad_out, mask = _inputs(case)
    module = _attention(config)
    return _forward_backward(module, x.cuda(), grad_out.cuda(), None if mask is None else mask.cuda(), dtype)


@pytest.mark.parametrize("dtype", list(REL))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_kernel_matches_math_attention_and_float64(backend: str, case: str, dtype: str) -> None:
    if dtype == "bfloat16" and not has_bf16():
        pytest.skip("this GPU has no native bfloat16")
    y_ref, grads_ref = _reference(case)
    y_math, grads_math = _run(dataclasses.replace(CONFIG, attention="math"), case, dtype)
    try:
        y, grads = _run(dataclasses.replace(CONFIG, attention="sdpa", sdpa_backend=backend), case, dtype)
    except RuntimeError as e:  # the forced kernel refuses this case: PyTorch's error (model.py is plain PyTorch)
        assert "No available kernel" in str(e) or "No viable backend" in str(e), str(e)[:500]
        assert backend in ("flash", "efficient", "cudnn"), f"{backend} must run every case: {e}"
        pytest.skip(f"refused by PyTorch: {str(e)[:200]}")
    tol = REL[dtype]
    assert relative_error(y, y_ref) < tol, (relative_error(y, y_ref), relative_error(y_math, y_ref))
    assert relative_error(y, y_math) < 2 * tol
    for name, g, g_ref, g_math in zip(["input"] + [n for n, _ in _attention(CONFIG).named_parameters()],
                                      grads, grads_ref, grads_math):
        assert relative_error(g, g_ref) < tol, (name, relative_error(g, g_ref), relative_error(g_math, g_ref))
        assert relative_error(g, g_math) < 2 * tol, name


def test_known_refusals_are_one_line_errors() -> None:
    """flash has no float32 kernel: the check every command runs before the first forward (hardware.
    check_attention_kernel) says so in one line, with PyTorch's reasons for the chosen kernel only; flash takes no
    arbitrary mask either, which model.py (plain PyTorch) leaves to PyTorch's own error."""
    x, grad_out, mask = _inputs("padding")
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(CONFIG, attention="sdpa", sdpa_backend="flash")).cuda()
    with pytest.raises(UserError) as e:
        check_attention_kernel(model)
    message = str(e.value)
    assert "\n" not in message and "sdpa_backend='flash' cannot run on cuda with dtype torch.float32" in message
    assert "choose another sdpa_backend" in message
    assert "runtime disabled" not in message  # the chosen kernel's reasons, not the other kernels' (turned off)
    if has_bf16():
        flash = model.transformer.h[0].attn
        with torch.autocast("cuda", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="No available kernel"):
            flash(x.cuda(), key_padding_mask=mask.cuda())


@pytest.mark.skipif(not has_bf16(), reason="the fused kernels' bf16 paths need Ampere or later")
@pytest.mark.parametrize("backend", ("flash", "efficient"))
def test_fused_kernels_run_the_training_case_on_ampere(backend: str) -> None:
    # GPT-2 training's case (bf16 autocast, causal, head size 64, no dropout) must not be refused on A100/H100
    y, _ = _run(dataclasses.replace(CONFIG, attention="sdpa", sdpa_backend=backend), "causal", "bfloat16")
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", list(REL))
@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_logits_match_the_full_forward_in_float64(backend: str, dtype: str) -> None:
    """Prefill 40 positions, then 24 single positions with the cache: each step's logits against the float64 full
    forward of the same weights (causal: position t's logits depend only on positions <= t)."""
    if dtype == "bfloat16" and not has_bf16():
        pytest.skip("this GPU has no native bfloat16")
    torch.manual_seed(0)
    base = GPT(dataclasses.replace(CONFIG, attention="math")).eval()
    reference = GPT(dataclasses.replace(CONFIG, attention="math")).double().cuda().eval()
    reference.load_state_dict(base.state_dict())
    model = GPT(dataclasses.replace(CONFIG, attention="sdpa", sdpa_backend=backend)).cuda().eval()
    model.load_state_dict(base.state_dict())
    idx = torch.randint(0, CONFIG.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        ref_logits = reference.lm_head(reference._hidden(idx))  # (B, 64, padded V)
        cache = KVCache(model.config, 2, DTYPES[dtype], "cuda")  # in the dtype the attention produces
        ctx = torch.autocast("cuda", dtype=DTYPES[dtype]) if dtype != "float32" else torch.autocast("cuda", enabled=False)
        try:
            with ctx:
                steps = [model.lm_head(model._hidden(idx[:, :40], kv_cache=cache))]
                for t in range(40, 64):
                    steps.append(model.lm_head(model._hidden(idx[:, t : t + 1], kv_cache=cache)))
        except RuntimeError as e:  # the forced kernel refuses this case: PyTorch's error
            assert "No available kernel" in str(e) or "No viable backend" in str(e), str(e)[:500]
            assert backend in ("flash", "efficient", "cudnn"), str(e)
            pytest.skip(f"refused by PyTorch: {str(e)[:200]}")
    logits = torch.cat(steps, dim=1)  # (B, 64, padded V)
    assert relative_error(logits, ref_logits) < REL[dtype]


def test_flash_attention_4_through_torchs_hook_matches_math_attention() -> None:
    """flash_impl='fa4': SDPA's flash kernel becomes FlashAttention-4 (torch.nn.attention.activate_flash_attention_impl)
    where the GPU and the flash-attn-4 package allow it; its output and gradients match float64 math as flash's do.
    Run in a process of its own: the activation holds for the process."""
    import subprocess
    import sys

    from helpers import ROOT
    from nanogpt.hardware import flash_impl_problem

    if (why := flash_impl_problem("fa4", "cuda")) is not None:
        pytest.skip(why)
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import attention; "
            "rows = attention.main(['--shapes=4x1024', '--kernels=fa4,flash', '--repeats=3']); "
            "print('ERRORS', [max(r['errors'].values()) for r in rows])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    fa4, flash = eval(r.stdout.split("ERRORS")[1])
    assert fa4 < 2 * max(flash, REL["bfloat16"] / 10), (fa4, flash)
