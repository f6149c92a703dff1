"""benchmarks/head_loss.py on the CPU: each implementation's loss and gradients against float32's plain loss, a
missing library as a row that names its pip command, and the arguments it refuses."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from nanogpt.errors import UserError
from helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import head_loss as bench_loss  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain (compiled)", "fused_loss.py", "gradient in forward"])
def test_a_row_measures_the_loss_and_its_errors_against_float32(name):
    fn = bench_loss.plain if name == "plain (compiled)" else bench_loss.IMPLEMENTATIONS[name]  # eager here
    row = bench_loss.measure(name, fn, tokens=64, device="cpu", repeats=1)
    assert row["status"] == "ok" and row["ms"] > 0 and row["waits_for_host"] is None  # no CUDA to wait for
    # bf16 autocast against float32: rounding-sized errors, and no gradient for the padding rows
    assert row["errors"]["loss"] < 1e-2 and 1e-5 < row["errors"]["grad_x"] < 2e-2 and row["errors"]["grad_w"] < 2e-2
    assert row["padded_rows_grad"] == 0


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_gradient_written_in_the_forward_is_the_plain_losss_in_float32():
    """llm.c's way (the gradient computed with the loss, over the logits' buffer): in float32, without autocast, the
    loss and both gradients are the plain loss's to float32's rounding, the ignored targets and padded rows included."""
    x, w, t = bench_loss.inputs(300, "cpu", seed=3)
    ours = bench_loss.loss_and_grads(bench_loss.gradient_in_forward, x, w, t, autocast=False)
    plain = bench_loss.loss_and_grads(bench_loss.plain, x, w, t, autocast=False)
    for a, b in zip(ours, plain):
        assert bench_loss.relative_error(a, b) < 1e-6
    assert ours[2][bench_loss.VOCAB:].abs().max() == 0


def logits_sized_float32_buffers(fn, tokens: int) -> tuple[int, int]:
    """How many float32 (tokens x padded vocab) buffers one forward + backward of `fn` under bf16 autocast allocates,
    and the most alive at once: from the profiler's record of every CPU allocation and free, kernels' own temporaries
    included (torch.logsumexp's, say), which a count of the Python-visible tensors would miss."""
    x, w, t = bench_loss.inputs(tokens, "cpu")
    size = tokens * bench_loss.PADDED * 4  # no other tensor of the step has this many bytes at 40 tokens
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        bench_loss.loss_and_grads(fn, x, w, t, autocast=True)
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and abs(e.nbytes()) == size]
    made = live = most = 0
    for e in sorted(events, key=lambda e: e.start_ns()):  # an allocation: +nbytes, its free: -nbytes
        made += e.nbytes() > 0
        live += 1 if e.nbytes() > 0 else -1
        most = max(most, live)
    return made, most


@pytest.mark.slow
def test_the_gradient_in_forward_makes_one_float32_copy_of_the_logits():
    """Its point is memory: the bf16 logits are copied to float32 once, and the loss, the softmax and the gradient are
    computed in that one buffer, the peak the benchmark reports on a GPU. A second copy, or a kernel's temporary of
    the same size, shows here."""
    assert logits_sized_float32_buffers(bench_loss.gradient_in_forward, tokens=40) == (1, 1)


def test_quack_needs_a_gpu_and_says_so():
    row = bench_loss.measure("quack-kernels", bench_loss.quack, tokens=8, device="cpu", repeats=1)
    assert row["status"] == "n/a" and row["reason"] == "quack-kernels: its kernels run on NVIDIA GPUs only"
