"""
What the machine and the installed PyTorch can do: the GPUs' peak FLOP/s (for MFU), whether fused AdamW and a
compiled forced SDPA kernel are available, and why PyTorch refused an SDPA kernel.

Probes and tables only: model.py, common.py and the benchmarks import it; it must not import model.py (nor any
script), so that it stays below everything that asks it.
"""
from __future__ import annotations

import inspect
import re
import warnings
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from errors import UserError

# Peak dense (not sparse) bf16 tensor-core FLOP/s by the name CUDA reports (torch.cuda.get_device_name), from
# NVIDIA's datasheets. A name matches as a whole word of the device name, and the longest match wins, so
# "H100 NVL" beats "H100", "GH200" is not "H200", "A10G" is not "A10" and "L40S" is not "L4".
PEAK_FLOPS = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H100": 989e12,  # SXM (and "H100 80GB HBM3")
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,  # SXM
    "H200 NVL": 835e12,
    "H800": 989e12,  # SXM
    "H800 PCIe": 756e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "A10G": 70e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A6000": 155e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,  # float16 (V100 has no bf16 tensor cores)
    "T4": 65e12,  # float16
}


def gpu_peak_flops(device_name: str) -> float | None:
    """The PEAK_FLOPS entry of a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"); None if no entry matches."""
    matches = [name for name in PEAK_FLOPS if re.search(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])", device_name)]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def device_peak_flops(device: str | torch.device) -> float | None:
    """Peak bf16 FLOP/s of the device a run uses: a known GPU's from PEAK_FLOPS; None for unknown GPUs and other
    devices (a CPU run's MFU never takes the peak of a GPU that happens to be visible)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device))


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
    x = torch.zeros(1, min(2, cfg.block_size), cfg.n_embd, device=weight.device, dtype=weight.dtype)  # (1, T, C)
    # dropout draws random numbers: fork the RNG so that the run's own stream (bitwise resume) is untouched
    with torch.random.fork_rng(devices=[weight.device] if weight.device.type == "cuda" else []):
        with ctx if ctx is not None else nullcontext():
            model.transformer.h[0].attn(x)


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
