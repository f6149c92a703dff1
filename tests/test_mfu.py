"""nanogpt/mfu.py: the CPU's measured peak FLOP/s for MFU (cached, never lowered by a busy machine), and an MFU
above 100% never printed as one."""
from __future__ import annotations

import json

import pytest
import torch

from nanogpt import hardware, mfu


def test_cpu_peak_keeps_the_best_measured_and_a_busy_measurement_never_lowers_it(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    key = f"{hardware.cpu_name()} | {torch.get_num_threads()} threads | "
    # a figure no CPU reaches stays (a measurement on a busy machine never lowers it); 123 FLOP/s, one no CPU
    # falls to, is replaced by the measured one, which the file then keeps
    cache.write_text(json.dumps({key + "float32": 1e18, key + "bfloat16": 123.0}))
    assert mfu.measured_cpu_peak_flops("float32", str(cache), n=64, repeats=1) == 1e18
    bf16 = mfu.measured_cpu_peak_flops("bfloat16", str(cache), n=64, repeats=1)
    assert bf16 > 1e6 and json.loads(cache.read_text()) == {key + "float32": 1e18, key + "bfloat16": bf16}
    monkeypatch.setattr(mfu, "PEAK_CACHE", str(cache))
    assert mfu.resolve_peak_flops("cpu", "float32") == (1e18, f"measured float32 matmul peak of this CPU ({cache})")
    assert mfu.resolve_peak_flops("cpu", "float32", given=5e12) == (5e12, "--peak_flops")
    assert mfu.resolve_peak_flops("mps", "float32") == (None, "unknown: give --peak_flops")
    # a CPU that emulates bf16 has no peak to divide by: none is measured (it took seconds), MFU says n/a
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(mfu, "measured_cpu_peak_flops", lambda dtype: pytest.fail("measured an emulated peak"))
    assert mfu.resolve_peak_flops("cpu", "bfloat16") == (
        None, "this CPU emulates bfloat16 (no AVX-512-BF16/AMX): give --peak_flops")
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(mfu, "measured_cpu_peak_flops", lambda dtype: 7e11)
    assert mfu.resolve_peak_flops("cpu", "bfloat16")[0] == 7e11


def test_measuring_the_cpu_peak_leaves_torchs_global_rng_alone(tmp_path):
    """A run measures the peak after seeding: a draw from the global RNG would change its initial weights (a
    torchrun worker measures, an in-process run may read the process's figure: DDP vs one process differed)."""
    mfu._matmul_flops.cache_clear()
    state = torch.get_rng_state()
    assert mfu.measured_cpu_peak_flops("float32", str(tmp_path / "peak.json"), n=32, repeats=1) > 0
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("budget, sizes", [(0.0, [256]), (1e9, [256, 512, 1024])])
def test_the_cpu_peak_matmul_shrinks_to_its_time_budget(monkeypatch, budget, sizes):
    """A CPU that emulates bf16 took 2.5 s per 1024^3 matmul: the measurement stops doubling the size once the next
    one would take longer than MATMUL_BUDGET_S (here none may: it stays at 256), else goes up to n."""
    drawn = []
    real_randn = torch.randn

    def randn(*shape, **kwargs):
        drawn.append(shape[0])
        return real_randn(*shape, **kwargs)

    monkeypatch.setattr(mfu, "MATMUL_BUDGET_S", budget)
    monkeypatch.setattr(torch, "randn", randn)
    assert mfu._matmul_flops.__wrapped__("float32", torch.get_num_threads(), 1024, 1) > 0
    assert drawn == [s for s in sizes for _ in range(2)]  # two operands of each size tried


def test_a_busy_start_cannot_collapse_the_cpu_peak(tmp_path, monkeypatch):
    """Bug: other processes on the cores during the start made the threads' matmul measure 0.001 TFLOP/s, and the run
    printed MFU 4,600-16,000%. One thread's best short matmul still finds a quiet slice; the peak is at least that
    times the threads, so a collapsed all-threads figure no longer decides it."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    busy = {1: 80e9, 2: 1e9}  # the 2-thread matmul waits for the busy core; one thread measures its real speed
    monkeypatch.setattr(mfu, "_matmul_flops", lambda dtype, threads, n, repeats: busy[threads])
    assert mfu.measured_cpu_peak_flops("float32", str(tmp_path / "peak.json")) >= 160e9


def test_an_mfu_above_100_percent_is_never_printed(tmp_path, capsys):
    """A peak too low for the machine (here --peak_flops=1) gives MFU n/a with the reason, in the log and the report."""
    from helpers import make_char_dataset, tiny_config
    from train import train

    make_char_dataset(tmp_path / "data")
    train(tiny_config(tmp_path / "data", tmp_path / "out", max_iters=4, eval_interval=4, log_interval=1, peak_flops=1.0,
                      report=True))
    printed = capsys.readouterr().out
    assert "mfu n/a (above 100%: the peak FLOP/s it divides by is too low for this machine; give --peak_flops)" in printed
    assert "%, grad norm" not in printed
    assert "MFU n/a (above 100%" in (tmp_path / "out" / "report.md").read_text()
