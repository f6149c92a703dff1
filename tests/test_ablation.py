"""benchmarks/ablation.py on the CPU in a tiny config: its rows (each a bench.py run in a fresh process), the table,
the JSON, the bar chart; row selection and the half type on a GPU without bf16."""
from __future__ import annotations

import json

import matplotlib.image
import pytest

from nanogpt import device
from benchmarks import ablation as ablation_script
from benchmarks.ablation import AblationConfig, add_speedups, selected_rows
from nanogpt.measure import detect_allocator
from nanogpt.errors import UserError
from helpers import hide_module, run_in_process
from test_bench import bench_script, number, table_rows

# The rows train the same weights on the same random tokens for 4 steps at a high learning rate, which takes the
# held-out loss from ~5.66 to ~4.63, so agreeing to the tolerances below is not agreeing by default. float32 rows
# differ only by rounding, grown by the steps (measured up to 5e-5); bf16 autocast rows by ~5e-4.
FLOAT32_LOSS_ATOL = 2e-4
BF16_LOSS_ATOL = 1e-2
LEARNING_RATE = 1e-2

EXPECTED_ROWS = [  # every row of both studies but compile, in order, as the README's table shows them
    ("attention", "math attention (nanoGPT)"),
    ("attention", "SDPA math kernel"),
    ("attention", "SDPA memory-efficient kernel"),
    ("attention", "SDPA flash kernel"),
    ("attention", "flash + padded vocab (64)"),
    ("cumulative", "float32 (math, no TF32/compile/padding, unfused AdamW)"),
    ("cumulative", "+ TF32 matmuls"),
    ("cumulative", "+ bf16 autocast"),
    ("cumulative", "+ SDPA flash"),
    ("cumulative", "+ padded vocab (64)"),
    ("cumulative", "+ fused AdamW"),
    ("cumulative", "+ glibc malloc keeps freed memory"),
    ("cumulative", "+ fused chunked linear + cross-entropy"),
]


@pytest.fixture(scope="module")
def ablation(tmp_path_factory):
    """Both studies without the compile row (compiling alone takes ~20 s on two cores): printed table, JSON and
    chart."""
    results = tmp_path_factory.mktemp("ablation")
    out = bench_script("--skip_rows=compile", f"--learning_rate={LEARNING_RATE}", f"--results_dir={results}",
                       script="benchmarks/ablation.py")
    saved = json.loads((results / "ablation.json").read_text())
    printed = table_rows(out, ("attention", "cumulative"))
    return {"out": out, "rows": saved["rows"], "printed": printed, "json": saved, "dir": results}


@pytest.mark.slow
def test_ablation_prints_every_row_of_the_studies_in_order(ablation):
    assert [(c[0], c[1]) for c in ablation["printed"]] == EXPECTED_ROWS
    assert [(r["study"], r["label"]) for r in ablation["rows"]] == EXPECTED_ROWS
    assert "ablation: 13 rows, each in a fresh process" in ablation["out"]
    assert all(r["threads"] == 1 for r in ablation["rows"] if r["status"] == "ok")  # the parent's environment


@pytest.mark.slow  # the module's ablation fixture runs 13 bench.py processes
def test_rows_the_cpu_cannot_run_carry_the_reason_and_no_numbers(ablation):
    reasons = {(r["study"], r["name"]): r for r in ablation["rows"] if r["status"] != "ok"}
    assert set(reasons) == {("attention", "efficient"), ("cumulative", "tf32")}
    # the reason is the model's own UserError, and TF32 is not run on the CPU as if it did something
    assert "sdpa_backend='efficient' cannot run on cpu" in reasons["attention", "efficient"]["reason"]
    assert reasons["cumulative", "tf32"]["reason"] == "TF32 is CUDA-only"
    for r in reasons.values():
        assert r["status"] == "n/a" and "ms_median" not in r and "loss" not in r and r["speedup"] is None
    for cells in ablation["printed"]:
        if cells[1] in ("SDPA memory-efficient kernel", "+ TF32 matmuls"):
            assert cells[2:-1] == ["-"] * 7 and cells[-1]
        else:  # a ran row's note can only warn about a busy machine
            assert cells[-1] == "" or cells[-1].startswith("busy machine: other processes took")


