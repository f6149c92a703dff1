"""checkpoint_file.py: one checkpoint file. save_checkpoint writes it atomically (a kill at any point of the write, a crash
before the rename or a full disk leaves the previous checkpoint whole), save_run_checkpoint keeps the best val loss's
weights across stops and resumes and the last K saves by iteration (keep_last), load_checkpoint runs nothing a
pickle names (weights_only), and checkpoint_model_config fills the gelu of older checkpoints. A run's checkpoints in
either format: tests/test_checkpoints.py; FSDP's sharded folders: tests/test_checkpoint_sharded.py."""
from __future__ import annotations

import errno
import io
import os
import signal
import time

import numpy as np
import pytest
import torch

from nanogpt import checkpoint_file, files
from nanogpt.checkpoint_file import load_checkpoint, save_checkpoint, save_run_checkpoint
from nanogpt.errors import UserError, WriteError
from helpers import tiny_config
from sample import SampleConfig, load_model
from train import train


ARGS = {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8, "vocab_size": 11}  # a model's, as a run records it


def test_a_full_disk_is_a_clear_error_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 1})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(UserError) as info:
        save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 2})
    assert str(info.value) == (f"could not write checkpoint {path} (No space left on device); the previous "
                               f"checkpoint is intact: free disk space, make the folder writable, or choose another "
                               f"out_dir")
    monkeypatch.undo()
    assert load_checkpoint(path)["iter_num"] == 1 and os.listdir(tmp_path) == ["ckpt.pt"]


def _save_and_stop_at(path: str, point: str, ready_w: int) -> None:
    """Child: save a checkpoint (iteration 2) and stop at `point` of the write, telling the parent through ready_w,
    so that the parent's SIGKILL lands exactly there. Tensors come from numpy: a torch op would start OpenMP
    threads, which deadlock in a forked child of a process that used them."""

    def stop(*args, **kwargs):
        os.write(ready_w, b"1")
        time.sleep(3600)  # until killed

    real_save = torch.save
    if point == "half written":

        def half_save(obj, f):  # the temporary file holds the first half of the checkpoint's bytes
            buffer = io.BytesIO()
            real_save(obj, buffer)
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
            stop()

        torch.save = half_save
    elif point == "written, not synced":
        os.fsync = stop
    elif point == "synced, not renamed":
        os.replace = stop
    elif point == "renamed, folder not synced":
        files.fsync_folder = stop
    save_checkpoint(path, {"model": {"w": torch.from_numpy(np.arange(2_000_000, dtype=np.float32) + 2)},
                           "model_args": ARGS, "iter_num": 2})


@pytest.mark.parametrize("point, survivor", [("half written", 1), ("written, not synced", 1),
                                             ("synced, not renamed", 1), ("renamed, folder not synced", 2)])
def test_sigkill_during_a_checkpoint_write_leaves_a_whole_checkpoint(tmp_path, point, survivor):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": {"w": torch.arange(2_000_000, dtype=torch.float32) + 1}, "model_args": ARGS,
                           "iter_num": 1})
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            os.close(r)
            _save_and_stop_at(path, point, w)
        finally:
            os._exit(1)
    os.close(w)
    assert os.read(r, 1) == b"1"  # the child is at `point`
    os.close(r)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert any(".tmp." in f for f in os.listdir(tmp_path)) == (survivor == 1)  # killed inside the write
    ckpt = load_checkpoint(path)  # whole: the old checkpoint or the new one, never a torn file
    assert ckpt["iter_num"] == survivor
    assert torch.equal(ckpt["model"]["w"], torch.arange(2_000_000, dtype=torch.float32) + survivor)
    # temporary files of killed writers are cleaned at the next save
    save_checkpoint(path, {"model": {}, "model_args": ARGS, "iter_num": 3})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_a_crash_between_temporary_write_and_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": {"w": torch.ones(3)}, "model_args": ARGS, "iter_num": 1})

    def die(*args):
        raise SystemExit("killed between write and rename")

    monkeypatch.setattr(os, "replace", die)
    with pytest.raises(SystemExit):
        save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "model_args": ARGS, "iter_num": 2})
    monkeypatch.undo()
    ckpt = load_checkpoint(path)
    assert ckpt["iter_num"] == 1 and torch.equal(ckpt["model"]["w"], torch.ones(3))


