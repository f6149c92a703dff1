"""One run per out_dir across starts (outdir.py): the same command again, init_from=auto, a new run in a used folder
(each checkpoint format), a resume that takes the run's settings it is not given, keep_last across runs, a torchrun
restart, a damaged run.json or metrics.jsonl, checkpoint_interval under a hard kill, and torchrun's elastic restarts
and two agents on one machine (real torchrun, gloo, tiny models)."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from nanogpt import checkpoint_file, files
from nanogpt import checkpoints
from nanogpt import checkpoint_sharded
from nanogpt import outdir
import train as train_module
from nanogpt.checkpoint_file import load_checkpoint
from helpers import (
    HANG_S,
    ROOT,
    config_args,
    folder_state,
    run_in_process,
    starts_of,
    tiny_config,
)
from test_checkpoints import max_diff
from train import train


def previous_runs(out) -> list:
    return sorted((out / outdir.PREVIOUS).iterdir()) if (out / outdir.PREVIOUS).exists() else []


def weights(path) -> dict:
    return {k: v for k, v in load_checkpoint(str(path))["model"].items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------- starts in one folder


@pytest.mark.slow
def test_the_same_command_again_keeps_the_first_run_whole(data_dir, tmp_path, capsys):
    """Bug: a rerun of the command overwrote the run's ckpt.pt (iter 15) with the new run's iter-4 checkpoint."""
    out = tmp_path / "rs"
    args = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=15, eval_interval=5))]
    assert run_in_process(args, capsys).returncode == 0
    first = weights(out / "ckpt.pt")
    assert run_in_process([*args, "--max_iters=4", "--eval_interval=4"], capsys).returncode == 0
    (previous,) = previous_runs(out)
    assert load_checkpoint(str(previous / "ckpt.pt"))["iter_num"] == 15 and same_weights(weights(previous / "ckpt.pt"),
                                                                                        first)
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 4
    # the moved run still resumes where it is
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, previous, max_iters=20, eval_interval=5,
                                                             init_from="resume"))], capsys)
    assert r.returncode == 0 and f"resuming from {previous}/ckpt.pt at iter 15" in r.stdout


def test_init_from_auto_starts_then_resumes_then_has_nothing_to_do(data_dir, tmp_path, capsys):
    out = tmp_path / "auto"
    args = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=6, eval_interval=3, init_from="auto"))]
    r = run_in_process(args, capsys)
    assert r.returncode == 0 and "init_from='auto': no checkpoint in" in r.stdout
    r = run_in_process([*args, "--max_iters=9"], capsys)  # a requeue with more steps: continues, nothing moved
    assert r.returncode == 0 and "holds a run's checkpoint, resuming it" in r.stdout and "step 9:" in r.stdout
    assert "step 0:" not in r.stdout and not previous_runs(out)
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 9
    starts = starts_of(out)
    assert [(s["iter"], s["init_from"]) for s in starts] == [(0, "scratch"), (6, "resume")]
    assert len({s["run_id"] for s in starts}) == 1 == len({load_checkpoint(str(out / "ckpt.pt"))["run_id"]})


@pytest.mark.slow
def test_a_new_run_of_another_format_moves_the_old_one_aside_and_readers_see_only_the_new(data_dir, tmp_path, capsys):
    """Bug: after a single-process run to iter 20 (ckpt.pt) and an FSDP run from scratch to iter 10 (ckpt_sharded) in
    the same folder, sample.py, export.py and resume read the old run's ckpt.pt (the newer iteration)."""
    out = tmp_path / "mixed"
    train(tiny_config(data_dir, out, max_iters=20, eval_interval=10))
    train(tiny_config(data_dir, out, max_iters=10, eval_interval=10, parallelism="fsdp", n_layer=1))
    found = checkpoints.find_checkpoint(str(out))
    assert (found.name, found.iter_num, found.state["model_args"]["n_layer"]) == ("ckpt_sharded", 10, 1)
    (previous,) = previous_runs(out)
    assert checkpoints.find_checkpoint(str(previous)).iter_num == 20
    r = run_in_process(["sample.py", f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=5", "--device=cpu"],
                       capsys)
    assert r.returncode == 0 and f"{out}/ckpt_sharded at iter 10" in r.stdout + r.stderr


@pytest.mark.slow
def test_each_rerun_moves_a_whole_run_into_previous_and_says_how_much_space_it_takes(data_dir, tmp_path, capsys):
    """previous/ grows by a whole run at every rerun of the command: the line that says where the run went says
    how much space it takes (as du counts it: keep_last's hard links once)."""
    out = tmp_path / "rerun"
    args = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=4, eval_interval=2, keep_last=2))]
    for rerun in range(3):
        r = run_in_process(args, capsys)
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(previous_runs(out)) == rerun
        if rerun:
            moved = re.search(r"the previous run's files \(([\d.]+) (KiB|MiB)\) moved to (\S+) ", r.stdout)
            assert moved and moved.group(3) == str(previous_runs(out)[-1]), r.stdout
            du = int(subprocess.run(["du", "-sb", moved.group(3)], capture_output=True, text=True).stdout.split()[0])
            unit = {"KiB": 2**10, "MiB": 2**20}[moved.group(2)]
            assert abs(float(moved.group(1)) * unit - du) <= 0.05 * unit + 4096, (moved.group(0), du)  # rounded to
            # one decimal; du also counts the folder itself


def test_a_refused_start_in_a_used_folder_moves_nothing(data_dir, tmp_path):
    """The previous run moves aside only once the new start is accepted (here refused: a shape that is not the
    weights')."""
    out = tmp_path / "used"
    train(tiny_config(data_dir, out, max_iters=4, eval_interval=4))
    before = sorted(os.listdir(out))
    with pytest.raises(checkpoint_file.UserError, match="the model's shape is its weights'"):
        train(tiny_config(data_dir, out, init_from=str(out / "ckpt.pt"), n_embd=64))
    assert sorted(os.listdir(out)) == before and not previous_runs(out)


