"""Fixtures of the CUDA suite (tests/cuda/): a clean GPU state per test, and a tiny character dataset."""
from __future__ import annotations

import pytest
import torch

from helpers import make_char_dataset


@pytest.fixture(autouse=True)
def clean_cuda_state():
    """Each test starts with TF32 off and deterministic algorithms off, and leaves them so (tests that change the
    settings would otherwise leak them into the next), with the caching allocator emptied and the peak reset."""
    if not torch.cuda.is_available():
        yield
        return
    precision = torch.get_float32_matmul_precision()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_float32_matmul_precision("highest")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.set_float32_matmul_precision(precision)
    torch.use_deterministic_algorithms(deterministic)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture()
def char_data(tmp_path):
    """(data_dir, meta) of a small learnable character corpus (tests/helpers.py), in this test's tmp_path."""
    data_dir = tmp_path / "data"
    return data_dir, make_char_dataset(data_dir)
