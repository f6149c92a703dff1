"""
What this machine and the installed PyTorch can do, and what they are: bf16 matmuls in the CPU, fused AdamW, a forced
SDPA kernel (compiled, and why PyTorch refused one), and the description a run logs (versions, device, commit).

Probes only; imports errors.py alone.
"""
from __future__ import annotations

import inspect
import os
import platform
import re
import subprocess
import warnings
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanogpt.errors import UserError


def fused_adamw_available(device_type: str) -> bool:
    """PyTorch's fused AdamW runs on CUDA, and on the CPU since 2.4."""
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    if device_type == "cuda":
        return True
    if device_type == "cpu":
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        return (major, minor) >= (2, 4)
    return False


# sdpa_backend's kernels (model.py's SDPA_BACKENDS) by their SDPBackend names, and those PyTorch has for CUDA alone
SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "math": "MATH"}
CUDA_ONLY_BACKENDS = ("efficient", "cudnn")


def check_attention_kernel(model, ctx: AbstractContextManager | None = None, compile: bool = False) -> None:
    """
    Where the model's sdpa_backend forces one kernel, raise now the UserError of a kernel that refuses its case
    (its device, the dtype under the autocast `ctx`, head size, dropout in training mode), by running the first
    layer's attention once eagerly on two positions. Under torch.compile the same refusal comes from inside
    the compiler, as a long traceback (TorchRuntimeError) instead of the one-line error. compile=True also
    refuses a torch whose compiler cannot trace the forced kernel (see sdpa_kernel_compiles).
    """
    cfg = model.config
    if cfg.attention != "sdpa" or cfg.sdpa_backend == "auto":
        return
    if compile and not sdpa_kernel_compiles():
        raise UserError(
            f"sdpa_backend={cfg.sdpa_backend!r} with compile=True needs torch 2.5 or later, whose compiler "
            f"traces the sdpa_kernel context (torch {torch.__version__} would run every layer's attention "
            f"outside the compiled graph): upgrade torch, or use sdpa_backend='auto' or compile=False"
        )
    weight = model.lm_head.weight
    if cfg.sdpa_backend in CUDA_ONLY_BACKENDS and weight.device.type != "cuda":
        raise UserError(f"sdpa_backend={cfg.sdpa_backend!r} cannot run on {weight.device.type}: PyTorch has no "
                        f"{cfg.sdpa_backend} kernel there (use 'flash', 'math' or 'auto')")
    attn = model.transformer.h[0].attn
    T = min(2, cfg.block_size)
    x = torch.zeros(1, T, cfg.n_embd, device=weight.device, dtype=weight.dtype)  # (1, T, C)
    # dropout draws random numbers: fork the RNG so that the run's own stream (bitwise resume) is untouched
    with torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
        with ctx if ctx is not None else nullcontext():
            try:
                attn(x)
            except RuntimeError as e:
                if not any(s in str(e) for s in ("No viable backend", "No available kernel")):  # CPU, CUDA wording
                    raise
                q = attn.c_attn(x)[..., : cfg.n_embd].view(1, T, cfg.n_head, -1).transpose(1, 2)  # (1, nh, T, hs)
                dropout_p = attn.dropout if attn.training else 0.0
                backend = getattr(SDPBackend, SDPA_KERNELS[cfg.sdpa_backend])
                reasons = sdpa_kernel_refusal(backend, q, q, q, None, dropout_p, is_causal=T > 1)
                raise UserError(
                    f"sdpa_backend={cfg.sdpa_backend!r} cannot run on {weight.device.type} with dtype {q.dtype}, "
                    f"head size {q.size(-1)}, no mask: {reasons} (choose another sdpa_backend, or 'auto')"
                ) from None


def sdpa_kernel_compiles() -> bool:
    """Whether torch.compile traces the sdpa_kernel context manager that a forced sdpa_backend uses (dynamo's
    SDPAKernelVariable, torch 2.5+). Without it dynamo breaks the graph there and every layer's attention runs
    eagerly, between compiled pieces."""
    try:
        from torch._dynamo.variables import SDPAKernelVariable  # noqa: F401
    except ImportError:
        return False
    return True


def sdpa_kernel_refusal(
    backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool,
) -> str:
    """Why the forced SDPA kernel `backend` refuses this call, in one line. PyTorch explains a refusal only through
    warnings: the call runs once more to collect them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        except RuntimeError:
            pass
    return sdpa_refusal_reasons([str(w.message) for w in caught])


def sdpa_refusal_reasons(messages: list[str]) -> str:
    """The reasons in PyTorch's warnings for a refused SDPA kernel, in one line. On CUDA it warns per kernel:
    "<kernel> not used because:", then that kernel's reasons, or "<kernel> has been runtime disabled" for the
    kernels sdpa_kernel turned off; each ends with "(Triggered internally at <file>:<line>.)". Only the reasons
    explain the refusal: the headers, the turned-off kernels and the source locations are dropped."""
    lines = [re.sub(r"\s*\(Triggered internally at [^)]*\)", "", m).strip().replace("\n", " ") for m in messages]
    reasons = [m for m in lines if m and not m.endswith("not used because:") and "runtime disabled" not in m]
    return "; ".join(reasons or [m for m in lines if m]) or "no reason given by PyTorch"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512-BF16 or AMX tiles); oneDNN emulates it otherwise."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def system_info(device: str) -> dict[str, str]:
    """Versions and hardware for the log: enough to reproduce and compare runs."""
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu_name(),
        "threads": str(torch.get_num_threads()),
        "git_commit": git_commit(),
    }
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