@pytest.mark.slow
def test_a_start_that_saves_nothing_changes_nothing_in_the_folder(data_dir, tmp_path, capsys):
    """Bug: config/eval_gpt2.py (eval_only, init_from=gpt2) in the out_dir of a training job (init_from=auto) moved the
    job's files aside, and its requeue started again at iter 0. A start that only evaluates (eval_only, or a resume
    with nothing to train) moves nothing and writes nothing in out_dir: no run.json, no start line, no metrics, no
    report, not even the folder."""
    out, other = tmp_path / "job", tmp_path / "other"
    train(tiny_config(data_dir, other, max_iters=4, eval_interval=4))  # weights to evaluate, as GPT-2's would be
    job = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=4, eval_interval=4, init_from="auto",
                                                report=True))]
    assert run_in_process(job, capsys).returncode == 0
    before = folder_state(out)
    for evaluation in ([f"--init_from={other / 'ckpt.pt'}", "--eval_only=True"],  # eval_gpt2.py's kind
                       ["--init_from=resume", "--eval_only=True"], ["--init_from=resume"]):  # the last: at max_iters
        r = run_in_process([*job, *evaluation], capsys)
        assert r.returncode == 0 and re.search(r"^step [04]: train loss", r.stdout, re.M), r.stderr[-2000:]
        assert folder_state(out) == before, evaluation
    r = run_in_process([*job, "--max_iters=6"], capsys)  # the job's requeue continues its run
    assert r.returncode == 0 and f"resuming from {out / 'ckpt.pt'} at iter 4" in r.stdout
    assert [(s["iter"], s["init_from"]) for s in starts_of(out)] == [(0, "scratch"), (4, "resume")]
    nowhere = tmp_path / "nowhere"
    r = run_in_process([*job, f"--init_from={other / 'ckpt.pt'}", "--eval_only=True", f"--out_dir={nowhere}"], capsys)
    assert r.returncode == 0 and not nowhere.exists()


@pytest.fixture()
def stopped_in_step():
    """start(cfg, step): train.py on `cfg` in a process of its own that stops itself (SIGSTOP) in its `step`-th
    training step: a live run, paused at a known point until the test sends SIGCONT or SIGKILL (at the test's end,
    SIGKILL to any still there)."""
    procs = []

    def start(cfg, step: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "tests/signal_at_step.py", "SIGSTOP", str(step), "0",
                                 *config_args(cfg)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), proc.communicate()[1][-3000:]
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
def test_a_live_run_holds_its_folder_a_second_start_is_refused_and_a_killed_runs_folder_is_free(data_dir, tmp_path,
                                                                                                stopped_in_step, capsys):
    """Bug: nothing stopped a second start beside a live run: the same command again moved the live run's files
    aside, and both then wrote to the same paths. The second start is refused in one line naming the live process,
    before it changes anything; the live run goes on unharmed; an evaluation-only start still reads the folder; and
    once a run is SIGKILLed its folder takes a start again (the lock ended with the process)."""
    out = tmp_path / "held"
    cfg = tiny_config(data_dir, out, max_iters=6, eval_interval=3)
    live = stopped_in_step(cfg, step=4)  # its iter-3 checkpoint saved
    before = folder_state(out)
    for again in ([], ["--init_from=auto", "--max_iters=9"], ["--init_from=resume", "--max_iters=9"]):
        r = run_in_process(["train.py", *config_args(cfg), *again], capsys)
        assert r.returncode == 2 and r.stdout == "", (again, r.stdout[-2000:])
        (line,) = r.stderr.splitlines()
        assert line.startswith(f"error: out_dir={str(out)!r} is in use by a live run (pid {live.pid} on "
                               f"{socket.gethostname()}, since "), line
        assert folder_state(out) == before, again
    r = run_in_process(["train.py", *config_args(cfg), "--init_from=resume", "--eval_only=True"], capsys)
    assert r.returncode == 0 and f"resuming from {out / 'ckpt.pt'} at iter 3" in r.stdout and folder_state(out) == before
    os.kill(live.pid, signal.SIGCONT)
    _, stderr = live.communicate(timeout=HANG_S)
    assert live.returncode == 0, stderr[-3000:]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 6 and len(starts_of(out)) == 1
    assert not previous_runs(out) and not (out / outdir.LOCK_FILE).exists()  # let go at its end

    killed = stopped_in_step(dataclasses.replace(cfg, max_iters=9, init_from="auto"), step=2)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(timeout=HANG_S)
    assert (out / outdir.LOCK_FILE).exists()  # left behind by the kill, and held by no process
    r = run_in_process(["train.py", *config_args(cfg), "--init_from=auto", "--max_iters=9"], capsys)
    assert r.returncode == 0 and f"resuming from {out / 'ckpt.pt'} at iter 6" in r.stdout, r.stderr[-2000:]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 9 and not previous_runs(out)


