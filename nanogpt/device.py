"""
The device and its precision, for training, sampling and benchmarks alike: which device ("auto": a GPU, else MPS,
else the CPU), which dtype ("auto": bf16 where it is fast and exact enough), which attention path and loss path
("auto": the one measured fastest there), autocast, TF32, deterministic algorithms, glibc malloc's freed memory,
and time on the device's own timeline (DeviceClock).
"""
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
    """'auto' -> 'cuda' if a GPU is there, else 'mps', else 'cpu'; anything else is checked and returned."""
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
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
    """
    'auto' -> bfloat16 where it is fast and exact enough: CUDA GPUs with bf16 support (else float16 with a grad
    scaler), and for training on a CPU with bf16 in hardware (AVX-512-BF16 or AMX), where autocast runs the matmuls
    in bf16 (faster than float32, with the same loss curve: docs/performance.md). A CPU without them (AVX2 only)
    emulates bf16 matmuls, slower than float32: float32. Generation on the CPU stays float32: one token at a time is
    matrix-vector work, where autocast's casts cost more than bf16 saves. `key`: the setting the messages name.
    """
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
    """Native bf16 (Ampere and later) on `device` itself: torch.cuda.is_bf16_supported asks the current device (GPU
    0 unless set_device ran), and also says yes for the slow emulation on V100/T4."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_properties(torch.device(device)).major >= 8


def dtype_reason(dtype: str, device: str) -> str:
    """Why dtype='auto' chose what it did, for the settings line."""
    if dtype != "auto":
        return "set explicitly"
    if device.split(":")[0] == "cpu":
        return "auto: this CPU has bf16 in hardware" if hardware.cpu_has_native_bf16() else (
            "auto: this CPU has no bf16 in hardware (no AVX-512-BF16/AMX), bf16 would be emulated")
    return "auto: the device's fastest exact dtype"


def resolve_attention(attention: str, device: str, dtype: str) -> tuple[str, str]:
    """
    attention='auto' -> the path measured fastest for the device and dtype (docs/performance.md), and the reason
    (for the settings line): on a CPU under bf16 the explicit math attention, whose work is plain bf16 matmuls, where
    the CPU flash kernel's backward is slow; everywhere else SDPA (CUDA: its flash kernel; CPU float32: its fused
    kernel, far faster than math). An explicit "math"/"sdpa" is kept.
    """
    if attention not in ("auto", "math", "sdpa"):
        raise UserError(f"attention={attention!r} is not one of auto, math, sdpa")
    if attention != "auto":
        return attention, "set explicitly"
    if device.split(":")[0] == "cpu" and dtype == "bfloat16":
        return "math", "auto: CPU under bf16, where SDPA's flash backward is slow"
    return "sdpa", f"auto: {device.split(':')[0]} {dtype}, SDPA's fused kernels are fastest"


# Sampling on a CPU under bf16 takes math attention for windows up to this many positions: past it the quadratic
# scores matrix math materialises costs more than SDPA's flash kernel saves (measured side by side: docs/).
MATH_SAMPLING_MAX_BLOCK = 256


def resolve_sampling_attention(
    attention: str, device: str, dtype: str, block_size: int, sdpa_backend: str | None = None
) -> tuple[str, str]:
    """
    The attention to generate with (sample.py) and the reason. `dtype`: that of the heavy
    work, the window recomputed past block_size. 'auto' -> math on a CPU under bf16 for a window of at most
    MATH_SAMPLING_MAX_BLOCK positions, unless an sdpa_backend was asked for; SDPA everywhere else. An explicit
    "math"/"sdpa" is kept.
    """
    chosen, why = resolve_attention(attention, device, dtype)
    if attention != "auto" or chosen != "math":
        return chosen, why
    if sdpa_backend is not None:
        return "sdpa", f"auto: sdpa_backend={sdpa_backend!r} was asked for"
    if block_size > MATH_SAMPLING_MAX_BLOCK:
        return "sdpa", f"auto: a {block_size}-position window, where SDPA's CPU kernel beats math"
    return "math", f"auto: a CPU under bf16 and a window of {block_size} positions, where math's bf16 matmuls win"


def resolve_fused_loss(fused_loss: bool | None, device: str) -> bool:
    """
    fused_loss=None -> the loss path measured fastest for the device: the fused, chunked head + cross-entropy on the
    CPU (a fraction of the loss's memory, and faster: no (tokens x vocab) block to write and read back); the plain
    head on a GPU, where torch.compile fuses the plain cross-entropy into a few kernels while the fused loss's chunks
    unroll into the graph and measured slower (docs/gpu.md).
    """
    if fused_loss is not None:
        return fused_loss
    return device.split(":")[0] == "cpu"


def autocast_context(device: str, dtype: str) -> contextlib.AbstractContextManager:
    """Mixed precision: matmuls in bf16/fp16, reductions (softmax, loss, norms) in float32; float32: no autocast."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":")[0], dtype=DTYPES[dtype])


def set_tf32(enabled: bool) -> None:
    """TF32 tensor-core matmuls and convolutions on Ampere+ GPUs (10-bit mantissa inputs, float32 accumulate).
    CUDA only: the CPU has no TF32."""
    # The one call every torch version reads back consistently (mixing it with the per-backend fp32_precision
    # settings of torch 2.9+ makes get_float32_matmul_precision() raise, which inductor's autotuning calls).
    torch.set_float32_matmul_precision("high" if enabled else "highest")


def set_deterministic(enabled: bool) -> None:
    """
    Bitwise repeatable runs: torch.use_deterministic_algorithms. Eager CPU training already is; torch.compile's
    CPU kernels are not (its embedding backward accumulates with atomic adds, so even the same step twice differs
    in the last bits), and neither are some CUDA kernels. Ops with no deterministic implementation warn once. On
    CUDA cuBLAS also needs CUBLAS_WORKSPACE_CONFIG, set here unless already set (before cuBLAS starts).
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)


def keep_freed_memory(enabled: bool, device: str = "cpu") -> bool:
    """
    glibc's malloc hands freed memory back to the OS (heap trimming, and mmap for large blocks with a threshold
    that keeps moving), while a training step frees and re-allocates the same activation buffers every step: the
    page faults and the zeroing of fresh pages are a large share of a small model's CPU step. Keep freed
    memory instead: a 1 GiB trim threshold, 256 MiB heap padding, and the mmap threshold fixed at its 32 MiB
    maximum. For a run on `device`: a CPU's ("cpu", "cpu:0"); a GPU's activations are not malloc's. Returns whether
    it applied (glibc on Linux only; jemalloc/tcmalloc users need nothing).
    """
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
    """Wait for queued device work, so timings measure it (a no-op on the CPU, which runs eagerly)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # that GPU: without an argument, the current one (GPU 0 unless set)
    elif device.startswith("mps"):
        torch.mps.synchronize()


class DeviceClock:
    """
    Time points on the device's own timeline, taken without waiting for it: on CUDA an event recorded in the stream
    (its time is when the GPU gets there), on the CPU the host clock (the CPU runs each op as it is called); other
    devices wait for their queue first. Read the times with ms(a, b) after one synchronize at the end: so what is
    timed is the loop as it runs, with no wait inside it.
    """

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
        """Milliseconds from mark a to mark b (after the device finished both)."""
        return a.elapsed_time(b) if self.cuda else (b - a) * 1000
