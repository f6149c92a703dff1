"""
What the CUDA suite's modules share: the skip marker, tolerances per dtype, and torchrun.

Every module of tests/cuda/ is marked `pytestmark = requires_cuda`: on a machine without an NVIDIA GPU pytest
collects it and skips each test with the reason below. The CPU suite's helpers (tests/helpers.py: datasets,
tiny configs, subprocesses) are imported from there, not copied.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

NO_CUDA = "CUDA suite: needs an NVIDIA GPU (torch.cuda.is_available() is False here)"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


def requires_gpus(n: int) -> pytest.MarkDecorator:
    if not torch.cuda.is_available():
        return pytest.mark.skipif(True, reason=NO_CUDA)
    have = torch.cuda.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs, this machine has {have}")


def capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def has_bf16() -> bool:
    return capability()[0] >= 8


requires_bf16 = pytest.mark.skipif(
    torch.cuda.is_available() and not has_bf16(), reason="this GPU has no native bfloat16 (before Ampere)"
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tolerances by dtype for one tensor against a float64 reference, at the sizes these tests use (head size 64,
# up to 256 keys; activations of unit scale). float32 on the GPU: TF32 off in these tests, so only the summation
# order differs (~1e-6 relative); float16 keeps 10 mantissa bits (~5e-4 per rounding), bfloat16 7 (~4e-3), and
# an attention output is a weighted sum of many rounded products, hence a few units of the last place.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=4e-2, rtol=4e-2),
}
# Losses and gradients of whole (tiny) models: more operations in a row, so looser (relative to the norm).
MODEL_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64, on out's device (a float64 reference is often computed on the CPU)."""
    out, ref = out.double(), ref.to(out.device, torch.float64)
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def torchrun(args: list[str], nproc: int = 1, env: dict | None = None, timeout: float = 600,
             **kw) -> subprocess.CompletedProcess | subprocess.Popen:
    """`torchrun --standalone --nproc_per_node=nproc ARGS` from the repo root, output captured as text.
    With popen=True, the running process (for signal tests)."""
    exe = shutil.which("torchrun")
    cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", f"--nproc_per_node={nproc}", *args]
    full_env = {**os.environ, **(env or {})}
    if kw.pop("popen", False):
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, **kw)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout, **kw)