@pytest.mark.slow
def test_a_start_refused_by_any_check_changes_nothing_and_is_no_start_of_the_run(data_dir, tmp_path, capsys):
    """Bug: these checks ran after the start was accepted: a refused new run had moved the run in out_dir aside and
    written its own run.json and start line; a refused resume had written a start line, which report.md then counted
    as a start. Each refusal is one line, and the folder stays as it was, byte for byte."""
    out, other = tmp_path / "run", tmp_path / "other"
    run = dict(max_iters=4, eval_interval=4)
    train(tiny_config(data_dir, other, **run))  # weights that start a new run in out
    args = ["train.py", *config_args(tiny_config(data_dir, out, **run))]
    assert run_in_process(args, capsys).returncode == 0
    bad_ids = tmp_path / "bad_ids"  # the dataset with an id past the weights' vocabulary (its meta.json unchanged)
    shutil.copytree(data_dir, bad_ids)
    ids = np.fromfile(bad_ids / "train.bin", dtype=np.uint16)
    ids[3] = 999
    ids.tofile(bad_ids / "train.bin")
    weights_of_other = f"--init_from={other / 'ckpt.pt'}"
    refused = {
        "block_size=64 is larger than the model's 32": [weights_of_other, "--block_size=64"],
        "holds token id 999": [weights_of_other, f"--data_dir={bad_ids}"],
        f"{bad_ids / 'train.bin'} holds token id 999": ["--init_from=resume", f"--data_dir={bad_ids}"],
        "hellaswag path 'missing.jsonl': no such file": ["--init_from=resume", "--max_iters=6", "--hellaswag=True",
                                                         "--hellaswag_path=missing.jsonl"],
        "sdpa_backend='efficient' cannot run on cpu": [weights_of_other, "--attention=sdpa",
                                                       "--sdpa_backend=efficient"],
    }
    before = folder_state(out)
    for message, refusal in refused.items():
        r = run_in_process([*args, *refusal], capsys)
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.splitlines()) == 1, (message, r.stderr)
        assert folder_state(out) == before, message
    r = run_in_process([*args, "--init_from=resume", "--max_iters=6", "--report=True"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [(s["iter"], s["init_from"]) for s in starts_of(out)] == [(0, "scratch"), (4, "resume")]
    report = (out / "report.md").read_text()
    assert "in 2 starts" in report and report.count("| resume |") == 1


@pytest.mark.slow
def test_a_checkpoint_of_another_run_is_never_read(data_dir, tmp_path):
    """A ckpt.pt copied in from another run beside this run's sharded folder: resume, sample and export skip it."""
    out, other = tmp_path / "run", tmp_path / "other"
    train(tiny_config(data_dir, out, max_iters=4, eval_interval=4, parallelism="fsdp"))
    train(tiny_config(data_dir, other, max_iters=8, eval_interval=8))
    os.link(other / "ckpt.pt", out / "ckpt.pt")
    found = checkpoints.find_checkpoint(str(out))
    assert (found.name, found.iter_num) == ("ckpt_sharded", 4) and "ckpt.pt belongs to another run" in found.note
    os.remove(out / "ckpt_sharded")
    with pytest.raises(checkpoint_file.UserError, match="ckpt.pt is a checkpoint of another run"):
        checkpoints.find_checkpoint(str(out))


def test_init_from_auto_decides_once_and_never_announces_a_resume_it_refuses(data_dir, tmp_path, capsys):
    """Bug: with a ckpt.pt of another run than run.json's, init_from=auto printed "holds a run's checkpoint, resuming
    it", then refused the checkpoint ("no checkpoint in ..."). The decision is made, checkpoint found, before anything
    is printed: one line that names the file and what to do, and the folder as it was."""
    out, other = tmp_path / "run", tmp_path / "other"
    args = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=4, eval_interval=4, init_from="auto"))]
    assert run_in_process(args, capsys).returncode == 0
    train(tiny_config(data_dir, other, max_iters=2, eval_interval=2))
    shutil.copy(other / "ckpt.pt", out / "ckpt.pt")  # copied in by hand over the run's own
    before = folder_state(out)
    r = run_in_process([*args, "--max_iters=6"], capsys)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"error: {out / 'ckpt.pt'} is a checkpoint of another run") and "move it out of" in line
    assert folder_state(out) == before


@pytest.mark.slow
def test_resume_without_the_config_file_continues_the_run_bitwise(data_dir, tmp_path, capsys):
    """nanoGPT's habit: `python train.py --init_from=resume --out_dir=DIR` takes the model shape, optimizer and
    every other setting it is not given from the checkpoint's run (it failed: 'the checkpoint's model differs')."""
    from helpers import config_args

    run = dict(max_iters=8, lr_decay_iters=8, eval_interval=4, optimizer="muon", n_layer=3, dropout=0.1)
    reference = train(tiny_config(data_dir, tmp_path / "ref", **run))
    first = tiny_config(data_dir, tmp_path / "run", **{**run, "max_iters": 4})
    train_module.main(config_args(first))
    capsys.readouterr()
    train_module.main(["--init_from=resume", f"--out_dir={tmp_path / 'run'}", "--max_iters=8", "--device=cpu"])
    out = capsys.readouterr().out
    taken = out.split("resuming the run's settings (not given here): ")[1].splitlines()[0]
    print(taken)
    taken = dict(item.split("=", 1) for item in taken.split(", "))
    assert (taken["n_layer"], taken["optimizer"], taken["lr_decay_iters"]) == ("3", "'muon'", "8")
    assert "max_iters" not in taken and "device" not in taken  # given here
    assert [line for line in out.splitlines() if "changed setting" in line] == [
        "resuming with a changed setting (it applies from here on): max_iters: 4 -> 8"]
    resumed = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert resumed["iter_num"] == 8
    assert max_diff(reference["model"].state_dict(), resumed["model"]) == 0.0


@pytest.mark.slow
def test_keep_last_prunes_only_its_own_runs_snapshots(data_dir, tmp_path):
    """Bug: a new run with keep_last=2 after a run to iter 30 with keep_last=3 deleted its own snapshots and kept the
    old run's ckpt_0000025.pt and ckpt_0000030.pt."""
    out = tmp_path / "keep"
    train(tiny_config(data_dir, out, max_iters=30, eval_interval=5, keep_last=3))
    train(tiny_config(data_dir, out, max_iters=10, eval_interval=5, keep_last=2))
    assert sorted(p.name for p in out.glob("ckpt_*.pt")) == ["ckpt_0000005.pt", "ckpt_0000010.pt"]
    (previous,) = previous_runs(out)
    assert sorted(p.name for p in previous.glob("ckpt_*.pt")) == ["ckpt_0000020.pt", "ckpt_0000025.pt",
                                                                   "ckpt_0000030.pt"]


