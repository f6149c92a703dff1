"""report.py: the page a train.py run writes at its end (out_dir/report.md), checked against the run's own files."""
from __future__ import annotations

import pytest

import json

import matplotlib.image
import torch

from helpers import make_char_dataset, tiny_config
from train import train


def test_a_run_ends_with_a_report_of_its_settings_results_picture_and_a_sample(tmp_path):
    meta = make_char_dataset(tmp_path / "data")
    out = tmp_path / "out"
    train(tiny_config(tmp_path / "data", out, max_iters=6, eval_interval=3, log_interval=1, report=True))
    text = (out / "report.md").read_text()
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals = [r for r in records if "val_loss" in r]
    best = min(evals, key=lambda r: r["val_loss"])
    assert f"- best val loss: {best['val_loss']:.4f} at iter {best['iter']}" in text
    assert "| n_layer | `2` | `12` |" in text and "| max_iters | `6` | `600000` |" in text
    assert "| seed |" not in text  # only what differs from the defaults
    assert "- 6 iterations in " in text and " tokens/s (median of the logged steps after the first)" in text
    assert "![train and val loss" in text and matplotlib.image.imread(out / "loss.png").shape[2] in (3, 4)
    sample = text.split("```text\n")[1].split("\n```")[0]
    assert len(sample) > 50 and set(sample) <= set(meta["itos"])  # the dataset's characters, decoded


def test_the_reports_sample_runs_under_the_runs_autocast(tmp_path, monkeypatch):
    """The sample at the end of a run uses the run's precision: outside its autocast, a kernel the run chose can
    refuse (flash attention in float32 on a GPU ended the FineWeb recipe's run with an error after its last save)."""
    from nanogpt import engine

    seen = []
    generate = engine.generate

    def recording(*args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", recording)
    data_dir = tmp_path / "data"
    make_char_dataset(data_dir)
    train(tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2, dtype="bfloat16", report=True))
    assert seen == [(True, torch.bfloat16)]
    assert "## A sample from the final weights" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.slow
def test_the_report_after_a_resume_covers_the_whole_run_and_each_start(tmp_path):
    """Bug: a run resumed from iter 10 to 15 showed only the last start, and MFU n/a where the log printed one."""
    import dataclasses

    data_dir = tmp_path / "data"
    make_char_dataset(data_dir)
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=10, eval_interval=5, log_interval=5, report=True,
                      peak_flops=1e15)
    train(cfg)
    train(dataclasses.replace(cfg, max_iters=15, init_from="resume", learning_rate=1e-3))
    text = (tmp_path / "out" / "report.md").read_text()
    assert "- 15 iterations in " in text and "in 2 starts" in text
    assert "| 0 | scratch | - |" in text
    assert "| 10 | resume | learning_rate: 0.003 -> 0.001; max_iters: 10 -> 15 |" in text
    assert "MFU n/a" not in text and "MFU 0." in text


def test_a_report_that_a_library_fails_to_draw_is_a_warning_and_the_run_ends_well(tmp_path, monkeypatch, capsys):
    """Bug: a metrics.jsonl value matplotlib could not plot (an int past a float's range: OverflowError) ended a
    finished, saved run with a traceback and exit 1; the README says a report that cannot be written is a warning."""
    from nanogpt import plot

    def draw(*args, **kwargs):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(plot, "draw", draw)
    make_char_dataset(tmp_path / "data")
    out = tmp_path / "out"
    train(tiny_config(tmp_path / "data", out, max_iters=2, eval_interval=2, report=True))
    err = capsys.readouterr().err
    assert ("warning: no report (OverflowError: int too large to convert to float); the run and its checkpoint are "
            "whole") in err and (out / "ckpt.pt").exists() and not (out / "report.md").exists()


def test_the_reports_speed_leaves_out_the_first_logged_step_which_holds_the_compile(tmp_path):
    """A hand-made metrics.jsonl whose first logged step is slow (compile): the medians of the other three, 2,000
    tokens/s and MFU 20% (with the first they would be 1,500 and 15%)."""
    from nanogpt import report
    from nanogpt.config import TrainConfig

    steps = [(1, 10.0, 0.001), (2, 1000.0, 0.1), (3, 3000.0, 0.3), (4, 2000.0, 0.2)]  # iter, tokens/s, MFU
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"iter": it, "loss": 3.0, "elapsed_s": float(it), "tok_s": tok_s, "mfu": mfu}) + "\n"
        for it, tok_s, mfu in steps))
    report.write_report(str(tmp_path), TrainConfig(out_dir=str(tmp_path)), TrainConfig(), {}, None)
    assert ("- speed: 2,000 tokens/s (median of the logged steps after the first), MFU 20.00%\n"
            in (tmp_path / "report.md").read_text())
