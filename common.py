"""
The one place for what train.py, sample.py and bench.py share: device and precision setup and run information. Checkpoints live in checkpoint.py, sharded.py and run_checkpoints.py.

Imports errors.py and hardware.py only; never the model, a script, or the modules that import this one
(checkpoint.py, dataio.py, distributed.py, metrics.py, configurator.py, optim.py).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from types import ModuleType

import torch

from errors import UserError
from hardware import device_peak_flops


def plural(n: int, word: str) -> str:
    """A count and its noun, for printed messages: '1 sample', '2 samples', '0 samples', '12,000 examples'.
    `word` is the singular; the plural adds an s."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


# ----------------------------------------------------------------------------------------------- optional packages


def optional_import(package: str, needed_by: str) -> ModuleType:
    """Import a package that only some features use; missing, a UserError that names the pip command to install it.
    `needed_by`: what the user asked for that needs it ("plot.py", "wandb_log=True")."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and e.name == package
        why = "which is not installed" if missing else f"which fails to import ({e})"
        raise UserError(f"{needed_by} needs {package}, {why}: pip install {package}") from None


def pyplot(needed_by: str) -> ModuleType:
    """matplotlib.pyplot drawing into files only (no window); a UserError naming `pip install matplotlib` when
    matplotlib is not installed. Scripts call it before their slow work, so a missing package fails first."""
    matplotlib = optional_import("matplotlib", needed_by)
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


# ----------------------------------------------------------------------------------------------- device, dtype

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


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512-BF16 or AMX tiles); oneDNN emulates it otherwise."""
    cpu = torch.cpu
    return any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


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
    The attention to generate with (sample.py, benchmarks/generation.py) and the reason. `dtype`: that of the heavy
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


def dtype_reason(dtype: str, device: str) -> str:
    """Why dtype='auto' chose what it did, for the settings line."""
    if dtype != "auto":
        return "set explicitly"
    if device.split(":")[0] == "cpu":
        return "auto: this CPU has bf16 in hardware" if cpu_has_native_bf16() else (
            "auto: this CPU has no bf16 in hardware (no AVX-512-BF16/AMX), bf16 would be emulated")
    return "auto: the device's fastest exact dtype"


PEAK_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nanogpt", "cpu_peak_flops.json")


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


# One measuring matmul should take at most this long: a CPU that emulates bf16 (AVX2 only) runs a large bf16 matmul
# for seconds, and measuring several of them would delay every bf16 run's first step by as much.
MATMUL_BUDGET_S = 0.05


@functools.lru_cache(maxsize=None)
def _matmul_flops(dtype: str, threads: int, n: int, repeats: int) -> float:
    """FLOP/s of the best of `repeats` square matmuls in `dtype` (once per process: `threads` keys the cache): of
    size n, or smaller where one of size n would take longer than MATMUL_BUDGET_S (sizes from 256 up, doubling)."""
    gen = torch.Generator().manual_seed(0)  # its own: drawing from torch's global RNG would change the run's init
    size = min(n, 256)
    while True:
        a, b = (torch.randn(size, size, generator=gen).to(DTYPES[dtype]) for _ in range(2))
        a @ b  # warm-up: one-off costs of the first call at this size (thread pool, kernel choice)
        t0 = time.perf_counter()
        a @ b  # the time that decides the size
        if size >= n or 8 * (time.perf_counter() - t0) > MATMUL_BUDGET_S:  # doubling n takes 8x as long
            break
        size *= 2
    n = size
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measured_cpu_peak_flops(dtype: str, cache_path: str | None = None, n: int = 1024, repeats: int = 5) -> float:
    """
    The CPU's matmul FLOP/s in `dtype` ("float32" or "bfloat16") with this process's threads: the best of `repeats`
    square matmuls of size n (smaller where the CPU is too slow for that in `dtype`), measured once per process, and
    the best such figure ever measured on this machine (CPU name, thread count) and dtype, kept in cache_path. A
    machine busy with other work measures too low a peak (an MFU too high): keeping the maximum means such a
    measurement never lowers the figure, and a quiet run raises it.
    """
    cache_path = cache_path or PEAK_CACHE
    threads = torch.get_num_threads()
    key = f"{cpu_name()} | {threads} threads | {dtype}"
    cache = {}
    if os.path.exists(cache_path):
        with open(cache_path) as f:
            cache = json.load(f)
    # One thread's best matmul times the threads as well: other processes on the cores slow the threads' matmul
    # together (each waits for the slowest), while one thread's best of many short matmuls still finds a quiet
    # time slice; the figure may exceed what all the threads reach (a lone core runs faster), never fall short
    with torch_threads(1):
        single = _matmul_flops(dtype, 1, min(n, 512), 4 * repeats)
    best = max(float(cache.get(key, 0.0)), _matmul_flops(dtype, threads, n, repeats), single * threads)
    if best != cache.get(key):
        cache[key] = best
        os.makedirs(os.path.dirname(cache_path) or ".", exist_ok=True)
        with open(cache_path + f".{os.getpid()}.tmp", "w") as f:  # per process: runs may start together
            json.dump(cache, f, indent=1)
        os.replace(cache_path + f".{os.getpid()}.tmp", cache_path)
    return best


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def mfu_text(mfu: float | None) -> str:
    """An MFU as printed: a percentage, or n/a with the reason where the figure cannot be true (above 100%)."""
    if mfu is None:
        return "n/a"
    if mfu > 1:
        return "n/a (above 100%: the peak FLOP/s it divides by is too low for this machine; give --peak_flops)"
    return f"{mfu * 100:.2f}%"