def test_a_torchrun_restart_resumes_its_own_run_and_never_another(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert outdir.resolve_init_from("scratch", str(out), restart=1, job="job-7")[0] == "scratch"
    (out / "ckpt.pt").write_bytes(b"x")
    outdir.begin_run(str(out), job="job-7")
    init_from, why = outdir.resolve_init_from("scratch", str(out), restart=1, job="job-7")
    assert init_from == "resume" and why.startswith("torchrun restart 1 of the run in")
    # the first start of a torchrun (restart 0), a restart of another job's, or one that has no job id: as given
    assert outdir.resolve_init_from("scratch", str(out), restart=0, job="job-7")[0] == "scratch"
    assert outdir.resolve_init_from("scratch", str(out), restart=1, job="job-8")[0] == "scratch"
    assert outdir.resolve_init_from("scratch", str(out), restart=1, job=None)[0] == "scratch"
    assert outdir.resolve_init_from("gpt2", str(out), restart=1, job="job-7")[0] == "resume"


def test_moving_aside_takes_only_the_names_a_run_writes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    names = ["ckpt.pt", "ckpt_best.pt", "ckpt_0000010.pt", "ckpt_sharded_0000004_0", "metrics.jsonl",
             "metrics.2.jsonl", "report.md", "loss.png", "run.json", "ckpt.pt.tmp.123"]
    mine = ["notes.txt", "ckpt_5.pt", "ckpt_sharded_keep", "data.bin", "previous_results"]
    for name in names + mine:
        (out / name).write_text(name)
    outdir.begin_run(str(out))  # run.json as a run writes it (its start time names the folder)
    os.symlink("ckpt_sharded_0000004_0", out / "ckpt_sharded")
    dest = outdir.move_previous_run(str(out))[0]
    assert sorted(os.listdir(dest)) == sorted([*names, "ckpt_sharded"])
    assert os.readlink(os.path.join(dest, "ckpt_sharded")) == "ckpt_sharded_0000004_0"  # still points at its folder
    assert sorted(os.listdir(out)) == sorted([*mine, "previous"])
    assert outdir.move_previous_run(str(out)) is None  # nothing of a run left


@pytest.mark.parametrize("init_from", ["scratch", "auto"])
def test_a_runs_names_in_a_folder_that_holds_no_run_are_not_moved_as_one(data_dir, tmp_path, capsys, init_from):
    """Bug: a folder of the user's own report.md and metrics.jsonl (no run.json, no checkpoint) had them moved into
    previous/ as "the previous run's files". Only a run's files are moved: this is one line, exit 2, nothing changed."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "report.md").write_text("# my notes\n")
    (out / "metrics.jsonl").write_text('{"my": "data"}\n')
    before = folder_state(out)
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, init_from=init_from))], capsys)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: out_dir={str(out)!r} holds metrics.jsonl, report.md but no run (no run.json, no checkpoint): a new run "
        f"would move them aside as a run's, or write over them; move them out of {out} (nothing there was changed), "
        f"or give another --out_dir"], r.stderr
    assert folder_state(out) == before
    (out / "ckpt.pt.tmp.7").write_text("")  # a save a kill cut short (our temporary name) is not the user's
    (out / "report.md").unlink()
    (out / "metrics.jsonl").unlink()
    assert run_in_process(["train.py", *config_args(tiny_config(data_dir, out, max_iters=2))], capsys).returncode == 0


# ----------------------------------------------------------------------------------------------- damaged files


@pytest.mark.slow
def test_damaged_or_foreign_files_are_one_line_each_and_a_finished_run_only_warns(data_dir, tmp_path, capsys,
                                                                                 monkeypatch):
    """Bug: a run.json edited by hand ended a start in a traceback (TypeError moving the run aside, AttributeError
    finding its checkpoint) and one cut short was silently replaced; a metrics.jsonl line that is JSON but not a
    record made the finished run exit 1 in its report, and plot.py fail. Now: one line naming run.json and what to
    do, before anything changes (and doing it works); the lines are skipped with a warning; a report that cannot be
    written is a warning too."""
    out = tmp_path / "run"
    args = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=4, eval_interval=2))]
    assert run_in_process(args, capsys).returncode == 0
    for damaged in ('{"run_id": "3f2a', "[]", '{"run_id": "3f2a9c", "started": "yesterday"}', "[" * 100_000,
                    "\udcff"):  # nested past Python's limit; a byte that is no UTF-8
        (out / "run.json").write_bytes(damaged.encode("utf-8", "surrogateescape"))
        before = folder_state(out)
        for again in ([], ["--init_from=resume", "--max_iters=6"]):  # a new run, a resume
            r = run_in_process([*args, *again], capsys)
            assert r.returncode == 2 and r.stdout == "", (damaged, again, r.stderr[-2000:])
            (line,) = r.stderr.splitlines()
            assert line.startswith(f"error: {out / 'run.json'} is damaged (") and "remove it" in line, line
            assert folder_state(out) == before
    (out / "run.json").unlink()  # as the line says: the resume writes it again, from its checkpoint's run id
    first = len(open(out / "metrics.jsonl").readlines()) + 1
    with open(out / "metrics.jsonl", "a") as f:
        f.write('42\n{"iter": 5, "loss": "low", "elapsed_s": 1.0, "tok_s": 9.0}\n{"start": "again"}\n')
    r = run_in_process([*args, "--init_from=resume", "--max_iters=6", "--report=True"], capsys)
    assert r.returncode == 0 and "report: " in r.stdout, r.stderr[-2000:]
    assert (f"skipped 3 unreadable lines (lines {first}, {first + 1}, {first + 2}: JSON but not a record of train.py"
            in r.stderr), r.stderr
    assert outdir.run_id_of(str(out)) == load_checkpoint(str(out / "ckpt.pt"))["run_id"]
    assert run_in_process(["plot.py", str(out), f"--out={tmp_path / 'p.png'}"], capsys).returncode == 0
    write_text = files.write_text

    def report_fails(path, text, what):  # the disk fills up as the run ends: the report cannot be written
        if what == "report":
            raise files.write_failed(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), what=what)
        write_text(path, text, what)

    monkeypatch.setattr(files, "write_text", report_fails)
    r = run_in_process([*args, "--init_from=resume", "--max_iters=8", "--report=True"], capsys)
    assert r.returncode == 0 and "warning: no report (could not write report " in r.stderr, r.stderr[-2000:]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 8


# ----------------------------------------------------------------------------------------------- a hard kill


@pytest.mark.slow
def test_checkpoint_interval_bounds_the_work_a_sigkill_loses(data_dir, tmp_path):
    """No SIGTERM, no eval in reach: a SIGKILL at step 8 leaves the checkpoint of iter 6 (checkpoint_interval=3),
    and a resume continues from it. Without checkpoint_interval nothing since the start would be saved."""
    out = tmp_path / "kill"
    cfg = tiny_config(data_dir, out, max_iters=20, eval_interval=1000, checkpoint_interval=3)
    r = subprocess.run([sys.executable, "tests/signal_at_step.py", "SIGKILL", "8", "0", *config_args(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == -signal.SIGKILL
    assert "saved checkpoint at iter 6 to" in r.stdout and " s" in r.stdout.split("saved checkpoint at iter 6")[1]
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 6
    resumed = train(tiny_config(data_dir, out, max_iters=9, eval_interval=1000, checkpoint_interval=3,
                                init_from="auto"))
    assert resumed["iter_num"] == 9


def test_checkpoint_minutes_saves_when_the_time_has_passed(data_dir, tmp_path, capsys):
    out = tmp_path / "minutes"
    train(tiny_config(data_dir, out, max_iters=3, eval_interval=1000, checkpoint_minutes=1e-9))
    saves = [line for line in capsys.readouterr().out.splitlines() if line.startswith("saved checkpoint at iter")]
    assert [s.split()[4] for s in saves] == ["1", "2", "3"]


# ----------------------------------------------------------------------------------------------- real torchrun


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_pid(out, rank: int, restart: int) -> int | None:
    """The pid of the train.py worker of `rank` in torchrun's `restart`-th attempt writing to out (read from /proc)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            environ = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (str(out) in cmdline and f"RANK={rank}" in environ
                and f"TORCHELASTIC_RESTART_COUNT={restart}" in environ and "train.py" in cmdline):
            return int(pid)
    return None


