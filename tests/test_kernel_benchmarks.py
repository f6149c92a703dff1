"""benchmarks/attention.py and benchmarks/elementwise.py on the CPU: every kernel that runs here matches float64 math
attention, the ones that cannot are rows with their reason, auto says which kernel it picked, the fa4 row leaves
PyTorch's flash kernel to the rows after it; the memory-bound kernels' rows measure time and the bytes they must move,
and their timed steps write no more. The same scripts run on a GPU at the recipe's shapes (docs/gpu.md)."""
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


@pytest.fixture
def fake_fa4(monkeypatch):
    """torch's hook for newer flash kernels, replaced by a recorder of what sits behind SDPA's flash kernel (None:
    PyTorch's own), and fa4 let through as on an H100 with flash-attn-4: on the CPU its row runs SDPA's flash kernel.
    Returns the recorder and the list of (row's kernel, impl active) at each attention call of a row."""
    import torch.nn.attention as torch_attention

    active: dict = {"impl": None}
    monkeypatch.setattr(torch_attention, "activate_flash_attention_impl", lambda impl: active.update(impl=impl))
    monkeypatch.setattr(torch_attention, "restore_flash_attention_impl", lambda *a, **k: active.update(impl=None))
    monkeypatch.setattr(torch_attention, "current_flash_attention_impl", lambda: active["impl"])
    monkeypatch.setattr(attention, "flash_impl_problem", lambda impl, device: None)
    row, calls = [None], []
    measure, run_once = attention.measure, attention.run_once

    def measure_row(kernel, *args):
        row[0] = kernel
        return measure(kernel, *args)

    def run_recorded(*args, **kwargs):
        calls.append((row[0], active["impl"]))
        return run_once(*args, **kwargs)

    monkeypatch.setattr(attention, "measure", measure_row)
    monkeypatch.setattr(attention, "run_once", run_recorded)
    return active, calls


ATTENTION_ARGS = ["--shapes=2x16,1x32", "--heads=2", "--head_size=16", "--dtype=float32", "--device=cpu", "--repeats=1"]


def test_the_fa4_row_gives_the_flash_kernel_back_to_the_rows_after_it(fake_fa4):
    """FlashAttention-4, once activated, holds for the whole process: the fa4 row takes it back when it ends, so that
    the flash and auto rows after it, the next shape's too, measure PyTorch's own kernel."""
    active, calls = fake_fa4
    rows = attention.main(ATTENTION_ARGS + ["--kernels=fa4,flash,auto"])
    assert [r["status"] for r in rows] == ["ok"] * 6
    assert {impl for kernel, impl in calls if kernel == "fa4"} == {"FA4"}
    assert {impl for kernel, impl in calls if kernel != "fa4"} == {None}
    assert {kernel for kernel, _ in calls} == {"fa4", "flash", "auto"} and active["impl"] is None


def test_a_failed_fa4_row_gives_the_flash_kernel_back_too(fake_fa4, monkeypatch):
    """Failed or not: a kernel that refuses the case (a RuntimeError: an n/a row) and an error that ends the benchmark
    both leave PyTorch's own kernel behind."""
    active, calls = fake_fa4
    run_recorded = attention.run_once

    def fa4_refuses(*args, **kwargs):
        if active["impl"] == "FA4":
            raise RuntimeError("FlashAttention-4 refuses this case")
        return run_recorded(*args, **kwargs)

    monkeypatch.setattr(attention, "run_once", fa4_refuses)
    rows = attention.main(ATTENTION_ARGS + ["--kernels=fa4,flash"])
    assert [(r["kernel"], r["status"]) for r in rows] == [("fa4", "n/a"), ("flash", "ok")] * 2
    assert {impl for kernel, impl in calls} == {None} and {kernel for kernel, _ in calls} == {"flash"}
    assert active["impl"] is None

    def fa4_crashes(*args, **kwargs):
        raise KeyboardInterrupt  # not a refusal: the benchmark stops
    monkeypatch.setattr(attention, "run_once", fa4_crashes)
    with pytest.raises(KeyboardInterrupt):
        attention.main(ATTENTION_ARGS + ["--kernels=fa4"])
    assert active["impl"] is None


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


def bytes_allocated(fn) -> int:
    """The bytes CPU allocations take while fn runs, from the profiler's record of each one."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0)


@pytest.mark.parametrize("name", ["layernorm", "gelu"])
def test_a_timed_step_allocates_only_what_its_least_bytes_count_as_written(name):
    """least_bytes counts two writes per step, the output and the input's gradient: a step that also made a tensor of
    the output's size (the upstream gradient, say) would move bytes the row does not count, and its bandwidth would
    come out low. The timed steps' allocations are what 5 repeats allocate more than 1 does, after a warm-up run (the
    compile)."""
    def measure(repeats):
        return lambda: elementwise.measure(name, 64, 256, "cpu", repeats, None)

    measure(1)()
    per_step = (bytes_allocated(measure(5)) - bytes_allocated(measure(1))) / 4
    fn, args, _ = elementwise.KERNELS[name](64, 256, "cpu")
    x = args[0].detach().requires_grad_()
    y = fn(x, *args[1:])
    y.backward(torch.ones_like(y))
    written, output = y.nbytes + x.grad.nbytes, y.nbytes
    assert written <= per_step < written + output  # beyond them: LayerNorm's mean, rstd, dw and db, all small
