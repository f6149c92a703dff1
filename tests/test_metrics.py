"""metrics.py: a run's metrics.jsonl, written through Logger and read by read_metrics: a new run starts its own file
and a resume appends to its run's (a start line each), the wall time (elapsed_s) continues across resumes, a line
torn by a kill is skipped with a warning and the next append starts a new line. (wandb_problem, which asks wandb
whether it has an API key: tests/test_config.py; train.py refusing wandb_log=True before the model is built:
tests/test_train.py.)"""
from __future__ import annotations

import dataclasses
import json

import pytest

from nanogpt.checkpoint_file import load_checkpoint
from helpers import config_args, run_in_process, tiny_config
from nanogpt.metrics import read_metrics
from test_checkpoints import metrics
from nanogpt.config import TrainConfig
from train import train


def test_a_new_run_starts_its_own_metrics_file_and_a_resume_appends(data_dir, tmp_path):
    """Bug: metrics.jsonl was always appended to, so a new run in an old out_dir mixed its records with the old."""
    out = tmp_path / "out"

    def records(path=out / "metrics.jsonl"):
        return [json.loads(ln) for ln in open(path)]

    cfg = tiny_config(data_dir, out, max_iters=4, eval_interval=4, log_interval=1)
    train(cfg)
    first = records()
    train(cfg)
    second = records()
    (previous,) = (out / "previous").iterdir()  # the first run, moved aside whole
    assert records(previous / "metrics.jsonl") == first
    assert [r["iter"] for r in second if "start" not in r] == [0, 1, 2, 3, 4, 4]  # evals at 0, 4, steps 1-4: one run
    train(dataclasses.replace(cfg, max_iters=6, init_from="resume"))
    resumed = records()
    assert resumed[: len(second)] == second
    assert [r["iter"] for r in resumed[len(second):] if "start" not in r] == [4, 5, 6, 6]
    starts = [r["start"] for r in resumed if "start" in r]
    assert [(s["iter"], s["init_from"]) for s in starts] == [(0, "scratch"), (4, "resume")]
    assert starts[0]["run_id"] == starts[1]["run_id"] != records(previous / "metrics.jsonl")[0]["start"]["run_id"]


@pytest.mark.slow
def test_a_torn_metrics_line_is_skipped_with_a_warning_and_the_next_append_starts_a_new_line(data_dir, tmp_path, capsys):
    """Bug: a line cut short by a kill made every later resume end in a JSONDecodeError at the report, and plot.py
    fail; the resumed run appended after the torn line."""
    out = tmp_path / "torn"
    train(tiny_config(data_dir, out, max_iters=4, eval_interval=2))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"iter": 5, "loss": 2.')  # a kill during the append
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, max_iters=6, eval_interval=2,
                                                             init_from="resume", report=True))], capsys)
    assert r.returncode == 0 and "report: " in r.stdout
    assert r.stderr.count("skipped 1 unreadable line") == 1  # the report reads the file once (it read it 3 times)
    lines = open(out / "metrics.jsonl").read().splitlines()
    torn = lines.index('{"iter": 5, "loss": 2.')
    assert all(json.loads(line) for line in lines[torn + 1:])  # the resumed run's records each on a line of its own
    evals = read_metrics(str(out)).evals
    assert [r["iter"] for r in evals] == [0, 2, 4, 4, 6]  # a resume evaluates where it starts
    assert run_in_process(["plot.py", str(out), f"--out={tmp_path / 'p.png'}"], capsys).returncode == 0


def test_the_runs_wall_time_continues_across_resumes(data_dir, tmp_path, monkeypatch):
    """Bug: elapsed_s restarted at 0 in each process, so plot.py's wall-time panel ran backwards."""
    out = tmp_path / "run"
    train(tiny_config(data_dir, out, max_iters=4, eval_interval=2, log_interval=1))
    saved = load_checkpoint(str(out / "ckpt.pt"))["elapsed_s"]
    assert saved >= metrics(out, "loss")[-1]["elapsed_s"] > 0
    train(tiny_config(data_dir, out, max_iters=6, eval_interval=2, log_interval=1, init_from="resume"))
    times = [r["elapsed_s"] for r in map(json.loads, open(out / "metrics.jsonl"))]
    assert times == sorted(times) and metrics(out, "loss")[4]["elapsed_s"] > saved


@pytest.mark.slow
def test_metrics_lines_of_any_content_are_skipped_with_a_warning_or_read(tmp_path, capsys):
    """A metrics.jsonl line edited by hand, of another program or damaged: any JSON value, or a record whose fields
    hold any JSON value, is read as a record (plot and report draw it) or skipped with the one warning; never an
    exception in the report, the picture or plot.py's reading."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from helpers import json_values
    from nanogpt import report

    record = {"iter": 5, "loss": 2.5, "elapsed_s": 1.0, "tok_s": 9.0, "mfu": None, "val_loss": 2.6,
              "train_loss": 2.5, "start": {"iter": 0, "init_from": "scratch", "command": "python train.py"}}
    records = json_values() | st.sampled_from(sorted(record)).flatmap(
        lambda key: json_values().map(lambda value: {**record, key: value})) | st.sampled_from(
        [*record["start"], "changes"]).flatmap(  # a start line's own fields
        lambda key: json_values().map(lambda value: {**record, "start": {**record["start"], key: value}}))
    raw = (st.binary(max_size=20).filter(lambda b: b"\n" not in b)  # bytes that are no UTF-8, or no JSON
           | st.sampled_from([b"\xff", b"1" * 5000, b"[" * 100_000, b'{"a": ' * 5000]))  # past json's limits
    lines = records.map(lambda r: json.dumps(r).encode()) | raw

    def read_back(written: list[bytes]) -> str:
        """metrics.jsonl of a good line and `written`, through the report; the warnings it printed."""
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        good = {"iter": 1, "loss": 3.0, "elapsed_s": 0.5, "tok_s": 8.0, "mfu": None}
        (out / "metrics.jsonl").write_bytes(b"".join(line + b"\n" for line in [json.dumps(good).encode(), *written]))
        report.write_report(str(out), TrainConfig(out_dir=str(out)), TrainConfig(), {"device": "cpu"}, None)
        assert (out / "report.md").exists()
        return capsys.readouterr().err

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(lines, min_size=1, max_size=3))
    def any_lines(written):
        read_back(written)

    any_lines()
    for key in ("iter", "loss", "elapsed_s", "tok_s"):  # the review's: an int past a float's range (OverflowError)
        err = read_back([json.dumps({**record, key: 10**400}).encode()])
        assert "skipped 1 unreadable line" in err, err
    for changes in ([1], "lr", None, [["nested"]]):  # the review's: a start line's changes not a list of strings
        err = read_back([json.dumps({**record, "start": {**record["start"], "changes": changes}}).encode()])
        assert "skipped 1 unreadable line" in err, err  # was a TypeError in the report, after the run