@pytest.mark.slow
def test_torchrun_max_restarts_continues_after_a_rank_is_killed_and_ends_as_an_uninterrupted_run(data_dir, tmp_path):
    """torchrun restarts every worker with the same arguments (init_from=scratch): the restart resumes the newest
    checkpoint, and the run ends with the weights of a run that was never killed (it saved at the same iterations:
    DDP data comes from (seed, iteration, rank), and dropout is off)."""
    run = dict(max_iters=200, eval_interval=1000, checkpoint_interval=4, dropout=0.0, gradient_accumulation_steps=2,
               report=False, log_interval=50)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ref = tmp_path / "ref"
    r = subprocess.run([*torchrun, "train.py", *config_args(tiny_config(data_dir, ref, **run))], cwd=ROOT,
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "elastic"
    proc = subprocess.Popen([*torchrun, "--max-restarts=2", "--monitor-interval=0.2", "train.py",
                             *config_args(tiny_config(data_dir, out, **run))], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "ckpt.pt").exists() or load_checkpoint(str(out / "ckpt.pt"))["iter_num"] < 4:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    pid = _worker_pid(out, rank=1, restart=0)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # from outside, as a node's OOM killer or a failing GPU would
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, stderr[-3000:]
    assert "torchrun restart 1 of the run in" in stdout and f"resuming from {out}/ckpt.pt at iter " in stdout
    assert load_checkpoint(str(out / "ckpt.pt"))["iter_num"] == 200
    assert same_weights(weights(out / "ckpt.pt"), weights(ref / "ckpt.pt"))
    assert not previous_runs(out)  # the restart moved nothing aside


# Under torchrun: train.main with a fault per attempt, chosen by torchrun's restart count (no clock): attempt 0 dies
# where its start would be accepted (a new run, before the previous one is moved), and attempt 1's rank 1 is
# SIGKILLed in its 3rd step.
FAULT_PER_ATTEMPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import train
from nanogpt import outdir
from nanogpt.errors import exit_on_user_error
from signal_at_step import signal_during_step

restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if restart == "0":
    outdir.move_previous_run = lambda *args: os._exit(1)
elif restart == "1" and os.environ["RANK"] == "1":
    signal_during_step(signal.SIGKILL, 3)
exit_on_user_error(lambda: train.main(sys.argv[1:]))
"""


def _static_torchrun(script, args: list[str], nproc: int, max_restarts: int = 0) -> subprocess.CompletedProcess:
    """torchrun with a static rendezvous, as the README's multi-node command (--master_addr and --master_port, no
    --rdzv-id): every such job has torchrun's run id "none"."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
                           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", f"--max-restarts={max_restarts}",
                           "--monitor-interval=0.2", str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S)