@pytest.mark.slow  # the module's ablation fixture runs 13 bench.py processes
def test_ablation_json_matches_the_printed_table(ablation):
    for r, cells in zip(ablation["rows"], ablation["printed"]):
        if r["status"] != "ok":
            assert cells[-1] == r["reason"]
            continue
        study, label, dtype, ms, _, tok_s, speedup, peak, loss, _ = cells
        assert (study, label, dtype) == (r["study"], r["label"], r["dtype"])
        assert number(ms) == pytest.approx(r["ms_median"], abs=0.05)
        assert number(tok_s) == pytest.approx(r["tokens_per_s"], abs=0.5)
        assert number(speedup) == pytest.approx(r["speedup"], abs=0.005)
        assert number(peak) == pytest.approx(r["peak_memory_mib"], abs=0.5) and r["peak_memory_mib"] > 0
        assert number(loss) == pytest.approx(r["loss"], abs=5e-5)
    assert ablation["json"]["machine"]["allocator"] == detect_allocator()


@pytest.mark.slow  # the module's ablation fixture runs 13 bench.py processes
def test_techniques_change_the_speed_not_the_loss(ablation):
    ran = [r for r in ablation["rows"] if r["status"] == "ok"]
    float32 = [r for r in ran if r["dtype"] == "float32"]
    bf16 = [r for r in ran if r["dtype"] == "bfloat16 autocast"]
    # float32: the attention study (math, SDPA math, flash, flash + padding) and the cumulative baseline
    assert len(float32) == 5 and len(bf16) == 6  # the cumulative rows from bf16 on
    reference = float32[0]["loss"]
    assert float32[0]["initial_loss"] - reference > 0.5  # the steps did train
    for r in float32:
        assert r["loss"] == pytest.approx(reference, abs=FLOAT32_LOSS_ATOL), r["label"]
    for r in bf16:
        assert r["loss"] == pytest.approx(reference, abs=BF16_LOSS_ATOL), r["label"]


def test_speedups_are_against_the_first_row_of_each_study():
    rows = [{"study": "a", "status": "ok", "ms_median": 100.0}, {"study": "a", "status": "ok", "ms_median": 50.0},
            {"study": "a", "status": "n/a"}, {"study": "a", "status": "ok", "ms_median": 400.0},
            {"study": "b", "status": "n/a"}, {"study": "b", "status": "ok", "ms_median": 10.0}]
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 2.0, None, 0.25, None, None]  # b's first row did not run


@pytest.mark.slow  # the module's ablation fixture runs 13 bench.py processes
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


@pytest.mark.slow  # the module's ablation fixture runs 13 bench.py processes
def test_the_bar_chart_is_a_picture(ablation):
    image = matplotlib.image.imread(ablation["dir"] / "ablation.png")  # (H, W, RGBA) floats
    assert image.shape[0] > 300 and image.shape[1] > 600 and image[..., :3].std() > 0.05  # not blank


def test_study_and_row_selection_errors_list_the_choices():
    rows = selected_rows(AblationConfig(studies="cumulative", skip_rows="cumulative.compile,fused"), "cpu")
    assert [r.name for r in rows] == ["float32", "tf32", "bf16", "flash", "padded", "malloc", "fused_loss"]
    assert rows[-1].overrides["compile"] is False and rows[1].cuda_only == "TF32 is CUDA-only"
    with pytest.raises(UserError) as e:
        selected_rows(AblationConfig(studies="atention", skip_rows="compil"), "cpu")
    assert "unknown study 'atention' (studies: attention, cumulative)" in str(e.value)
    assert "unknown row 'compil' in skip_rows" in str(e.value)


def test_a_gpu_without_bf16_runs_the_half_rows_in_float16_and_says_so(monkeypatch):
    """V100/T4: the "bf16" row's dtype would make it and every cumulative row below it fail; float16 instead."""
    monkeypatch.setattr(device, "_cuda_bf16", lambda *a, **k: False)
    rows = {r.name: r for r in selected_rows(AblationConfig(studies="cumulative"), "cuda")}
    assert rows["float32"].overrides["dtype"] == "float32"
    assert all(rows[n].overrides["dtype"] == "float16" for n in ("bf16", "compile", "flash", "padded", "malloc"))
    assert rows["bf16"].label == "+ float16 autocast (this GPU has no bf16)"
    monkeypatch.setattr(device, "_cuda_bf16", lambda *a, **k: True)
    assert selected_rows(AblationConfig(studies="cumulative"), "cuda")[-1].overrides["dtype"] == "bfloat16"


def test_without_matplotlib_the_study_stops_before_its_first_row(monkeypatch, capsys, tmp_path):
    hide_module(monkeypatch, "matplotlib")
    monkeypatch.setattr(ablation_script, "run_ablation", lambda *a: pytest.fail("rows ran before matplotlib was checked"))
    r = run_in_process(["benchmarks/ablation.py", "--device=cpu", f"--results_dir={tmp_path}"], capsys)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "error: benchmarks/ablation.py (for ablation.png) needs matplotlib, which is not installed: pip install matplotlib"]
