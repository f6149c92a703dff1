"""The device and its precision, one place for training, sampling and benchmarks; each "auto" picks what was measured
fastest there (docs/performance.md, docs/gpu.md)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time

import torch

from nanogpt.errors import UserError
from nanogpt import hardware

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """'auto' -> cuda, else mps, else cpu; anything else is checked and returned."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda", "mps"):
        raise UserError(f"device={device!r} is not one of auto, cpu, cuda, cuda:N, mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={device!r} but no CUDA GPU is available: use --device=cpu")
    if kind == "cuda" and ":" in device:
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise UserError(f"device={device!r}: this machine has GPUs cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device={device!r} but MPS is not available: use --device=cpu")
    return device


def resolve_dtype(dtype: str, device: str, training: bool = True, key: str = "dtype") -> str:
    """'auto' -> bfloat16 on a GPU that has it (else float16, with a grad scaler) and for training on a CPU with bf16
    in hardware (faster, same loss curve: docs/performance.md); else float32: a CPU without it emulates bf16, and
    generation is matrix-vector work where casts cost more than bf16 saves. `key`: the setting messages name."""
    device_type = device.split(":")[0]
    if dtype == "auto":
        if device_type == "cuda":
            return "bfloat16" if _cuda_bf16(device) else "float16"
        if device_type == "cpu" and training and hardware.cpu_has_native_bf16():
            return "bfloat16"
        return "float32"
    if dtype not in DTYPES:
        raise UserError(f"{key}={dtype!r} is not one of auto, {', '.join(DTYPES)}")
    if dtype == "float16" and device_type == "cpu":
        raise UserError(f"{key}='float16' is not supported on the CPU: use bfloat16 or float32")
    if dtype == "bfloat16" and device_type == "cuda" and not _cuda_bf16(device):
        raise UserError(f"this GPU does not support bfloat16: use --{key}=float16 (with a grad scaler) or float32")
    return dtype


def _cuda_bf16(device: str) -> bool:
    """Native bf16 (Ampere+) on `device` itself: torch.cuda.is_bf16_supported asks the current GPU, and says yes to
    the slow emulation on V100/T4."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_properties(torch.device(device)).major >= 8


def dtype_reason(dtype: str, device: str) -> str:
    if dtype != "auto":
        return "set explicitly"
    if device.split(":")[0] == "cpu":
        return "auto: this CPU has bf16 in hardware" if hardware.cpu_has_native_bf16() else (
            "auto: this CPU has no bf16 in hardware (no AVX-512-BF16/AMX), bf16 would be emulated")
    return "auto: the device's fastest exact dtype"


def resolve_attention(attention: str, device: str, dtype: str) -> tuple[str, str]:
    """The attention path and why: 'auto' -> the one measured fastest (docs/performance.md): math on a CPU under bf16
    (plain bf16 matmuls; the CPU flash backward is slow), SDPA everywhere else."""
    if attention not in ("auto", "math", "sdpa"):
        raise UserError(f"attention={attention!r} is not one of auto, math, sdpa")
    if attention != "auto":
        return attention, "set explicitly"
    if device.split(":")[0] == "cpu" and dtype == "bfloat16":
        return "math", "auto: CPU under bf16, where SDPA's flash backward is slow"
    return "sdpa", f"auto: {device.split(':')[0]} {dtype}, SDPA's fused kernels are fastest"


# Sampling on a CPU under bf16 takes math attention up to this window: past it math's (T x T) scores cost more than
# SDPA's flash kernel saves (measured side by side: docs/).
MATH_SAMPLING_MAX_BLOCK = 256


def resolve_sampling_attention(
    attention: str, device: str, dtype: str, block_size: int, sdpa_backend: str | None = None
) -> tuple[str, str]:
    """The attention to generate with and why: as resolve_attention, but SDPA past MATH_SAMPLING_MAX_BLOCK or when
    an sdpa_backend was asked for. `dtype`: that of the window recomputed past block_size."""
    chosen, why = resolve_attention(attention, device, dtype)
    if attention != "auto" or chosen != "math":
        return chosen, why
    if sdpa_backend is not None:
        return "sdpa", f"auto: sdpa_backend={sdpa_backend!r} was asked for"
    if block_size > MATH_SAMPLING_MAX_BLOCK:
        return "sdpa", f"auto: a {block_size}-position window, where SDPA's CPU kernel beats math"
    return "math", f"auto: a CPU under bf16 and a window of {block_size} positions, where math's bf16 matmuls win"


def resolve_fused_loss(fused_loss: bool | None, device: str) -> bool:
    """None -> the loss measured fastest: fused and chunked on the CPU (no (tokens x vocab) block to write and read);
    plain on a GPU, where compile fuses it and the fused loss's chunks unroll into a slower graph (docs/gpu.md)."""
    return fused_loss if fused_loss is not None else device.split(":")[0] == "cpu"


def autocast_context(device: str, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=DTYPES[dtype])


def set_tf32(enabled: bool) -> None:
    # The one call every torch version reads back consistently (mixing it with the per-backend fp32_precision
    # settings of torch 2.9+ makes get_float32_matmul_precision() raise, which inductor's autotuning calls).
    torch.set_float32_matmul_precision("high" if enabled else "highest")


def set_deterministic(enabled: bool) -> None:
    """Bitwise repeatable runs, which eager CPU training is already but compile's CPU kernels (atomic adds in the
    embedding backward) and some CUDA ones are not; cuBLAS also needs CUBLAS_WORKSPACE_CONFIG before it starts."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)


def keep_freed_memory(enabled: bool, device: str = "cpu") -> bool:
    """Keep glibc's freed memory (1 GiB trim threshold, mmap threshold at its maximum) for a CPU run: a step frees
    and re-allocates the same activations, and the page faults and zeroing of fresh pages are a large share of a
    small model's step. Returns whether it applied (glibc on Linux only)."""
    if not enabled or device.split(":")[0] != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>
    settings = ((M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 256 << 20), (M_MMAP_THRESHOLD, 32 << 20))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def synchronize(device: str) -> None:
    """Wait for queued device work, so timings measure it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # that GPU: without an argument, the current one (GPU 0 unless set)
    elif device.startswith("mps"):
        torch.mps.synchronize()


class DeviceClock:
    """Time points on the device's own timeline, taken without waiting for it (CUDA: events in the stream; the CPU:
    the host clock; others wait for their queue). Read ms(a, b) after one synchronize at the end."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device.startswith("cuda")

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        if not self.device.startswith("cpu"):
            synchronize(self.device)
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000