@pytest.mark.slow
def test_a_torchrun_restart_of_another_job_under_the_same_rendezvous_id_never_resumes_its_run(data_dir, tmp_path):
    """Bug: job A's run recorded torchrun's run id, "none" for every static rendezvous; job B (init_from=scratch),
    whose first attempt failed before moving anything, restarted and resumed A's checkpoint. B's restart follows
    init_from (A's run moved aside whole), and B's own later restart resumes B's run."""
    out = tmp_path / "out"
    run = dict(max_iters=6, eval_interval=1000, checkpoint_interval=2, dropout=0.0, gradient_accumulation_steps=2)
    a = _static_torchrun("train.py", config_args(tiny_config(data_dir, out, **{**run, "max_iters": 4})), nproc=1)
    assert a.returncode == 0, a.stderr[-3000:]
    a_run = load_checkpoint(str(out / "ckpt.pt"))["run_id"]
    probe = tmp_path / "fault_per_attempt.py"
    probe.write_text(FAULT_PER_ATTEMPT.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    b = _static_torchrun(probe, config_args(tiny_config(data_dir, out, **run)), nproc=2, max_restarts=2)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "torchrun restart 1 of the run" not in b.stdout and f"resuming from {out}/ckpt.pt at iter 4" not in b.stdout
    assert "torchrun restart 2 of the run in" in b.stdout and f"resuming from {out}/ckpt.pt at iter 2" in b.stdout
    (previous,) = previous_runs(out)
    assert (load_checkpoint(str(previous / "ckpt.pt"))["iter_num"], outdir.run_id_of(str(previous))) == (4, a_run)
    b_ckpt = load_checkpoint(str(out / "ckpt.pt"))
    assert b_ckpt["iter_num"] == 6 and b_ckpt["run_id"] != a_run
    assert [(s["iter"], s["init_from"]) for s in starts_of(out)] == [(0, "scratch"), (2, "resume")]


def _agents(cfg_args: list[str], port: int, cwd=(ROOT, ROOT), nproc: int = 2) -> list[subprocess.CompletedProcess]:
    """Two torchrun agents (node ranks 0 and 1) on 127.0.0.1 with c10d rendezvous: a world of 2 x nproc."""
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=test-run",
               f"--node_rank={node}", "--master_addr=127.0.0.1", os.path.join(ROOT, "train.py"), *cfg_args]
        procs.append(subprocess.Popen(cmd, cwd=cwd[node], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=HANG_S), *p.communicate()) for p in procs]


@pytest.mark.slow
def test_two_agents_train_a_world_of_4_that_resumes_at_worlds_of_2_and_1(data_dir, tmp_path):
    run = dict(max_iters=6, lr_decay_iters=10, eval_interval=3, dropout=0.0, gradient_accumulation_steps=4,
               report=False)
    single = train(tiny_config(data_dir, tmp_path / "single", **{**run, "max_iters": 10}))
    out = tmp_path / "nodes"
    results = _agents(config_args(tiny_config(data_dir, out, **run)), _free_port())
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert load_checkpoint(str(out / "ckpt.pt"))["world_size"] == 4
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *config_args(tiny_config(data_dir, out, **{**run, "max_iters": 8},
                                                             init_from="auto"))],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "world_size: 4 -> 2" in r.stdout, r.stderr[-3000:]
    resumed = train(tiny_config(data_dir, out, **{**run, "max_iters": 10}, init_from="auto"))
    assert resumed["iter_num"] == 10
    ref = single["model"].state_dict()
    got = weights(out / "ckpt.pt")
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5  # gradient sums in another order


@pytest.mark.slow
def test_two_agents_with_node_local_out_dirs_are_refused_in_one_line(data_dir, tmp_path):
    """Each agent in its own working directory with a relative out_dir: two folders, as on two nodes without a shared
    file system. The run stops at the start, naming the node that cannot see rank 0's files."""
    run = dict(max_iters=2, eval_interval=2, report=False, gradient_accumulation_steps=2)
    args = [a if not a.startswith("--out_dir=") else "--out_dir=local_out" for a in
            config_args(tiny_config(data_dir, tmp_path / "unused", **run))]
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    results = _agents(args, _free_port(), cwd=(tmp_path / "node0", tmp_path / "node1"), nproc=1)
    assert all(r.returncode != 0 for r in results)
    errors = [line for r in results for line in r.stderr.splitlines() if line.startswith("error: out_dir=")]
    assert errors and "is not shared" in errors[0] and "node rank 1" in errors[0]


@pytest.mark.slow
def test_two_agents_train_fsdp_at_a_world_of_4_that_resumes_at_worlds_of_2_and_1(data_dir, tmp_path):
    run = dict(max_iters=4, lr_decay_iters=8, eval_interval=2, dropout=0.0, gradient_accumulation_steps=4,
               report=False, parallelism="fsdp")
    single = train(tiny_config(data_dir, tmp_path / "single", **{**run, "max_iters": 8, "parallelism": "ddp"}))
    out = tmp_path / "nodes"
    results = _agents(config_args(tiny_config(data_dir, out, **run)), _free_port())
    assert all(r.returncode == 0 for r in results), results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert checkpoint_sharded.read_train_state(str(out / "ckpt_sharded"))["world_size"] == 4
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", *config_args(tiny_config(data_dir, out, **{**run, "max_iters": 6},
                                                             init_from="auto"))],
                       cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0 and "world_size: 4 -> 2" in r.stdout, r.stderr[-3000:]
    train(tiny_config(data_dir, out, **{**run, "max_iters": 8}, init_from="auto"))
    model, state = checkpoint_sharded.load_sharded_as_full(str(out / "ckpt_sharded"))
    assert state["iter_num"] == 8
    ref = single["model"].state_dict()
    got = model.state_dict()
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5  # gradient sums in another order


