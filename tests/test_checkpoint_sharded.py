"""checkpoint_sharded.py: FSDP's sharded folders, in processes of one (FSDP over a process group of one). A SIGKILL at any stage
of a save (every shard written but not DCP's metadata; all written but not yet linked) leaves the previous folder
loadable, and the next save removes the killed one's; a save in the background (start_sharded_save) keeps the
weights and optimizer state of its step while training changes them, and is linked only once written; the best val
loss's folder stays linked as ckpt_sharded_best across a stop and a resume. Sharded saves, kills and resumes on 2
ranks: tests/test_fsdp.py."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from nanogpt import files, parallel
from nanogpt import checkpoints
from nanogpt import checkpoint_sharded, outdir
import train as train_module
from helpers import HANG_S, ROOT, tiny_config
from model import GPT, GPTConfig
from sample import SampleConfig, load_model
from test_checkpoints import max_diff, metrics, params_of
from train import train


KILL_CHILD = """
import os, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
from nanogpt import checkpoint_sharded
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from helpers import tiny_config
from train import train

import train as train_module
stage, saves, steps = sys.argv[1], [], []
real_step = train_module.train_step
def step(*args, **kwargs):
    steps.append(1)
    return real_step(*args, **kwargs)
train_module.train_step = step
def kill(at):
    if at == stage and len(saves) == 2:  # the second save: the first one is the checkpoint to keep
        print(f"steps run: {{len(steps)}}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
def counted(save):
    def count(*args, **kwargs):
        saves.append(1)
        return save(*args, **kwargs)
    return count
checkpoint_sharded.save_sharded = counted(checkpoint_sharded.save_sharded)
checkpoint_sharded.start_sharded_save = counted(checkpoint_sharded.start_sharded_save)  # async_save
checkpoint_sharded._fault_point = kill
finish = FileSystemWriter.finish
def finish_or_die(self, *args, **kwargs):  # every shard written, DCP's metadata not yet
    kill("dcp_finish")
    return finish(self, *args, **kwargs)
FileSystemWriter.finish = finish_or_die
train(tiny_config({data!r}, {out!r}, max_iters=4, eval_interval=2, parallelism="fsdp"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dcp_finish", "before_link"])
def test_sigkill_during_a_sharded_save_leaves_a_loadable_checkpoint(data_dir, tmp_path, stage):
    out = tmp_path / "run"
    code = KILL_CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"), data=str(data_dir), out=str(out))
    r = subprocess.run([sys.executable, "-c", code, stage], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert len([f for f in os.listdir(out) if f.startswith(outdir.SHARDED + "_")]) == 2  # the killed save's too
    ckpt = checkpoints.find_checkpoint(str(out), prefer_sharded=True).read()
    assert ckpt["iter_num"] == 2
    model, _ = checkpoint_sharded.load_sharded_as_full(ckpt["sharded"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # the next save removes the killed save's folder
    train(tiny_config(data_dir, out, max_iters=4, eval_interval=2, parallelism="fsdp", init_from="resume"))
    kept = sorted(f for f in os.listdir(out) if f not in ("metrics.jsonl", "run.json"))
    assert kept == ["ckpt_sharded", os.readlink(out / "ckpt_sharded")] and kept[1].startswith("ckpt_sharded_0000004_")


@pytest.mark.slow
def test_a_save_in_the_background_keeps_the_weights_of_its_step_and_links_only_once_written(tmp_path):
    """async_save: training changes the weights (in place, as the optimizer does) while DCP writes; the folder holds
    the step's weights and optimizer state, and ckpt_sharded names it only after finish()."""
    from nanogpt.distributed import checkpoint_group, cleanup_distributed, setup_distributed
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    dist = setup_distributed("cpu", group_of_one=True)
    write, started = FileSystemWriter.write_data, []

    def slow_write(self, *args, **kwargs):  # the shards land after training has changed the weights
        started.append(1)
        torch.distributed.barrier(group=group)  # never returns before the main thread changed them
        return write(self, *args, **kwargs)

    try:
        torch.manual_seed(0)
        model = parallel.shard_model(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11)),
                                     dist, "float32", compile=False)
        optimizer = torch.optim.AdamW(model.parameters())
        idx = torch.randint(11, (2, 8))
        model(idx, idx)[1].backward()
        optimizer.step()
        expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        exp_avg = [optimizer.state[p]["exp_avg"].full_tensor().clone() for p in model.parameters()]
        group = checkpoint_group(dist)
        FileSystemWriter.write_data = slow_write
        state = {"iter_num": 1, "model_args": model.config.__dict__, "config": {}}
        pending = checkpoint_sharded.start_sharded_save(str(tmp_path), model, optimizer, state, dist, group)
        with torch.no_grad():  # the next step
            for p in model.parameters():
                p.add_(1.0)
                optimizer.state[p]["exp_avg"].add_(1.0)
        assert not os.path.exists(tmp_path / outdir.SHARDED)  # nothing linked while the shards are written
        torch.distributed.barrier(group=group)
        pending.finish()
        assert started and os.readlink(tmp_path / outdir.SHARDED) == "ckpt_sharded_0000001_0"
        saved, _ = checkpoint_sharded.load_sharded_as_full(str(tmp_path / outdir.SHARDED))
        assert all(torch.equal(saved.state_dict()[k], expected[k]) for k in expected)
        fresh = parallel.shard_model(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11)),
                                     dist, "float32", compile=False)
        fresh_opt = torch.optim.AdamW(fresh.parameters())
        fresh(idx, idx)[1].backward()
        fresh_opt.step()
        checkpoint_sharded.load_sharded(str(tmp_path / outdir.SHARDED), fresh, fresh_opt)
        assert all(torch.equal(fresh_opt.state[p]["exp_avg"].full_tensor(), e)
                   for p, e in zip(fresh.parameters(), exp_avg))
    finally:
        FileSystemWriter.write_data = write
        cleanup_distributed(dist)


@pytest.mark.slow
def test_fsdp_keeps_the_best_checkpoint_across_a_stop_and_resume(data_dir, tmp_path, monkeypatch, capsys):
    """always_save_checkpoint=False (nanoGPT's own Shakespeare config) was refused under FSDP. Now the best val
    loss's folder keeps a second link, ckpt_sharded_best, while a stop saves the latest in ckpt_sharded."""
    out = tmp_path / "run"
    run = dict(max_iters=4, eval_interval=2, parallelism="fsdp", always_save_checkpoint=False)
    train(tiny_config(data_dir, out, **run))
    evals = {r["iter"]: r["val_loss"] for r in metrics(out, "val_loss")}
    assert evals[4] < evals[2]  # the data is learnable: iter 4 is the best so far
    assert os.readlink(out / "ckpt_sharded") == os.readlink(out / "ckpt_sharded_best") == "ckpt_sharded_0000004_0"
    best_weights = params_of(str(out / "ckpt_sharded_best"))
    with monkeypatch.context() as m:  # a stop at the second step of the resume: iter 5 is saved, not the best
        real_step, calls = train_module.train_step, []

        def step(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return real_step(*args, **kwargs)

        m.setattr(train_module, "train_step", step)
        with pytest.raises(SystemExit):
            train(tiny_config(data_dir, out, **{**run, "max_iters": 8}, gradient_accumulation_steps=2,
                              init_from="resume"))
    assert "the best val loss's weights stay in ckpt_sharded_best" in capsys.readouterr().out
    assert checkpoints.find_checkpoint(str(out)).iter_num == 5
    assert checkpoints.find_checkpoint(str(out), "ckpt_sharded_best").iter_num == 4
    assert max_diff(best_weights, params_of(str(out / "ckpt_sharded_best"))) == 0.0
    assert sorted(e for e in os.listdir(out) if e.startswith("ckpt")) == [
        "ckpt_sharded", "ckpt_sharded_0000004_0", "ckpt_sharded_0000005_0", "ckpt_sharded_best"]
    # the resume continues from 5; an improving eval moves the best link, and the old best folder goes
    train(tiny_config(data_dir, out, **{**run, "max_iters": 6}, gradient_accumulation_steps=2, init_from="resume"))
    assert os.readlink(out / "ckpt_sharded") == os.readlink(out / "ckpt_sharded_best") == "ckpt_sharded_0000006_0"
    assert sorted(e for e in os.listdir(out) if e.startswith("ckpt")) == [
        "ckpt_sharded", "ckpt_sharded_0000006_0", "ckpt_sharded_best"]
    # sample.py reads the best copy by name
    load_model(SampleConfig(out_dir=str(out), ckpt="ckpt_sharded_best", device="cpu", dtype="float32"))
    assert f"checkpoint: {out / 'ckpt_sharded_best'} at iter 6" in capsys.readouterr().err


LINK_BEFORE_RETURN = """
import os, sys, time
sys.path[:0] = [{root!r}]
import torch
import torch.distributed as td
import torch.distributed.checkpoint as dcp
from model import GPT, GPTConfig
from nanogpt import checkpoint_sharded, outdir, parallel
from nanogpt.distributed import cleanup_distributed, setup_distributed

out = {out!r}
flag = os.path.join(out, ".rank1_past_its_shards")
dist = setup_distributed("cpu")
torch.manual_seed(0)
model = parallel.shard_model(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11)), dist,
                             "float32", compile=False)
optimizer = torch.optim.AdamW(model.parameters())
if dist.rank == 1:  # rank 1 says when its shards are written and it waits for rank 0 (or has gone on without it)
    save, barrier, written = dcp.save, td.barrier, []
    dcp.save = lambda *a, **k: (save(*a, **k), written.append(1))[0]
    def waiting(*a, **k):
        if written:
            open(flag, "w").close()
        return barrier(*a, **k)
    td.barrier = waiting
else:  # rank 0 links only once rank 1 is past its shards: a rank 1 that returned before the link reads no link
    def before_link(stage):
        for _ in range(60000 if stage == "before_link" else 0):
            if os.path.exists(flag):
                break
            time.sleep(0.001)
    checkpoint_sharded._fault_point = before_link
os.makedirs(out, exist_ok=True)
folder = checkpoint_sharded.save_sharded(out, model, optimizer, {{"iter_num": 1, "model_args": {{}}, "config": {{}}}}, dist)
if dist.rank == 1:
    link = os.path.join(out, outdir.SHARDED)
    print("linked:", os.path.islink(link) and os.readlink(link) == os.path.basename(folder), flush=True)
    open(flag, "w").close()
cleanup_distributed(dist, barrier=True)
"""


@pytest.mark.slow
def test_every_rank_returns_from_a_sharded_save_once_the_link_names_it(tmp_path):
    """Rank 0 links ckpt_sharded to the new folder once every shard is written; the other ranks wait for that
    (a barrier) before they return, so none goes on (a stop's exit, a resume of the folder) while the link still
    names the save before."""
    script = tmp_path / "link_before_return.py"
    script.write_text(LINK_BEFORE_RETURN.format(root=ROOT, out=str(tmp_path / "run")))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "linked: True" in r.stdout, r.stdout + r.stderr[-3000:]


def test_convert_names_a_missing_folder_and_a_folder_that_is_no_sharded_checkpoint(tmp_path):
    from nanogpt.errors import UserError

    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'nowhere'} does not exist: give an FSDP run's "
                                                  f"out_dir/{outdir.SHARDED}")):
        checkpoint_sharded.convert_to_single_file(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match=re.escape(f"{tmp_path} is not a sharded checkpoint folder")):
        checkpoint_sharded.convert_to_single_file(str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing written


def cut_short(path, size: int) -> None:
    os.truncate(path, size)


def garbled(path) -> None:
    """The size kept, the bytes not DCP's: what the size check cannot see."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * os.path.getsize(path))


SHARD = "__0_0.distcp"  # a world of one's shards: one file
DAMAGE = {  # what is done to the folder, and what the line says of it
    "shard cut short": (lambda d: cut_short(d / SHARD, 1000), f"its shard file {SHARD} is cut short (1000 of "),
    "shard missing": (lambda d: os.remove(d / SHARD), f"its shard file {SHARD} is missing"),
    "metadata cut short": (lambda d: cut_short(d / ".metadata", 100),
                           "its .metadata is cut short or not DCP's (UnpicklingError: pickle data was truncated)"),
    "metadata missing": (lambda d: os.remove(d / ".metadata"), "it has no .metadata (DCP's index of its shards)"),
    "shard garbled": (lambda d: garbled(d / SHARD), "a shard file does not read as DCP wrote it (UnpicklingError)"),
}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """A world of one's FSDP run (a process group of one): its dataset and its out_dir with ckpt_sharded, made once
    for the damage tests, which each damage a copy."""
    from helpers import make_char_dataset

    root = tmp_path_factory.mktemp("fsdp_run")
    make_char_dataset(root / "tinychar")
    train(tiny_config(root / "tinychar", root / "run", max_iters=4, eval_interval=2, parallelism="fsdp"))
    return root / "tinychar", root / "run"


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_sharded_folder_is_one_line_for_every_command_that_reads_it(fsdp_run, tmp_path, capsys, damage):
    """Bug: a shard file or DCP's .metadata cut short or removed (a copy interrupted, a file deleted) ended a resume,
    sample.py, export.py, hellaswag.py and convert_sharded.py in DCP's traceback (EOFError, FileNotFoundError,
    'metadata is None'). Now each is one line naming the folder, the file and the fix, exit status 2, and nothing in
    out_dir changed."""
    from helpers import config_args, folder_state, run_in_process

    data, run = fsdp_run
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    damage_folder, what = DAMAGE[damage]
    damage_folder(out / os.readlink(out / outdir.SHARDED))
    before = folder_state(out)
    (tmp_path / "hs.jsonl").write_text('{"ctx": "The cat", "endings": ["sat.", "ran.", "hid.", "swam."], "label": 0}\n')
    expected = (f"error: sharded checkpoint {out / outdir.SHARDED} (-> {os.readlink(out / outdir.SHARDED)}"
                f") is damaged: {what}")
    resume = tiny_config(data, out, max_iters=6, eval_interval=2, init_from="resume")
    commands = {
        "resume": ["train.py", *config_args(resume)],
        "resume under FSDP": ["train.py", *config_args(resume), "--parallelism=fsdp"],
        "sample": ["sample.py", f"--out_dir={out}", "--device=cpu", "--max_new_tokens=5", "--num_samples=1"],
        "export": ["export.py", f"--out_dir={out}", f"--to={tmp_path / 'hf'}"],
        "hellaswag": ["hellaswag.py", f"--out_dir={out}", "--device=cpu", f"--path={tmp_path / 'hs.jsonl'}"],
        "convert": ["convert_sharded.py", str(out / outdir.SHARDED)],
    }
    for name, args in commands.items():
        r = run_in_process(args, capsys)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (name, r.stderr[-3000:])
        assert errors[0].startswith(expected) and errors[0].endswith(
            ": restore it from a backup, or use another checkpoint (a run: start again with --init_from=scratch); "
            "nothing was changed"), (name, errors[0])
        assert folder_state(out) == before and not (tmp_path / "hf").exists(), name


@pytest.mark.slow
def test_a_damaged_shard_stops_every_rank_of_a_torchrun_resume(data_dir, tmp_path):
    """On 2 ranks each reads its part of every shard file: rank 1's file cut short (found before DCP reads) or
    garbled (found by DCP's read, which it reports on every rank) stops both ranks with the one line, none left
    waiting for the other (torchrun ends the job once the first rank exits: which exit status it records for the
    second is a race, so the lines say it); the folder as it was."""
    from helpers import config_args, folder_state, run_script

    cfg = tiny_config(data_dir, tmp_path / "run", max_iters=4, eval_interval=2, parallelism="fsdp",
                      gradient_accumulation_steps=2)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    r = run_script([*torchrun, *config_args(cfg)])
    assert r.returncode == 0, r.stderr[-3000:]
    for damage, what in [(lambda f: cut_short(f, 1000), "its shard file __1_0.distcp is cut short (1000 of "),
                         (garbled, "a shard file does not read as DCP wrote it (UnpicklingError)")]:
        out = tmp_path / f"damaged{len(what)}"
        shutil.copytree(cfg.out_dir, out, symlinks=True)
        damage(out / os.readlink(out / outdir.SHARDED) / "__1_0.distcp")
        before = folder_state(out)
        resume = dataclasses.replace(cfg, out_dir=str(out), max_iters=6, init_from="resume")
        r = run_script([*torchrun, *config_args(resume)])
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 2 and errors[0] == errors[1] and what in errors[0], r.stderr[-3000:]
        assert r.returncode != 0 and "[rank" not in r.stderr, r.stderr[-3000:]  # no rank's traceback
        assert folder_state(out) == before


def test_convert_never_writes_over_another_runs_checkpoint_or_a_foreign_file(fsdp_run, data_dir, tmp_path):
    """A review's reproduction: `convert_sharded.py RUN/ckpt_sharded OTHER/ckpt.pt` replaced another run's checkpoint
    (its resume then refused as another run's), exit 0; so too a user's file. Refused in one line before anything is
    read; a conversion again over its own earlier output is written as before."""
    from nanogpt.errors import UserError

    _, run = fsdp_run
    other = tmp_path / "other"
    train(tiny_config(data_dir, other, max_iters=2, eval_interval=2))
    before = (other / "ckpt.pt").read_bytes()
    (tmp_path / "notes.txt").write_text("mine\n")
    for target in (other / "ckpt.pt", tmp_path / "notes.txt"):
        with pytest.raises(UserError, match=re.escape(f"{target} exists and is not a checkpoint of this run (")):
            checkpoint_sharded.convert_to_single_file(str(run / outdir.SHARDED), str(target))
    assert (other / "ckpt.pt").read_bytes() == before and (tmp_path / "notes.txt").read_text() == "mine\n"
    for _ in range(2):  # the second converts over the first's file: the same run's
        checkpoint_sharded.convert_to_single_file(str(run / outdir.SHARDED), str(tmp_path / "converted.pt"))


def test_a_conversion_to_a_file_of_another_name_is_read_by_every_reader(data_dir, tmp_path):
    """Bug: `convert_sharded.py out/ckpt_sharded_best best.pt` (its --help's example) of a run with
    always_save_checkpoint=False recorded best_file='best.pt', which every reader then refused as damaged."""
    from nanogpt.checkpoint_file import load_checkpoint

    run = tmp_path / "run"
    train(tiny_config(data_dir, run, max_iters=2, eval_interval=2, parallelism="fsdp", always_save_checkpoint=False))
    for name, best_file in (("best.pt", None), ("ckpt.pt", outdir.CKPT)):
        path = checkpoint_sharded.convert_to_single_file(str(run / outdir.SHARDED_BEST), str(tmp_path / name))
        assert load_checkpoint(path)["best_file"] == best_file


def test_a_sharded_save_whose_train_state_cannot_be_written_leaves_no_folder(data_dir, tmp_path):
    """The shards written, the folder's completion mark (train_state.pt) refused by a full disk: the folder is never
    complete and no link names it, so it goes (it held the disk's space); the run stops on the save before."""
    import errno

    from nanogpt.errors import UserError

    real, calls = checkpoint_sharded.save_checkpoint, []

    def full_at_the_second(path, state):
        calls.append(path)
        if len(calls) >= 2:
            raise files.write_failed(path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        return real(path, state)

    out = tmp_path / "out"
    checkpoint_sharded.save_checkpoint = full_at_the_second
    try:
        with pytest.raises(UserError) as e:
            train(tiny_config(data_dir, out, max_iters=4, eval_interval=2, parallelism="fsdp"))
    finally:
        checkpoint_sharded.save_checkpoint = real
    assert e.value.exit_code == 1 and "ckpt_sharded at iter 2 is intact" in str(e.value), str(e.value)
    assert sorted(n for n in os.listdir(out) if n.startswith("ckpt_sharded")) == ["ckpt_sharded",
                                                                                 "ckpt_sharded_0000002_0"]
