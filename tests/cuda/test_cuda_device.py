"""CUDA: the run's device is the one every query and timing uses (issue 17, item 4), and the peak table knows it."""
from __future__ import annotations

import pytest
import torch

from nanogpt.device import resolve_dtype, synchronize
from cuda_helpers import requires_cuda, requires_gpus
from nanogpt.mfu import PEAK_FLOPS, device_peak_flops, gpu_peak_flops, resolve_peak_flops

pytestmark = requires_cuda


def test_this_gpu_has_a_peak_or_says_so():
    name = torch.cuda.get_device_name()
    peak = device_peak_flops("cuda")
    if peak is None:
        pytest.skip(f"{name!r} is not in mfu.PEAK_FLOPS ({', '.join(PEAK_FLOPS)}): MFU needs --peak_flops")
    assert peak == gpu_peak_flops(name)
    assert resolve_peak_flops("cuda", "bfloat16")[0] == peak  # what train.py's and bench.py's MFU divide by


@requires_gpus(2)
def test_second_gpu_is_synchronized_and_queried_not_gpu_0():
    torch.cuda.set_device(0)
    a = torch.randn(4096, 4096, device="cuda:1")
    for _ in range(20):  # queue seconds of work on GPU 1 only
        a = a @ a / 64
    synchronize("cuda:1")
    assert torch.cuda.default_stream(1).query()  # GPU 1 is idle: its work was waited for
    assert resolve_dtype("auto", "cuda:1") == ("bfloat16" if torch.cuda.get_device_capability(1)[0] >= 8 else "float16")
    assert device_peak_flops("cuda:1") == gpu_peak_flops(torch.cuda.get_device_name(1))