# ----------------------------------------------------------------------------------------------- a start under fault


@pytest.mark.slow
def test_a_start_that_trains_no_step_moves_nothing(data_dir, tmp_path, capsys):
    """Bug: --max_iters=0 (also with --init_from=DIR) in a folder that held a run moved the run to previous/ and wrote
    a new run.json, saving nothing: a requeued init_from=auto job then started again at iter 0. A start that trains no
    step is an evaluation: the folder is as it was."""
    out, other = tmp_path / "job", tmp_path / "other"
    train(tiny_config(data_dir, other, max_iters=2, eval_interval=2))
    job = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=2, eval_interval=2, init_from="auto"))]
    assert run_in_process(job, capsys).returncode == 0
    before = folder_state(out)
    for args in (["--init_from=scratch", "--max_iters=0"], [f"--init_from={other}", "--max_iters=0"]):
        r = run_in_process([*job, *args], capsys)
        assert r.returncode == 0 and "nothing to train: max_iters=0; evaluating the model only" in r.stdout, args
        assert "moved to" not in r.stdout and folder_state(out) == before, args
    r = run_in_process([*job, "--max_iters=4"], capsys)  # the requeue continues the run
    assert r.returncode == 0 and f"resuming from {out / 'ckpt.pt'} at iter 2" in r.stdout


def test_the_lock_that_cannot_be_made_is_one_line_and_changes_nothing(data_dir, tmp_path, monkeypatch, capsys):
    """Bug: a read-only out_dir (or file system), for a new run or --init_from=resume, ended in a PermissionError or
    OSError 30 traceback at the lock. Now one line naming run.lock and the cause, exit 2, the folder as it was (on a
    full disk too: the empty run.lock it made was left behind)."""
    from faulty_disk import FaultyDisk

    out = tmp_path / "out"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    before = folder_state(out)
    for again in ([], ["--init_from=resume", "--max_iters=4"]):
        for err in (errno.EROFS, errno.EACCES, errno.ENOSPC):  # ENOSPC: run.lock made, its first write refused
            with monkeypatch.context() as m:
                FaultyDisk(out, m, fail_at=0, err=err)  # the first write: run.lock
                r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, max_iters=2)), *again], capsys)
            assert r.returncode == 2, r.stderr[-2000:]
            (line,) = r.stderr.splitlines()
            assert line.startswith(f"error: cannot hold the run folder: {out / 'run.lock'} ({os.strerror(err)})"), line
            assert folder_state(out) == before


def test_a_folder_removed_while_the_lock_opens_is_made_again(data_dir, tmp_path, monkeypatch):
    """Bug: two starts racing in a new folder: one removes the folder it made (refused, or done) while the other opens
    its lock there: FileNotFoundError. Now the folder is made again and the start goes on."""
    out = tmp_path / "a" / "b"
    real_open, removed = os.open, []

    def racing_open(path, flags, *args, **kwargs):
        if str(path).endswith(outdir.LOCK_FILE) and not removed:  # the other start's cleanup, just before our open
            removed.append(path)
            os.rmdir(out)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    with outdir.hold(str(out)):
        assert removed and (out / outdir.LOCK_FILE).is_file()
    assert not (tmp_path / "a").exists()  # made by the start, removed at its end


def test_a_refused_start_leaves_no_folder_it_made(data_dir, tmp_path, capsys):
    """Bug: a start refused in out_dir=a/b/c removed c but left a/ and a/b/. Now every folder it made goes."""
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "a" / "b" / "c", n_embd=33))],
                       capsys)
    assert r.returncode == 2 and "n_embd=33 must be divisible by n_head=2" in r.stderr
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "a" / "b" / "c",
                                                             init_from=str(tmp_path / "missing.pt")))], capsys)
    assert r.returncode == 2 and sorted(os.listdir(tmp_path)) == ["tinychar"]
    cfg = dataclasses.replace(tiny_config(data_dir, tmp_path / "x" / "y", init_from="auto"),
                              data_dir=str(tmp_path / "no_data"))
    with pytest.raises(checkpoint_file.UserError, match="no_data"):  # refused inside the hold: no dataset there
        train(cfg)
    assert sorted(os.listdir(tmp_path)) == ["tinychar"]


def test_sigterm_during_the_start_is_one_line_and_leaves_the_folder_as_it_was(data_dir, tmp_path, monkeypatch, capsys):
    """Bug: a SIGTERM during the start (the model loading, before the first step) exited 143 with no message and left
    a new folder holding only run.lock. Now: one line, exit 143, and the folder as it was: a new one gone, a used one
    byte for byte."""
    from nanogpt import start

    load_model = start.load_model

    def signalled(*args, **kwargs):  # the scheduler's SIGTERM arrives while the model loads
        os.kill(os.getpid(), signal.SIGTERM)
        return load_model(*args, **kwargs)

    monkeypatch.setattr(start, "load_model", signalled)
    used = tmp_path / "used"
    for out in (tmp_path / "new", used):
        if out == used:
            with monkeypatch.context() as m:
                m.setattr(start, "load_model", load_model)
                train(tiny_config(data_dir, used, max_iters=2, eval_interval=2))
        before = folder_state(out) if out.exists() else None
        r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, max_iters=4))], capsys)
        assert r.returncode == 143, r.stderr[-2000:]
        assert r.stderr.splitlines()[-1] == ("stopped by SIGTERM during the start, before the first step: nothing was "
                                             "saved, and the run folder is as it was")
        assert (folder_state(out) if out.exists() else None) == before


