"""
The peak FLOP/s that MFU (model FLOPs utilisation) divides by: a known GPU's from its datasheet (PEAK_FLOPS), a CPU's
measured (its best matmul in the run's dtype, kept per machine in ~/.cache/nanogpt/), or the --peak_flops given; and
an MFU as printed.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time

import torch

from nanogpt import hardware
from nanogpt.device import DTYPES

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


PEAK_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nanogpt", "cpu_peak_flops.json")


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
    key = f"{hardware.cpu_name()} | {threads} threads | {dtype}"
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


def resolve_peak_flops(device: str, dtype: str, given: float | None = None) -> tuple[float | None, str]:
    """The peak FLOP/s that MFU divides by, and where it comes from: `given` (--peak_flops) wins; a known GPU's from
    mfu.PEAK_FLOPS; a CPU's measured in the run's dtype (measured_cpu_peak_flops); else None."""
    if given is not None:
        return given, "--peak_flops"
    if device.split(":")[0] == "cpu":
        if dtype in ("bfloat16", "float16") and not hardware.cpu_has_native_bf16():
            # emulated half matmuls have no peak worth dividing by (and measuring one took seconds)
            return None, f"this CPU emulates {dtype} (no AVX-512-BF16/AMX): give --peak_flops"
        return measured_cpu_peak_flops(dtype), f"measured {dtype} matmul peak of this CPU ({PEAK_CACHE})"
    peak = device_peak_flops(device)
    return peak, ("the GPU's bf16 table peak" if peak is not None else "unknown: give --peak_flops")
