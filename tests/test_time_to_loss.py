"""benchmarks/time_to_loss.py: the time-to-target arithmetic on made-up evals, and the script end to end on a tiny
dataset (both recipes shrunk by --args; the test checks the figures it prints against the runs, never a speed)."""
from __future__ import annotations

import re
import sys

import pytest

from helpers import ROOT, make_char_dataset, run_script

sys.path.insert(0, f"{ROOT}/benchmarks")
from time_to_loss import BASELINE, OURS_NAME, summarize, time_to_target  # noqa: E402

EVALS = [(0, 2.0, 4.0), (100, 12.0, 3.0), (200, 22.0, 2.0), (300, 32.0, 1.5)]


def test_time_to_target_interpolates_between_the_evals_around_it():
    assert time_to_target(EVALS, 2.5) == pytest.approx(17.0)  # halfway from 3.0 at 12 s to 2.0 at 22 s
    assert time_to_target(EVALS, 2.0) == pytest.approx(22.0)  # reached exactly at an eval
    assert time_to_target(EVALS, 1.6) == pytest.approx(30.0)
    assert time_to_target(EVALS, 4.5) == 2.0  # already there at the first eval
    assert time_to_target(EVALS, 1.4) is None  # never reached
    bumpy = [(0, 1.0, 3.0), (10, 2.0, 2.5), (20, 3.0, 2.7), (30, 4.0, 2.0)]
    assert time_to_target(bumpy, 2.5) == pytest.approx(2.0)  # the first time it gets there counts
    nan = [(0, 1.0, 3.0), (10, 2.0, float("nan")), (20, 3.0, 2.0)]
    assert time_to_target(nan, 2.5) == 3.0  # never interpolated from a NaN
    assert time_to_target([(0, 1.0, float("nan"))], 2.5) is None


def test_summarize_gives_the_ratio_of_the_median_times():
    slow = [(0, 1.0, 4.0), (2000, 101.0, 1.9)]
    runs = [
        {"name": BASELINE, "evals": slow, "wall_s": 104.5},
        {"name": OURS_NAME, "evals": [(0, 1.0, 4.0), (450, 31.0, 1.8)], "wall_s": 33.0},  # 1.9 at 1 + 30 * 2.1 / 2.2 s
        {"name": BASELINE, "evals": [(0, 1.0, 4.0), (2000, 121.0, 1.9)], "wall_s": 124.0},
        {"name": OURS_NAME, "evals": [(0, 1.0, 4.0), (450, 41.0, 1.8)], "wall_s": 43.0},
    ]
    never = [(0, 1.0, 4.0), (450, 41.0, 2.0)]  # never gets to 1.9
    runs.append({"name": "ours --gelu=tanh", "evals": never, "wall_s": 43.0})
    lines, speedups = summarize(runs, 1.9)
    ours_median = ((1 + 30 * 2.1 / 2.2) + (1 + 40 * 2.1 / 2.2)) / 2
    assert speedups == {OURS_NAME: pytest.approx(111.0 / ours_median), "ours --gelu=tanh": None}
    assert lines[2] == f"| {BASELINE} | 2000 | 104.5 s | 101.0 s | 1.9000 | 101.0 s |"
    assert lines[-2] == f"ours: {111.0 / ours_median:.2f}x faster to val loss 1.9000 (median 111.0 s vs " \
                        f"{ours_median:.1f} s, 2 run(s))"
    assert lines[-1] == "ours --gelu=tanh: speed-up n/a (it never reached the target)"
    lines, speedups = summarize(runs[:2], 1.85)  # the baseline never gets there
    assert speedups == {OURS_NAME: None} and "| not reached |" in lines[2]
    assert lines[-1] == "ours: speed-up n/a (the baseline never reached the target)"