def test_the_starts_lines_say_what_is_true(data_dir, tmp_path, capsys):
    """Bugs: a missing out_dir with --init_from=resume was said to "hold run.lock" (the start's own); a resume with a
    changed shape announced "resuming from ..." then refused; a run moved aside with no checkpoint was said to resume
    from there; an eval-only resume listed eval_only: False -> True as a changed setting; a folder given as a
    checkpoint file named an internal function (read_weights)."""
    missing = tmp_path / "missing"
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, missing, init_from="resume"))], capsys)
    assert r.returncode == 2 and "the folder does not exist" in r.stderr and "run.lock" not in r.stderr, r.stderr
    assert not missing.exists()
    out = tmp_path / "out"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, n_embd=64, init_from="resume"))], capsys)
    assert r.returncode == 2 and "cannot resume: the checkpoint's model differs" in r.stderr
    assert "resuming from" not in r.stdout, r.stdout
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, init_from="resume", max_iters=4,
                                                             eval_only=True))], capsys)
    assert r.returncode == 0 and "eval_only: False -> True" not in r.stdout, r.stdout
    no_ckpt = tmp_path / "no_ckpt"  # a run killed before its first save: its run.json and log only
    no_ckpt.mkdir()
    outdir.begin_run(str(no_ckpt))
    (no_ckpt / "metrics.jsonl").write_text('{"iter": 0, "train_loss": 3.4, "val_loss": 3.4, "elapsed_s": 1.0}\n')
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, no_ckpt, max_iters=1))], capsys)
    assert r.returncode == 0 and "it saved no checkpoint" in r.stdout and "resumes from there" not in r.stdout
    with pytest.raises(checkpoint_file.UserError) as e:
        checkpoint_file.load_checkpoint(str(out))
    assert "read_weights" not in str(e.value) and "is a folder, not a checkpoint file" in str(e.value)


def test_the_lock_looks_again_when_its_holder_removed_the_file_between_open_and_lock(tmp_path, monkeypatch):
    """A holder lets go by removing run.lock, then unlocking: a start that opened the old file just before holds a
    lock on a file no one else can see, and a third start would make a new run.lock and hold that too. The lock
    looks again after flock: it holds the file that stands at run.lock, and no other start can."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    (out / outdir.LOCK_FILE).write_text("")
    real_flock, removed = fcntl.flock, []

    def holder_lets_go(fd, op):  # between our open and our flock, the holder removes the file it locked
        if not removed:
            removed.append(True)
            os.remove(out / outdir.LOCK_FILE)
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_lets_go)
    with outdir.hold(str(out)):
        assert removed and (out / outdir.LOCK_FILE).exists()
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with pytest.raises(checkpoint_file.UserError, match="is in use by a live run"):
            with outdir.hold(str(out)):
                pass


def test_a_run_whose_lock_file_was_removed_leaves_the_next_holders_lock_alone(tmp_path):
    """Run A's run.lock is removed while A runs (by hand, a cleanup script): B makes a new one and holds it. A's end
    must leave B's file be, or a third start makes yet another and runs beside B. (flock locks of two opens conflict
    in one process too.)"""
    out = tmp_path / "out"
    out.mkdir()
    b = contextlib.ExitStack()
    with outdir.hold(str(out)):  # A
        os.remove(out / outdir.LOCK_FILE)
        b.enter_context(outdir.hold(str(out)))
    with b:
        assert (out / outdir.LOCK_FILE).exists()
        with pytest.raises(checkpoint_file.UserError, match="is in use by a live run"):
            with outdir.hold(str(out)):
                pass


def test_a_resume_records_the_resuming_jobs_id_so_its_own_restarts_resume(tmp_path):
    """A run begun by torchrun job A and resumed by job B: run.json then names B, so B's restarts resume the run and
    A's (a stale straggler) do not."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"x")
    run_id = outdir.begin_run(str(out), job="job-A")
    assert outdir.continue_run(str(out), run_id, job="job-B") == run_id
    assert outdir.read_run(str(out))["torchrun_job"] == "job-B"
    assert outdir.resolve_init_from("scratch", str(out), restart=1, job="job-B")[0] == "resume"
    assert outdir.resolve_init_from("scratch", str(out), restart=1, job="job-A")[0] == "scratch"


def test_a_restart_without_a_job_id_never_resumes_a_run_without_one(tmp_path):
    """Where torchrun's workers share no store (no job id: None), a restart cannot tell its run from another's, and
    follows init_from: a run.json that records no job (None) is no match for None."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"x")
    outdir.begin_run(str(out), job=None)
    assert outdir.resolve_init_from("scratch", str(out), restart=1, job=None)[0] == "scratch"


@pytest.mark.slow
def test_run_json_of_any_content_is_read_as_one_line_or_used(tmp_path):
    """run.json edited by hand, damaged or of another program: whatever JSON it holds (any type, size, nesting, in any
    field), what reads it (a start's decision, a torchrun restart, the move aside, finding a checkpoint) either uses
    it or says in one line that it is damaged; never another exception."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from helpers import json_values

    good = {"run_id": "abc123", "started": 1.7e9, "torchrun_job": "job"}
    docs = json_values() | st.fixed_dictionaries({}).flatmap(lambda _: st.sampled_from(sorted(good)).flatmap(
        lambda key: json_values().map(lambda value: {**good, key: value})))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(docs)
    def reads(doc):
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        (out / "run.json").write_text(json.dumps(doc))
        (out / "ckpt.pt").write_bytes(b"not read here")
        for read in (lambda: outdir.read_run(str(out)), lambda: outdir.run_id_of(str(out)),
                     lambda: outdir.resolve_init_from("auto", str(out), restart=1, job="job"),
                     lambda: outdir.move_previous_run(str(out)), lambda: checkpoints.find_checkpoint(str(out))):
            try:
                read()
            except checkpoint_file.UserError as e:
                assert "\n" not in str(e)

    reads()
