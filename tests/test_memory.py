"""benchmarks/memory.py: peak memory by sequence length (math attention against SDPA) and the largest-batch search."""
from __future__ import annotations

import json

import matplotlib.image
import pytest
import torch

import bench
from benchmarks import memory
from nanogpt.errors import UserError
from helpers import hide_module, run_in_process
from test_bench import TINY, bench_script, table_rows


@pytest.mark.slow
def test_math_attention_needs_at_least_its_attention_matrices_more_than_sdpa(tmp_path):
    out = bench_script("--memory_seq_lens=256,1024", f"--results_dir={tmp_path}", script="benchmarks/memory.py")
    study = json.loads((tmp_path / "memory.json").read_text())
    points = {(p["path"], p["seq_len"]): p for p in study["points"]}
    assert set(points) == {(p, T) for p in ("math", "sdpa/auto") for T in (256, 1024)}
    assert all(p["status"] == "ok" and "VmHWM" in p["memory_measure"] for p in points.values())
    # math attention keeps each layer's softmax output, a (B, nh, T, T) float32 matrix, for backward; SDPA's CPU
    # kernel keeps (B, nh, T) statistics. At T=1024: 2 layers x 1 x 2 heads x 1024^2 x 4 bytes = 16 MiB at least.
    matrices_mib = 2 * 1 * 2 * 1024**2 * 4 / 2**20
    difference = points["math", 1024]["peak_memory_mib"] - points["sdpa/auto", 1024]["peak_memory_mib"]
    assert difference >= matrices_mib, study
    printed = table_rows(out, ("math", "sdpa/auto", "math - sdpa"))
    assert float(printed[2][2]) == pytest.approx(difference, abs=1)
    ratio = points["math", 1024]["peak_memory_mib"] / points["sdpa/auto", 1024]["peak_memory_mib"]
    assert f"math/SDPA peak memory at T=1024: {ratio:.2f}x" in out
    assert [(r["path"], r["status"], r["reason"]) for r in study["largest_batch"]] == [
        ("math", "n/a", "CUDA only"), ("sdpa/auto", "n/a", "CUDA only")]
    image = matplotlib.image.imread(tmp_path / "memory.png")
    assert image.shape[:2] == (480, 720) and image[..., :3].std() > 0.05  # 6 x 4 inches at 120 dpi, not blank


def test_every_child_run_is_eager():
    runs = memory.child_runs(memory.MemoryConfig(memory_seq_lens=(64, 128), memory_budget_gb=2.0))
    assert [(r["kind"], r["path"], r["seq_len"]) for r in runs] == [
        ("point", "math", 64), ("point", "math", 128), ("point", "sdpa/auto", 64), ("point", "sdpa/auto", 128),
        ("largest_batch", "math", None), ("largest_batch", "sdpa/auto", None)]
    assert all(r["overrides"]["compile"] is False for r in runs)
    assert runs[-1]["overrides"]["memory_budget_gb"] == 2.0 and runs[-1]["script"] == "benchmarks/memory.py"


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 5, 64, 100, 1000, 65536, 10**6])
def test_the_search_finds_the_largest_size_and_never_tries_past_its_cap(limit):
    tried = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= limit

    cap = 1000 if limit != 65536 else 65536
    assert memory.largest_fitting(fits, cap) == min(limit, cap)  # brute force: the largest b <= cap with b <= limit
    assert max(tried) <= cap and len(tried) <= 2 * cap.bit_length() + 2


def test_an_out_of_memory_error_after_unscale_does_not_break_the_next_trial(monkeypatch):
    """float16's grad scaler records unscale_ until update(); an OOM between them must not leave the next trial
    failing with "unscale_() has already been called"."""
    cfg, _ = bench.load_config([*TINY, "--block_size=16"])
    run = bench.setup_run(cfg)
    run["scaler"] = torch.amp.GradScaler("cpu", enabled=True)  # as float16 on a GPU
    real_unscale = torch.amp.GradScaler.unscale_
    calls = []

    def unscale_then_out_of_memory_once(self, optimizer):  # as if clipping then ran out of memory
        real_unscale(self, optimizer)
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", unscale_then_out_of_memory_once)
    assert memory.step_fits(run, cfg, 2) is False
    assert memory.step_fits(run, cfg, 2) is True


def test_the_studys_keys_are_refused_out_of_their_declared_ranges_in_one_message():
    with pytest.raises(UserError) as e:
        memory.main(["--memory_batch_size=0", "--memory_budget_gb=-1.0", "--memory_seq_lens=(0, 256)"])
    assert str(e.value) == ("memory_batch_size=0 must be at least 1; memory_budget_gb=-1.0 must be > 0 (or None); "
                            "memory_seq_lens=(0, 256) must be positive lengths, e.g. 256,512,1024")


@pytest.mark.slow
def test_the_largest_batch_search_is_cuda_only(tmp_path):
    cfg, _ = bench.load_config(TINY)
    with pytest.raises(UserError, match="find_max_batch needs CUDA"):
        memory.largest_batch(cfg, None)
    r = memory.run_child(TINY, {"find_max_batch": True}, str(tmp_path / "row.json"), script="benchmarks/memory.py")
    assert r["status"] == "n/a" and r["reason"].startswith("find_max_batch needs CUDA (the device is cpu)")


def test_without_matplotlib_the_study_stops_before_its_first_measurement(monkeypatch, capsys, tmp_path):
    hide_module(monkeypatch, "matplotlib")
    monkeypatch.setattr(memory, "memory_study", lambda *a: pytest.fail("measured before matplotlib was checked"))
    r = run_in_process(["benchmarks/memory.py", "--device=cpu", f"--results_dir={tmp_path}"], capsys)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "error: benchmarks/memory.py (for memory.png) needs matplotlib, which is not installed: pip install matplotlib"]
