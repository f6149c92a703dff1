"""
What this machine and the installed PyTorch can do, and what they are: bf16 matmuls in the CPU, fused AdamW, a forced
SDPA kernel (compiled, and why PyTorch refused one), the implementation behind SDPA's flash kernel (and putting it
there), and the description a run logs (versions, device, commit).

Probes, and the switch behind flash_impl.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import platform
import re
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

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


# flash_impl: the implementation behind SDPA's flash kernel. "default": PyTorch's own (FlashAttention-2); "fa4":
# FlashAttention-4 (CuTe DSL, written for Hopper and Blackwell) through PyTorch's hook for newer flash kernels.
FLASH_IMPLS = ("default", "fa4")
FA4_MODULE = "flash_attn.cute.interface"  # what the flash-attn-4 package provides, and torch's hook imports


def flash_impl_problem(impl: str, device: str) -> str | None:
    """Why flash_impl=`impl` cannot run on `device`, in one line; None where it can."""
    if impl == "default":
        return None
    if not hasattr(torch.nn.attention, "activate_flash_attention_impl"):
        return (f"flash_impl={impl!r} needs PyTorch's hook for newer flash kernels "
                f"(torch.nn.attention.activate_flash_attention_impl), which torch {torch.__version__} lacks: upgrade "
                f"torch, or set flash_impl='default'")
    if not device.startswith("cuda"):
        return (f"flash_impl={impl!r} runs FlashAttention-4 on NVIDIA GPUs of compute capability 9.0 or 10.0 (H100, "
                f"H200, B200), and device={device!r} is not one: set flash_impl='default'")
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major not in (9, 10):
        return (f"flash_impl={impl!r}: FlashAttention-4 runs on compute capability 9.0 or 10.0 (H100, H200, B200), and "
                f"this GPU has {major}.{minor}: set flash_impl='default'")
    try:
        found = importlib.util.find_spec(FA4_MODULE) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (f"flash_impl={impl!r} needs the flash-attn-4 package ({FA4_MODULE}), which is not installed: pip "
                f"install flash-attn-4 (with nvidia-cutlass-dsl and quack-kernels), or set flash_impl='default'")
    return None


def use_flash_impl(impl: str) -> None:
    """Put `impl` behind SDPA's flash kernel, for the whole process (flash_impl_problem has said it can run);
    "default" takes back an implementation activated before, PyTorch's own kernel again."""
    attention = torch.nn.attention
    if impl == "fa4":
        attention.activate_flash_attention_impl("FA4")  # in place of any activated before
    elif getattr(attention, "current_flash_attention_impl", lambda: None)() is not None:
        attention.restore_flash_attention_impl()  # asked only when one is active: it warns where none is


@contextmanager
def flash_impl(impl: str) -> Iterator[None]:
    """`impl` behind SDPA's flash kernel inside the block alone, and PyTorch's default after it, even when the block
    raises: for a benchmark whose later rows must measure the default kernel (train.py chooses once per process)."""
    use_flash_impl(impl)
    try:
        yield
    finally:
        use_flash_impl("default")


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