def test_best_checkpoint_bookkeeping_over_stops_resumes_and_evals(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path / "data", tmp_path / "out", always_save_checkpoint=False, keep_last=1)
    out = tmp_path / "out"
    os.makedirs(out)

    def saved(name):
        return load_checkpoint(str(out / name))["iter_num"] if (out / name).exists() else None

    def save(i, improved, best_file, config=cfg):
        return save_run_checkpoint({"model": {}, "model_args": ARGS, "iter_num": i, "run_id": "r1"}, str(out),
                                   improved, best_file, config.always_save_checkpoint, config.keep_last)

    (out / "ckpt_best.pt").write_bytes(b"an earlier run's")  # not this run's: never claimed as its best
    assert save(3, False, None) is None  # a stop before any improving eval: no best to keep
    assert save(10, True, None) == "ckpt.pt"  # an improving eval: ckpt.pt is the best, the foreign file untouched
    assert (out / "ckpt_best.pt").read_bytes() == b"an earlier run's" and saved("ckpt.pt") == 10
    with pytest.raises(WriteError, match=f"{out / 'ckpt_best.pt'} is not a checkpoint of this run"):
        save(13, False, "ckpt.pt")  # a stop must keep the best there: refused, never written over
    assert (out / "ckpt_best.pt").read_bytes() == b"an earlier run's" and saved("ckpt.pt") == 10
    (out / "ckpt_best.pt").unlink()  # the fix the error names: move it away
    assert save(13, False, "ckpt.pt") == "ckpt_best.pt"  # a stop: the best is kept first
    assert (saved("ckpt.pt"), saved("ckpt_best.pt")) == (13, 10)
    best_file = load_checkpoint(str(out / "ckpt.pt"))["best_file"]  # what a resume reads back
    assert save(17, False, best_file) == "ckpt_best.pt"  # resumed, stopped again before an improvement
    assert (saved("ckpt.pt"), saved("ckpt_best.pt")) == (17, 10)
    assert sorted(os.listdir(out)) == ["ckpt.pt", "ckpt_0000017.pt", "ckpt_best.pt"]  # keep_last spares the best

    # an improving eval writes ckpt_best.pt before touching ckpt.pt: a crash in between loses no best weights
    def crash(*args):
        raise SystemExit("killed")

    monkeypatch.setattr("nanogpt.checkpoint_file.keep_as", crash)
    with pytest.raises(SystemExit):
        save(20, True, "ckpt_best.pt")
    monkeypatch.undo()
    assert (saved("ckpt.pt"), saved("ckpt_best.pt")) == (17, 20)
    assert load_checkpoint(str(out / "ckpt.pt"))["best_file"] == "ckpt_best.pt"  # and the resume point says so
    assert save(20, True, "ckpt_best.pt") == "ckpt.pt"  # the same eval again, uninterrupted
    assert (saved("ckpt.pt"), saved("ckpt_best.pt")) == (20, None)

    always = tiny_config(tmp_path / "data", out, always_save_checkpoint=True, keep_last=2)
    assert save(23, False, "ckpt.pt", always) is None  # ckpt.pt is the latest anyway: the best is not kept
    assert (saved("ckpt.pt"), saved("ckpt_best.pt")) == (23, None)
    for i in (99, 100, 10_000_000):  # keep_last orders by iteration, not by name
        save(i, False, None, always)
    assert sorted(f for f in os.listdir(out) if f.startswith("ckpt_")) == ["ckpt_0000100.pt", "ckpt_10000000.pt"]
    assert os.path.samefile(out / "ckpt.pt", out / "ckpt_10000000.pt")  # a link, not a second write


