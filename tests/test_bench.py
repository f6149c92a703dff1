"""
bench.py in tiny configs on the CPU: one run's figures, the profile, the ablation table and its JSON, the
numerics and memory studies. Timings on a shared machine are noisy, so the tests check that the figures are
there, positive and consistent with each other, never how fast anything is.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from bench import (
    STUDIES,
    BenchConfig,
    detect_allocator,
    largest_batch,
    load_config,
    plot_ablation,
    run_child,
    selected_rows,
)
from common import PEAK_CACHE, UserError
from helpers import make_char_dataset, run_script
from model import GPT, GPTConfig

# No config file: on the CPU bench.py loads config/bench_cpu.py first, and these overrides replace its sizes.
TINY = [
    "--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=2",
    "--vocab_size=300", "--warmup_steps=1", "--timed_steps=3", "--compile=False", "--dtype=float32",
]
# One thread: a tiny model gains nothing from two, and two threads of a shared machine make the timings erratic.
# The ablation's rows must inherit it (the same environment for every row).
ENV = {"OMP_NUM_THREADS": "1"}

# The rows train the same weights on the same random tokens for 4 steps at a high learning rate, which takes the
# held-out loss from ~5.66 to ~4.63, so agreeing to the tolerances below is not agreeing by default. float32 rows
# differ only by rounding, grown by the steps (measured up to 5e-5); bf16 autocast rows by ~5e-4.
FLOAT32_LOSS_ATOL = 2e-4
BF16_LOSS_ATOL = 1e-2
LEARNING_RATE = 1e-2


def bench(*args: str, timeout: float = 300) -> str:
    r = run_script(["bench.py", *TINY, *args], timeout=timeout, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def table_rows(out: str, first_cells: tuple[str, ...]) -> list[list[str]]:
    """The cells of the Markdown table rows whose first cell is one of `first_cells`."""
    rows = []
    for line in out.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in first_cells:
                rows.append(cells)
    return rows


def number(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


def parse_run(out: str) -> dict:
    """The figures a single run prints."""
    ms = re.search(r"ms/iter: median ([\d.]+) \(min ([\d.]+), IQR ([\d.]+)-([\d.]+), max ([\d.]+)\) over (\d+)", out)
    tok = re.search(r"tokens/s: ([\d,]+) \(([\d,]+) tokens/iter", out)
    peak = re.search(r"peak memory: ([\d.]+) MiB \((.+)\)", out)
    loss = re.search(r"loss: ([\d.]+) after the timed steps, ([\d.]+) before the first step", out)
    assert ms and tok and peak and loss, out
    median, lo, q1, q3, hi, n = ms.groups()
    return {
        "median": float(median), "min": float(lo), "q1": float(q1), "q3": float(q3), "max": float(hi), "n": int(n),
        "tokens_per_s": number(tok.group(1)), "tokens_per_iter": number(tok.group(2)),
        "peak": float(peak.group(1)), "measure": peak.group(2),
        "loss": float(loss.group(1)), "initial_loss": float(loss.group(2)),
        "mfu": re.search(r"MFU: (.+)", out).group(1),
    }


# ----------------------------------------------------------------------------------------------- one run


def test_a_run_prints_consistent_figures_and_its_json(tmp_path):
    out = bench(f"--result_json={tmp_path / 'run.json'}")
    assert "device is cpu and no config file was given: loading config/bench_cpu.py" in out
    assert "allocator: glibc malloc" in out or re.search(r"allocator: (jemalloc|tcmalloc|mimalloc)", out)
    assert "2 layers, 2 heads, n_embd 64, block 64, vocab 300 (padded to 320)" in out  # overrides beat the file
    assert "1 micro-steps x 2 x 64 tokens = 128 tokens/iter; 1 warm-up + 3 timed steps; random tokens" in out
    run = parse_run(out)
    assert run["n"] == 3 and 0 < run["min"] <= run["q1"] <= run["median"] <= run["q3"] <= run["max"]
    assert run["tokens_per_iter"] == 2 * 64
    assert run["tokens_per_s"] == pytest.approx(run["tokens_per_iter"] / (run["median"] / 1000), rel=1e-2)
    assert run["mfu"].endswith("measured float32 matmul peak of this CPU (" + PEAK_CACHE + "))")
    # the floor line, and the step's multiple of it as the JSON has it
    floor = re.search(r"matmul floor: ([\d.]+) ms \((\d+) matmuls of the step.*takes ([\d.]+)x its floor", out)
    assert float(floor.group(1)) > 0 and int(floor.group(2)) > 0
    assert run["peak"] > 0 and "VmHWM" in run["measure"] and "before the first step" in run["measure"]
    assert math.isfinite(run["loss"]) and abs(run["initial_loss"] - math.log(300)) < 0.5

    saved = json.loads((tmp_path / "run.json").read_text())
    assert len(saved["ms"]) == 3 and sorted(saved["ms"])[1] == pytest.approx(saved["ms_median"])
    assert saved["ms_median"] == pytest.approx(run["median"], abs=0.01)
    assert saved["tokens_per_s"] == pytest.approx(128 / (saved["ms_median"] / 1000))
    assert saved["loss"] == pytest.approx(run["loss"], abs=1e-4) and saved["mfu"] > 0
    assert saved["floor_multiple"] == pytest.approx(saved["ms_median"] / saved["matmul_floor_ms"])
    assert float(floor.group(3)) == pytest.approx(saved["floor_multiple"], abs=0.006)
    assert saved["config"]["n_embd"] == 64 and saved["threads"] == 1
    # how much of the machine other processes took while this one measured: printed, since it explains noise
    assert 0 <= saved["others_cpu"] <= 1
    assert f"other processes took {saved['others_cpu']:.0%} of the CPUs during the timed steps" in out


def test_real_data_with_accumulation_and_mfu_from_peak_flops(tmp_path):
    data_dir = tmp_path / "tinychar"
    meta = make_char_dataset(data_dir)
    out = bench("--real_data=True", f"--data_dir={data_dir}", "--gradient_accumulation_steps=2", "--peak_flops=1e12")
    assert f"vocab {meta['vocab_size']} (padded to 64)" in out and "(real data)" in out
    assert "2 micro-steps x 2 x 64 tokens = 256 tokens/iter" in out
    run = parse_run(out)
    # MFU = training FLOPs of the step (2 micro-batches of 2 x 64 tokens) / median time / peak
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=meta["vocab_size"], bias=False))
    expected = model.flops_per_token(64) * 64 * 4 / (run["median"] / 1000) / 1e12
    assert run["mfu"].endswith("(peak 1.000 TFLOP/s: --peak_flops)")
    assert float(run["mfu"].split("%")[0]) == pytest.approx(expected * 100, rel=2e-2, abs=0.006)
    assert run["loss"] < run["initial_loss"] - 0.05  # real text is learnable, even in 4 steps


def test_profile_writes_a_chrome_trace_and_prints_the_top_ops(tmp_path):
    out = bench("--profile=True", f"--results_dir={tmp_path}")
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::mm" in names and any(n.startswith("Optimizer.step") for n in names)
    assert "Self CPU" in out and "aten::mm" in out
    assert "includes its overhead" in out and f"chrome trace of the timed steps in {tmp_path / 'trace.json'}" in out


# ----------------------------------------------------------------------------------------------- ablation


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    """Both studies without the compile row (compiling alone takes ~20 s on two cores): printed table and JSON."""
    results = tmp_path_factory.mktemp("ablation")
    out = bench("--ablation=True", "--skip_rows=compile", f"--learning_rate={LEARNING_RATE}",
                f"--results_dir={results}")
    saved = json.loads((results / "ablation.json").read_text())
    printed = table_rows(out, tuple(STUDIES))
    return {"out": out, "rows": saved["rows"], "printed": printed, "json": saved}


EXPECTED_ROWS = [(row.study, row.label) for rows in STUDIES.values() for row in rows if row.name != "compile"]


def test_ablation_prints_every_row_of_the_studies_in_order(ablation):
    assert [(c[0], c[1]) for c in ablation["printed"]] == EXPECTED_ROWS
    assert [(r["study"], r["label"]) for r in ablation["rows"]] == EXPECTED_ROWS
    assert len(EXPECTED_ROWS) == 13  # 5 attention rows, 9 cumulative rows less compile
    assert "ablation: 13 rows, each in a fresh process" in ablation["out"]
    assert all(r["threads"] == 1 for r in ablation["rows"] if r["status"] == "ok")  # the parent's environment


def test_rows_the_cpu_cannot_run_carry_the_reason_and_no_numbers(ablation):
    reasons = {(r["study"], r["name"]): r for r in ablation["rows"] if r["status"] != "ok"}
    assert set(reasons) == {("attention", "efficient"), ("cumulative", "tf32")}
    # the reason is the model's own GPTError, and TF32 is not run on the CPU as if it did something
    assert "sdpa_backend='efficient' cannot run on cpu" in reasons["attention", "efficient"]["reason"]
    assert reasons["cumulative", "tf32"]["reason"] == "TF32 is CUDA-only"
    for r in reasons.values():
        assert r["status"] == "n/a" and "ms_median" not in r and "loss" not in r and r["speedup"] is None
    for cells in ablation["printed"]:
        if cells[1] in ("SDPA memory-efficient kernel", "+ TF32 matmuls"):
            assert cells[2:-1] == ["-"] * 7 and cells[-1]
        else:  # a ran row's note can only warn about a busy machine
            assert cells[-1] == "" or cells[-1].startswith("busy machine: other processes took")


def test_ablation_json_matches_the_printed_table(ablation):
    for r, cells in zip(ablation["rows"], ablation["printed"]):
        if r["status"] != "ok":
            assert cells[-1] == r["reason"]
            continue
        study, label, dtype, ms, _, tok_s, speedup, peak, loss, _ = cells
        assert (study, label, dtype) == (r["study"], r["label"], r["dtype"])
        assert number(ms) == pytest.approx(r["ms_median"], abs=0.05)
        assert number(tok_s) == pytest.approx(r["tokens_per_s"], abs=0.5)
        assert r["tokens_per_s"] == pytest.approx(128 / (r["ms_median"] / 1000))
        assert number(speedup) == pytest.approx(r["speedup"], abs=0.005)
        assert number(peak) == pytest.approx(r["peak_memory_mib"], abs=0.5) and r["peak_memory_mib"] > 0
        assert number(loss) == pytest.approx(r["loss"], abs=5e-5)
    assert ablation["json"]["machine"]["allocator"] == detect_allocator()


def test_techniques_change_the_speed_not_the_loss(ablation):
    ran = [r for r in ablation["rows"] if r["status"] == "ok"]
    float32 = [r for r in ran if r["dtype"] == "float32"]
    bf16 = [r for r in ran if r["dtype"] == "bfloat16 autocast"]
    # float32: the attention study (math, SDPA math, flash, flash + padding) and the cumulative baseline
    assert len(float32) == 5 and len(bf16) == 6
    reference = float32[0]["loss"]
    assert float32[0]["initial_loss"] - reference > 0.5  # the steps did train
    for r in float32:
        assert r["loss"] == pytest.approx(reference, abs=FLOAT32_LOSS_ATOL), r["label"]
    for r in bf16:
        assert r["loss"] == pytest.approx(reference, abs=BF16_LOSS_ATOL), r["label"]
    # speed-up against the first row of the study
    for study in STUDIES:
        rows = [r for r in ran if r["study"] == study]
        for r in rows:
            assert r["speedup"] == pytest.approx(rows[0]["ms_median"] / r["ms_median"])
        assert rows[0]["speedup"] == 1.0


def test_a_skipped_cumulative_row_leaves_its_change_out_of_the_rows_below(ablation):
    cumulative = [r for r in ablation["rows"] if r["study"] == "cumulative"]
    assert [r["name"] for r in cumulative] == [
        "float32", "tf32", "bf16", "flash", "padded", "fused", "malloc", "fused_loss"]
    assert all(r["overrides"]["compile"] is False for r in cumulative)
    assert cumulative[-1]["overrides"] == {
        "dtype": "bfloat16", "tf32": True, "compile": False, "attention": "sdpa", "sdpa_backend": "flash",
        "vocab_padding_multiple": 64, "fused_adamw": True, "keep_freed_memory": True, "fused_loss": True,
    }
    flash_pad = [r for r in ablation["rows"] if r["name"] == "flash+pad"][0]
    assert "--sdpa_backend='flash' --vocab_padding_multiple=64" in flash_pad["command"]


def test_study_and_row_selection_errors_list_the_choices():
    rows = selected_rows(BenchConfig(studies="cumulative", skip_rows="cumulative.compile,fused"))
    assert [r.name for r in rows] == ["float32", "tf32", "bf16", "flash", "padded", "malloc", "fused_loss"]
    assert rows[-1].overrides["compile"] is False and rows[1].cuda_only == "TF32 is CUDA-only"
    with pytest.raises(UserError) as e:
        load_config(["--device=cpu", "--studies=atention", "--skip_rows=compil", "--timed_steps=0"])
    message = str(e.value)
    assert "unknown study 'atention' (studies: attention, cumulative)" in message
    assert "unknown row 'compil' in skip_rows" in message and "timed_steps=0 must be at least 1" in message


# ----------------------------------------------------------------------------------------------- numerics, memory


def test_numerics_errors_are_small_and_bf16_is_less_exact_than_float32(tmp_path):
    out = bench("--numerics=True", f"--results_dir={tmp_path}")
    rows = table_rows(out, ("math", "sdpa/auto", "sdpa/math", "sdpa/flash"))
    assert [(r[0], r[1]) for r in rows] == [
        (p, d) for p in ("math", "sdpa/auto", "sdpa/math", "sdpa/flash") for d in ("float32", "bfloat16 autocast")
    ]
    saved = json.loads((tmp_path / "numerics.json").read_text())["rows"]
    for cells, r in zip(rows, saved):
        assert [float(c) for c in cells[2:5]] == pytest.approx(
            [r["attention_error"], r["token_loss_error"], r["loss_error"]], rel=1e-2)
    for f32, bf16 in zip(saved[::2], saved[1::2]):
        for key in ("attention_error", "token_loss_error"):  # the mean loss may cancel by chance: not compared
            assert 0 < f32[key] < 1e-5, f32
            assert 0 < bf16[key] < 5e-2, bf16
            assert bf16[key] > 10 * f32[key], (f32, bf16)
        assert 0 < f32["loss_error"] < 1e-5 and bf16["loss_error"] < 1e-2


def test_memory_study_measures_each_length_in_a_fresh_process(tmp_path):
    out = bench("--memory=True", "--memory_seq_lens=64,128", f"--results_dir={tmp_path}")
    rows = table_rows(out, ("math", "sdpa/auto"))
    assert [r[0] for r in rows[:2]] == ["math", "sdpa/auto"] and all(float(c) > 0 for r in rows[:2] for c in r[1:])
    difference = table_rows(out, ("math - sdpa",))[0]
    expected = [float(a) - float(b) for a, b in zip(rows[0][1:], rows[1][1:])]
    assert [float(c) for c in difference[1:]] == pytest.approx(expected, abs=1)  # of the unrounded figures
    study = json.loads((tmp_path / "memory.json").read_text())
    points = {(p["path"], p["seq_len"]): p for p in study["points"]}
    assert set(points) == {(p, T) for p in ("math", "sdpa/auto") for T in (64, 128)}
    assert all(p["status"] == "ok" and p["peak_memory_mib"] > 0 and "VmHWM" in p["memory_measure"]
               for p in points.values())
    ratio = points["math", 128]["peak_memory_mib"] / points["sdpa/auto", 128]["peak_memory_mib"]
    assert f"math/SDPA peak memory at T=128: {ratio:.2f}x" in out
    assert [(r["path"], r["status"], r["reason"]) for r in study["largest_batch"]] == [
        ("math", "n/a", "CUDA only"), ("sdpa/auto", "n/a", "CUDA only")]
    assert rows[2:] == [["math", "-", "CUDA only"], ["sdpa/auto", "-", "CUDA only"]]


def test_largest_batch_search_is_cuda_only(tmp_path):
    cfg = BenchConfig(device="cpu", n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=16, find_max_batch=True,
                      compile=False)
    with pytest.raises(UserError, match="find_max_batch needs CUDA"):
        largest_batch(cfg)
    # as the memory study starts it on CUDA: the row's find_max_batch=True beats the child's default False
    r = run_child(TINY, {"find_max_batch": True}, str(tmp_path / "row.json"))
    assert r["status"] == "n/a" and r["reason"].startswith("find_max_batch needs CUDA (the device is cpu)")


def test_allocator_is_read_from_the_mapped_libraries_or_ld_preload():
    maps = "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    assert detect_allocator(maps=maps, ld_preload="") == "jemalloc (/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)"
    assert detect_allocator(maps="", ld_preload="/opt/libtcmalloc_minimal.so.4") == (
        "tcmalloc (/opt/libtcmalloc_minimal.so.4)")
    assert detect_allocator(maps="7f00-7f10 r-xp 0 0 0 /usr/lib/libc.so.6\n", ld_preload="") in (
        "glibc malloc", "the system malloc")


def test_ablation_bar_chart_when_matplotlib_is_installed(tmp_path, ablation):
    pytest.importorskip("matplotlib", reason="matplotlib is optional: without it bench.py skips the chart")
    path = plot_ablation(ablation["rows"], str(tmp_path / "ablation.png"))
    assert path and (tmp_path / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matmul_floor_replays_every_matmul_of_the_forward_and_backward():
    """One layer, math attention, plain loss: the forward has 5 linears (q/k/v, attention output, MLP in and out,
    head) and 2 attention products; the backward two matmuls for each of those 7 (gradient of input and of weight
    or of the other operand): 21, counted by hand from the model's structure."""
    from bench import matmul_floor

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, attention="math",
                          fused_loss=False))
    x = torch.randint(0, 50, (2, 16))
    ms, n = matmul_floor(model, [(x, x)], torch.autocast("cpu", enabled=False), "cpu", repeats=1)
    assert n == 21 and ms > 0
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind for the timed steps
    _, n_two = matmul_floor(model, [(x, x), (x, x)], torch.autocast("cpu", enabled=False), "cpu", repeats=1)
    assert n_two == 42  # every micro-batch of the step
