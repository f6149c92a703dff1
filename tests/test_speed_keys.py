"""The GPU speed keys on a CPU: compile_mode and fp8 are checked in one line before any slow work (the CUDA suite
runs them: tests/cuda/test_cuda_speed_keys.py; float8.py's own tests: tests/test_float8.py)."""
from __future__ import annotations

import pytest

from nanogpt.errors import UserError
from helpers import make_char_dataset, tiny_config
from train import train


@pytest.fixture()
def data_dir(tmp_path):
    make_char_dataset(tmp_path / "data")
    return tmp_path / "data"


def test_fp8_is_refused_on_a_cpu_in_one_line_before_the_model_is_built(data_dir, tmp_path, monkeypatch):
    from nanogpt import start

    built = []
    monkeypatch.setattr(start, "init_model", lambda *a: built.append(a))
    with pytest.raises(UserError) as e:
        train(tiny_config(data_dir, tmp_path / "out", fp8=True, dtype="bfloat16"))
    assert str(e.value).startswith("fp8=True needs an NVIDIA GPU of compute capability 8.9 or later (H100, H200, L4, "
                                   "RTX 40xx), and device='cpu' is not one: set fp8=False")
    assert built == []


def test_compile_mode_is_checked_and_cuda_graphs_are_refused_off_cuda(data_dir, tmp_path):
    with pytest.raises(UserError, match=r"compile_mode='fastest' is not one of default, max-autotune-no-cudagraphs, "
                                        r"max-autotune, reduce-overhead"):
        tiny_config(data_dir, tmp_path, compile_mode="fastest").check(1)
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(UserError) as e:
            train(tiny_config(data_dir, tmp_path / "out", compile_mode=mode))
        assert str(e.value) == (f"compile_mode={mode!r} records CUDA graphs, which need a CUDA device, not 'cpu': "
                                f"use 'default' or 'max-autotune-no-cudagraphs'")
