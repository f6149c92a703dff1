"""benchmarks/attention.py and benchmarks/elementwise.py on the CPU: every kernel that runs here matches float64 math
attention, the ones that cannot are rows with their reason, auto says which kernel it picked; the memory-bound kernels'
rows measure time and the bytes they must move. The same scripts run on a GPU at the recipe's shapes (docs/gpu.md)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers import ROOT
from nanogpt.errors import UserError

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import attention  # noqa: E402
import elementwise  # noqa: E402


def test_every_attention_kernel_that_runs_here_matches_float64_and_the_others_say_why():
    rows = {r["kernel"]: r for r in attention.main(["--shapes=2x48", "--heads=2", "--head_size=16", "--dtype=float32",
                                                     "--device=cpu", "--repeats=2",
                                                     "--kernels=flash,math,auto,cudnn,efficient,fa4"])}
    for kernel in ("flash", "math", "auto"):
        row = rows[kernel]
        assert row["status"] == "ok" and row["forward_ms"] > 0 and row["total_ms"] > 0, row
        assert max(row["errors"].values()) < 1e-5, row  # float32 against float64: rounding only
    assert rows["auto"]["picks"] in ("flash", "math")
    for kernel in ("cudnn", "efficient"):
        assert rows[kernel]["status"] == "n/a" and "CUDA only" in rows[kernel]["reason"]
    assert rows["fa4"]["status"] == "n/a" and "flash_impl='fa4'" in rows["fa4"]["reason"]


def test_a_wrong_attention_shows_in_its_errors(monkeypatch):
    """The errors are measured against float64 math attention, not assumed: an attention that is not causal is far
    from it."""
    import torch.nn.functional as F

    monkeypatch.setattr(attention, "attention_fn", lambda kernel, device: (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=False)))
    row = attention.measure("flash", (2, 2, 32, 16), attention.DTYPES["float32"], "cpu", 1, None)
    assert row["status"] == "ok" and row["errors"]["out"] > 1e-2


def test_attention_arguments_are_refused_in_one_line():
    with pytest.raises(UserError, match="unknown kernel 'flashy'"):
        attention.parse_args(["--kernels=flashy"])
    with pytest.raises(UserError, match="give batch x tokens"):
        attention.parse_args(["--shapes=64by1024"])


def test_the_memory_bound_kernels_rows_say_time_bytes_and_bandwidth():
    rows = elementwise.main(["--tokens=256", "--width=64", "--device=cpu", "--repeats=2"])
    assert [r["kernel"] for r in rows] == ["layernorm", "gelu"]
    for row, make in zip(rows, (elementwise.layer_norm, elementwise.gelu)):  # the bytes of the tensors it touches:
        fn, args, least = make(64, 256, "cpu")  # the input read in the forward and again in the backward, the
        x = args[0].detach().requires_grad_()  # output written, its gradient read, the input's gradient written
        y = fn(x, *args[1:])
        y.backward(torch.ones_like(y))
        assert least == row["least_bytes"] == 2 * x.nbytes + 2 * y.nbytes + x.grad.nbytes
    assert all(r["ms"] > 0 and r["bandwidth"] == pytest.approx(r["least_bytes"] / r["ms"] * 1000) for r in rows)
    assert elementwise.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert elementwise.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12 and elementwise.peak_bandwidth("Tesla T4") is None