def run_peak_flops(device: str, dtype: str, given: float | None = None) -> tuple[float | None, str]:
    """The peak FLOP/s that MFU divides by, and where it comes from: `given` (--peak_flops) wins; a known GPU's from
    hardware.PEAK_FLOPS; a CPU's measured in the run's dtype (measured_cpu_peak_flops); else None."""
    if given is not None:
        return given, "--peak_flops"
    if device.split(":")[0] == "cpu":
        if dtype in ("bfloat16", "float16") and not cpu_has_native_bf16():
            # emulated half matmuls have no peak worth dividing by (and measuring one took seconds)
            return None, f"this CPU emulates {dtype} (no AVX-512-BF16/AMX): give --peak_flops"
        return measured_cpu_peak_flops(dtype), f"measured {dtype} matmul peak of this CPU ({PEAK_CACHE})"
    peak = device_peak_flops(device)
    return peak, ("the GPU's bf16 table peak" if peak is not None else "unknown: give --peak_flops")


def resolve_dtype(dtype: str, device: str, training: bool = True) -> str:
    """
    'auto' -> bfloat16 where it is fast and exact enough: CUDA GPUs with bf16 support (else float16 with a grad
    scaler), and for training on a CPU with bf16 in hardware (AVX-512-BF16 or AMX), where autocast runs the matmuls
    in bf16 (faster than float32, with the same loss curve: docs/performance.md). A CPU without them (AVX2 only)
    emulates bf16 matmuls, slower than float32: float32. Generation on the CPU stays float32: one token at a time is
    matrix-vector work, where autocast's casts cost more than bf16 saves.
    """
    device_type = device.split(":")[0]
    if dtype == "auto":
        if device_type == "cuda":
            return "bfloat16" if _cuda_bf16(device) else "float16"
        if device_type == "cpu" and training and cpu_has_native_bf16():
            return "bfloat16"
        return "float32"
    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r} is not one of auto, {', '.join(DTYPES)}")
    if dtype == "float16" and device_type == "cpu":
        raise UserError("dtype='float16' is not supported on the CPU: use bfloat16 or float32")
    if dtype == "bfloat16" and device_type == "cuda" and not _cuda_bf16(device):
        raise UserError("this GPU does not support bfloat16: use --dtype=float16 (with a grad scaler) or float32")
    return dtype


def _cuda_bf16(device: str) -> bool:
    """Native bf16 (Ampere and later) on `device` itself: torch.cuda.is_bf16_supported asks the current device (GPU
    0 unless set_device ran), and also says yes for the slow emulation on V100/T4."""
    if torch.version.hip:
        return True
    return torch.cuda.get_device_properties(torch.device(device)).major >= 8


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


# ----------------------------------------------------------------------------------------------- run info


def run_info(device: str) -> dict[str, str]:
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