def test_exit_status_is_1_when_ours_or_the_baseline_never_reach_the_target(monkeypatch, capsys):
    import time_to_loss

    finals = {"config/train_shakespeare_char.py": 1.90, "config/train_shakespeare_char_cpu.py": 1.95}
    monkeypatch.setattr(time_to_loss, "run_recipe", lambda recipe: {
        "evals": [(0, 1.0, 4.0), (100, 10.0, finals[recipe[0]] + (0.1 if "--slow" in recipe else 0.0))], "wall_s": 11.0,
    })
    time_to_loss.main(["--target=1.96", "--variant=--slow"])  # a variant that never reaches it: reported, status 0
    assert "ours --slow: speed-up n/a (it never reached the target)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        time_to_loss.main([])  # target: the baseline's 1.90, which ours never reaches
    assert info.value.code == 1
    assert "ours: speed-up n/a (it never reached the target)" in capsys.readouterr().out


def test_ours_defaults_is_nanogpts_command_with_nothing_added(monkeypatch):
    """--ours=defaults runs nanoGPT's README command as it is (this repo's defaults decide dtype, attention, the
    fused loss and AdamW), against the baseline that spells out what nanoGPT does."""
    import time_to_loss

    recipes = []
    monkeypatch.setattr(time_to_loss, "run_recipe", lambda recipe: recipes.append(recipe) or {
        "evals": [(0, 1.0, 4.0), (100, 10.0, 1.9)], "wall_s": 11.0})
    time_to_loss.main(["--ours=defaults"])
    baseline, ours = recipes
    assert ours == ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                    "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
    assert baseline[: len(ours)] == ours and "--dtype=float32" in baseline[len(ours):]


def test_script_runs_both_recipes_and_reports_their_evals(tmp_path):
    data_dir = tmp_path / "tinychar"
    make_char_dataset(data_dir, n_chars=20_000)
    tiny = (f"--data_dir={data_dir} --n_layer=1 --n_head=2 --n_embd=32 --block_size=32 --batch_size=4 "
            f"--max_iters=6 --lr_decay_iters=6 --eval_interval=3 --eval_iters=2 --warmup_iters=1 --log_interval=3")
    r = run_script(["benchmarks/time_to_loss.py", f"--args={tiny}", "--variant=--max_iters=4 --lr_decay_iters=4",
                    "--target=100"], timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "nanoGPT CPU recipe: python train.py config/train_shakespeare_char.py --device=cpu" in out
    assert "ours: python train.py config/train_shakespeare_char_cpu.py" in out
    rows = re.findall(r"^\| (.+?) \| (\d+) \| ([\d.]+) s \| ([\d.]+) s \| ([\d.]+) \| ([\d.]+) s \|$", out, re.M)
    variant = f"{OURS_NAME} --max_iters=4 --lr_decay_iters=4"
    assert [(name, int(iters)) for name, iters, *_ in rows] == [(BASELINE, 6), (OURS_NAME, 6), (variant, 4)]
    finals = re.findall(r"val loss ([\d.]+) at iter (\d+), ([\d.]+) s of training", out)
    assert [(f"{float(loss):.4f}", it) for loss, it, _ in finals] == [(row[4], row[1]) for row in rows]
    assert all(float(row[2]) >= float(row[3]) for row in rows)  # the process's wall time holds its training time
    # target 100 is above any loss: each run reached it at its first eval, and the ratio is of those times
    base_t, ours_t, variant_t = (float(row[5]) for row in rows)
    for name, t in ((OURS_NAME, ours_t), (variant, variant_t)):
        ratio = float(re.search(rf"^{name}: ([\d.]+)x faster to val loss 100.0000", out, re.M).group(1))
        # the table's times are rounded to 0.1 s and the ratio to 0.01
        # (a time printed as 0.0 s may be anything below 0.05 s: then the ratio has no upper bound)
        upper = (base_t + 0.05) / (t - 0.05) + 0.005 if t > 0.05 else float("inf")
        assert (base_t - 0.05) / (t + 0.05) - 0.005 <= ratio <= upper


def test_a_failing_run_is_a_one_line_error_with_its_stderr(tmp_path):
    r = run_script(["benchmarks/time_to_loss.py", f"--args=--data_dir={tmp_path / 'missing'}"], timeout=120)
    assert r.returncode == 1
    first = r.stderr.strip().splitlines()[0]
    assert first.startswith("error: train.py failed (exit 2): train.py config/train_shakespeare_char.py")
    assert "meta.json" in r.stderr or "train.bin" in r.stderr