def test_keep_last_orders_the_snapshots_by_iteration_not_by_name(tmp_path):
    """ckpt_9999999.pt sorts after ckpt_10000000.pt by name: pruning must keep the newest iteration."""
    state = {"model": {}, "model_args": ARGS, "iter_num": 0, "run_id": "r1"}
    for it in (9_999_998, 9_999_999, 10_000_000):
        checkpoint_file.save_run_checkpoint({**state, "iter_num": it}, str(tmp_path), False, None, True, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_10000000.pt", "ckpt_9999999.pt"]


def test_a_save_never_prunes_or_replaces_a_file_it_did_not_write(tmp_path):
    """Bug: keep_last removed every ckpt_NNNNNNN.pt in out_dir (another run's checkpoint copied there, a user's text
    file of that name), and an improving eval wrote over, then removed, a user's ckpt_best.pt. Only files that hold
    this run's id are replaced or removed; a foreign one where the run must write is refused, never written over."""
    save_checkpoint(str(tmp_path / "ckpt_0000002.pt"), {"model": {}, "model_args": ARGS, "iter_num": 2,
                                                        "run_id": "another"})
    (tmp_path / "ckpt_0000001.pt").write_text("my notes\n")
    (tmp_path / "ckpt_best.pt").write_text("my best\n")
    (tmp_path / "ckpt_0000006.pt").write_text("mine too\n")
    foreign = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for i in (3, 4, 5):  # improving evals with always_save_checkpoint=False, keep_last=1
        save_run_checkpoint({"model": {}, "model_args": ARGS, "iter_num": i, "run_id": "r1"}, str(tmp_path), True,
                            "ckpt.pt", False, keep_last=1)
    assert sorted(os.listdir(tmp_path)) == sorted([*foreign, "ckpt.pt", "ckpt_0000005.pt"])
    with pytest.raises(WriteError, match=f"{tmp_path / 'ckpt_0000006.pt'} is not a checkpoint of this run"):
        save_run_checkpoint({"model": {}, "model_args": ARGS, "iter_num": 6, "run_id": "r1"}, str(tmp_path), True,
                            "ckpt.pt", False, keep_last=1)
    assert {n: (tmp_path / n).read_bytes() for n in foreign} == foreign
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 6  # saved before the refusal


def test_keep_last_keeps_the_newest_checkpoints(data_dir, tmp_path):
    train(tiny_config(data_dir, tmp_path / "out", max_iters=8, eval_interval=2, keep_last=2))
    assert sorted(os.listdir(tmp_path / "out")) == ["ckpt.pt", "ckpt_0000006.pt", "ckpt_0000008.pt", "metrics.jsonl",
                                                    "run.json"]
    assert load_checkpoint(str(tmp_path / "out" / "ckpt_0000006.pt"))["iter_num"] == 6


class _RunsACommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("script", ["train", "sample"])
def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_nothing_runs(data_dir, tmp_path, script):
    """The file is read with weights_only=True: a pickle naming os.system is refused before anything runs, and the
    user is told so (not that the file is "truncated or corrupt", as current torch's wording made it)."""
    out = tmp_path / "run"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    marker = tmp_path / "ran"
    state = torch.load(out / "ckpt.pt", weights_only=False)
    torch.save({**state, "extra": _RunsACommand(marker)}, out / "ckpt.pt")
    with pytest.raises(UserError) as e:
        if script == "train":
            train(tiny_config(data_dir, out, max_iters=4, eval_interval=2, init_from="resume"))
        else:
            load_model(SampleConfig(out_dir=str(out), device="cpu"))
    assert "holds objects that are not plain data" in str(e.value) and "was not loaded" in str(e.value)
    assert "corrupt" not in str(e.value)
    assert not marker.exists()


def test_checkpoint_model_config_fills_the_gelu_of_older_checkpoints_and_drops_their_fused_loss():
    from nanogpt.checkpoint_file import checkpoint_model_config

    ours = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "bias": True, "vocab_size": 65,
            "vocab_padding_multiple": 64, "dropout": 0.0, "attention": "sdpa", "sdpa_backend": "auto"}
    assert checkpoint_model_config(ours).gelu == "tanh"  # this repo before the setting: GPT-2's tanh form
    nanogpt = {k: ours[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")}
    assert checkpoint_model_config(nanogpt).gelu == "erf"  # nanoGPT's nn.GELU()
    assert checkpoint_model_config({**ours, "gelu": "erf"}).gelu == "erf"  # recorded: used as it is
    assert checkpoint_model_config(ours, attention="math").attention == "math"  # overrides apply
    # before the model took its loss from the caller (head_loss), model_args recorded fused_loss: not the model's
    assert checkpoint_model_config({**ours, "fused_loss": True}) == checkpoint_model_config(ours)


@pytest.mark.slow
def test_a_checkpoints_recorded_fields_of_any_content_are_read_as_one_line_or_used(data_dir, tmp_path, capsys):
    """A checkpoint whose recorded fields (iteration, best val loss, settings, model_args, run id, tokenizer, RNG,
    world size, wall time...) hold any JSON value, edited by hand or written by another program: what a resume reads
    (its decision, its settings, the model, the optimizer's state, the RNG) and what sample.py reads either use it or
    say in one line what is wrong; never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from helpers import json_values
    from nanogpt import checkpoints, dataio, start
    from nanogpt.distributed import Dist
    from nanogpt.metrics import Logger
    from nanogpt.optim import build_optimizer

    out = tmp_path / "out"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    fields = ["iter_num", "best_val_loss", "config", "model_args", "run_id", "meta", "rng", "world_size", "elapsed_s",
              "best_file", "scaler", "optimizer", "model"]
    tensors = st.builds(  # a tensor where a number or setting goes, or of another size or type where one goes
        lambda n, dtype: torch.zeros(n, dtype=dtype), st.sampled_from([0, 1, 3, 5056]),
        st.sampled_from([torch.uint8, torch.float32, torch.int64, torch.complex64, torch.bool]))
    values = json_values() | tensors
    nested = st.sampled_from(["config", "model_args", "meta", "rng", "model"]).flatmap(  # one entry of a dict
        lambda field: st.sampled_from(sorted(saved[field])).flatmap(
            lambda key: values.map(lambda value: (field, {**saved[field], key: value}))))
    foreign_key = st.sampled_from(["config", "model"]).map(lambda field: (field, {**saved[field], 3: 1.0}))
    edits = (st.sampled_from(fields).flatmap(lambda field: values.map(lambda value: (field, value))) | nested
             | foreign_key)

    def reads() -> None:
        cfg = tiny_config(data_dir, out, init_from="resume", max_iters=4)
        plan = start.decide(cfg, given=set())
        dist = Dist()
        resumed = start.read_resumed(plan, dist, Logger(dist, str(out)))
        model = start.load_model(plan.cfg, plan.machine, dataio.find_meta(str(data_dir)), resumed.ckpt)
        optimizer = build_optimizer(model, plan.cfg, "cpu", verbose=False)
        checkpoints.load_training_state(model, optimizer, resumed.ckpt)
        checkpoint_file.restore_rng(resumed.ckpt, plan.cfg.seed, dist, resumed.iter_num)
        checkpoints.load_for_inference("resume", str(out), None, "cpu", "float32", {}, log=lambda line: None)

    reads()  # the checkpoint as written reads whole

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(edits)
    def edited(edit):
        field, value = edit
        torch.save({**saved, field: value}, out / "ckpt.pt")
        try:
            reads()
        except UserError as e:
            assert "\n" not in str(e), str(e)
        capsys.readouterr()

    edited()
    for field, value in [  # the review's (each a traceback, a hang or a run that never saved its best again)
        ("best_val_loss", float("nan")), ("best_val_loss", torch.tensor([1 + 2j])),
        ("rng", {**saved["rng"], "torch": torch.zeros(3, dtype=torch.uint8)}),
        ("config", {**saved["config"], "learning_rate": torch.tensor(1e-3)}),
        ("model", {**saved["model"], "transformer.wte.weight": 3}),
        ("model_args", {**saved["model_args"], "vocab_size": 10**12}),
        ("model_args", {**saved["model_args"], "n_layer": 10**9}),
    ]:
        torch.save({**saved, field: value}, out / "ckpt.pt")
        with pytest.raises(UserError, match=f"checkpoint {out / 'ckpt.pt'} is damaged: .*{field}"):
            reads()
