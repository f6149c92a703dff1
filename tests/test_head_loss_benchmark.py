"""benchmarks/head_loss.py on the CPU: each implementation's loss and gradients against float32's plain loss, a
missing library as a row that names its pip command, and the arguments it refuses."""
from __future__ import annotations

import os
import sys

import pytest

from nanogpt.errors import UserError
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import head_loss as bench_loss  # noqa: E402


@pytest.mark.parametrize("name", ["plain (compiled)", "fused_loss.py"])
def test_a_row_measures_the_loss_and_its_errors_against_float32(name):
    fn = bench_loss.plain if name == "plain (compiled)" else bench_loss.ours  # eager here: the same function
    row = bench_loss.measure(name, fn, tokens=64, device="cpu", repeats=1)
    assert row["status"] == "ok" and row["ms"] > 0 and row["waits_for_host"] is None  # no CUDA to wait for
    # bf16 autocast against float32: rounding-sized errors, and no gradient for the padding rows
    assert row["errors"]["loss"] < 1e-2 and 1e-5 < row["errors"]["grad_x"] < 2e-2 and row["errors"]["grad_w"] < 2e-2
    assert row["padded_rows_grad"] == 0


def test_a_wrong_loss_shows_in_its_errors():
    """The errors are measured, not assumed: a loss that drops the ignore_index is far from the reference."""
    import torch.nn.functional as F

    def ignores_nothing(x, w, t):
        return F.cross_entropy(F.linear(x, w)[:, : bench_loss.VOCAB], t.clamp(min=0), reduction="sum")

    row = bench_loss.measure("wrong", ignores_nothing, tokens=200, device="cpu", repeats=1)
    assert row["errors"]["loss"] > 1e-2


def test_a_missing_library_is_a_row_with_its_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails as if not installed
    row = bench_loss.measure("liger-kernel", bench_loss.liger, tokens=8, device="cpu", repeats=1)
    assert row["status"] == "n/a" and "pip install liger_kernel" in row["reason"]


def test_bad_arguments_are_refused_in_one_line():
    with pytest.raises(UserError, match="--tokens='12k' must be comma-separated integers"):
        bench_loss.parse_args(["--tokens=12k"])
    with pytest.raises(UserError, match="--only: unknown 'lig'"):
        bench_loss.parse_args(["--only=lig"])
