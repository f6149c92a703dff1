"""Nothing lost: signals, non-finite losses, bad files, changed resumes (a checkpoint file's write under a kill or a
full disk: tests/test_checkpoint_file.py)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanogpt import checkpoints
from nanogpt import errors, signals
from nanogpt import outdir
from nanogpt.errors import UserError
from nanogpt.checkpoint_file import load_checkpoint, save_checkpoint
from helpers import (
    HANG_S,
    ROOT,
    config_args,
    make_char_dataset,
    run_in_process,
    run_script,
    steps_with_loss_scales,
    tiny_config,
)
from model import GPT
import train as train_module
from nanogpt.step import NonFiniteError
from train import train
from nanogpt.step import batch_generator, get_batch


def start(args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def signal_during_step(monkeypatch, sig: int, step: int) -> None:
    """This process gets `sig` during its `step`-th training step (tests/signal_at_step.py's hook, undone after)."""
    import signal_at_step
    import train as train_module

    monkeypatch.setattr(train_module, "train_step", train_module.train_step)  # restored by monkeypatch
    signal_at_step.signal_during_step(sig, step)


RUN = dict(max_iters=60, lr_decay_iters=60, eval_interval=1000, log_interval=1, dropout=0.1)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_reaches_the_uninterrupted_loss(data_dir, tmp_path, monkeypatch):
    reference = train(tiny_config(data_dir, tmp_path / "ref", **RUN))
    signal_during_step(monkeypatch, signal.SIGTERM, step=6)  # in this process, during iter 5 -> 6
    with pytest.raises(SystemExit) as stop:
        train(tiny_config(data_dir, tmp_path / "run", **RUN))
    stopped_at = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter_num"]
    assert stopped_at == 6  # the step that was running when the signal came completes, then the run stops
    assert str(stop.value) == ("stopped by SIGTERM after iter 6; checkpoint saved: resume with "
                               f"python train.py --init_from=resume --out_dir={tmp_path / 'run'}")
    assert stop.value.code == 143  # 128 + SIGTERM: a clean stop, not a failure (1)
    monkeypatch.undo()
    resumed = train(tiny_config(data_dir, tmp_path / "run", **RUN, init_from="resume"))
    assert resumed["iter_num"] == 60
    assert resumed["last_loss"] == pytest.approx(reference["last_loss"], abs=1e-5)
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)


def test_a_stop_between_evals_keeps_the_best_checkpoint_and_its_resume_the_best_val_loss(data_dir, tmp_path,
                                                                                        monkeypatch, capsys):
    # always_save_checkpoint=False: ckpt.pt holds the best val loss's weights, until a stop must save the latest
    signal_during_step(monkeypatch, signal.SIGTERM, step=8)  # evals at 0 and 5, the stop at 8
    run = {**RUN, "eval_interval": 5, "always_save_checkpoint": False}
    with pytest.raises(SystemExit):
        train(tiny_config(data_dir, tmp_path / "run", **run))
    latest = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    best = load_checkpoint(str(tmp_path / "run" / "ckpt_best.pt"))
    evals = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 5]
    assert best["iter_num"] == 5 and best["best_val_loss"] == pytest.approx(evals[1]["val_loss"])  # 0's: not saved
    assert latest["iter_num"] == 8 and latest["best_val_loss"] == best["best_val_loss"]
    assert "the best val loss's weights stay in ckpt_best.pt" in capsys.readouterr().out
    # sample.py can use either
    from sample import SampleConfig, load_model

    model, _ = load_model(SampleConfig(out_dir=str(tmp_path / "run"), ckpt="ckpt_best.pt", device="cpu"))
    assert torch.equal(model.transformer.wte.weight, best["model"]["transformer.wte.weight"])
    # resumed with a learning rate that makes the eval at 10 worse than 5's: the best weights and loss stay 5's
    monkeypatch.undo()
    result = train(tiny_config(data_dir, tmp_path / "run", **{**run, "max_iters": 10}, learning_rate=1.0,
                               init_from="resume"))
    evals = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 5, 10] and evals[2]["val_loss"] > evals[1]["val_loss"] + 0.5
    assert load_checkpoint(str(tmp_path / "run" / "ckpt_best.pt"))["iter_num"] == 5
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["best_val_loss"] == best["best_val_loss"] == \
        pytest.approx(result["best_val_loss"])


@pytest.mark.slow
def test_sigterm_under_torchrun_stops_every_rank_at_the_same_step(data_dir, tmp_path):
    # dropout off: each rank has its own dropout RNG, which one process with 2 micro-steps cannot replay
    run = {**RUN, "gradient_accumulation_steps": 2, "dropout": 0.0}
    reference = train(tiny_config(data_dir, tmp_path / "ref", **run))
    cfg = tiny_config(data_dir, tmp_path / "run", **run)
    # the signal reaches rank 1 only, during its 6th step, as when one node is preempted first
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/signal_at_step.py",
                    "SIGTERM", "6", "1", *config_args(cfg)], timeout=HANG_S)
    assert r.returncode != 0
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter_num"] == 6, r.stderr[-2000:]
    assert "stopped by SIGTERM after iter 6; checkpoint saved" in r.stderr  # rank 1's own message
    assert "stopped by a signal on another rank after iter 6; checkpoint saved" in r.stderr  # rank 0's
    # resume in one process with 2 micro-steps: the same data stream, so the same end
    resumed = train(tiny_config(data_dir, tmp_path / "run", **run, init_from="resume"))
    assert resumed["last_loss"] == pytest.approx(reference["last_loss"], abs=1e-5)


def test_injected_nan_stops_with_the_iteration_and_leaves_parameters_untouched(data_dir, tmp_path, monkeypatch):
    bad_iter = 7
    clean = train(tiny_config(data_dir, tmp_path / "clean", max_iters=bad_iter, lr_decay_iters=20, eval_interval=1000))
    calls = {"n": 0, "model": None}
    forward = GPT.forward

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if self.training:
            calls["n"] += 1
            calls["model"] = self
            if calls["n"] == bad_iter + 1:  # the step of iteration `bad_iter` (1 micro-step per iteration)
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    # named as the log counts steps: the step of 0-based iteration 7 is logged as iter 8
    with pytest.raises(NonFiniteError, match=rf"non-finite loss at iter {bad_iter + 1} .*the step was not applied"):
        train(tiny_config(data_dir, tmp_path / "nan", max_iters=20, lr_decay_iters=20, eval_interval=1000))
    untouched = calls["model"].state_dict()
    reference = clean["model"].state_dict()
    assert all(torch.equal(untouched[k], reference[k]) for k in reference)
    assert not os.path.exists(tmp_path / "nan" / "ckpt.pt")  # nothing worse than what was on disk


@pytest.mark.parametrize("eval_interval", [1000, 2])  # no save before the NaN step; saves at iters 2 and 4
def test_a_nonfinite_stop_says_which_checkpoint_is_intact_or_that_none_was_saved(data_dir, tmp_path, monkeypatch,
                                                                                 eval_interval):
    """Bug: a non-finite loss before the first save said "the last checkpoint is intact" when there was none."""
    forward, calls = GPT.forward, {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if self.training:
            calls["n"] += 1
            loss = loss * float("nan") if calls["n"] == 6 else loss  # the 6th step: iters 0-4 saved at evals
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    with pytest.raises(NonFiniteError) as e:
        train(tiny_config(data_dir, tmp_path / "out", max_iters=10, eval_interval=eval_interval))
    path = tmp_path / "out" / "ckpt.pt"
    kept = f"ckpt.pt at iter {load_checkpoint(str(path))['iter_num']} is intact" if path.exists() else \
        "no checkpoint was saved yet"
    assert "non-finite loss at iter 6 " in str(e.value) and f"the step was not applied, and {kept}: " in str(e.value)
    assert path.exists() == (eval_interval == 2)  # both cases happened


def test_nonfinite_steps_can_be_skipped_up_to_a_limit(data_dir, tmp_path, monkeypatch):
    forward = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if self.training:
            calls["n"] += 1
            if calls["n"] in (3, 5):
                loss = loss * float("inf")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    result = train(tiny_config(data_dir, tmp_path / "out", max_iters=8, max_nonfinite_skips=2))
    assert result["iter_num"] == 8 and np.isfinite(result["val_loss"])
    calls["n"] = 0
    with pytest.raises(NonFiniteError, match="non-finite loss at iter 5"):  # the log's count: its 5th step
        train(tiny_config(data_dir, tmp_path / "out2", max_iters=8, max_nonfinite_skips=1))


# ------------------------------------------------------------------------------------------- bad files


def _error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_truncated_checkpoint_is_a_clear_error(data_dir, tmp_path, capsys):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    path = tmp_path / "out" / "ckpt.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    line = _error_line(run_in_process(["train.py", *config_args(cfg), "--init_from=resume"], capsys))
    assert f"checkpoint {path} is truncated or corrupt" in line and line.endswith(ANOTHER_CHECKPOINT)
    path.write_bytes(b"garbage")
    line = _error_line(run_in_process(["train.py", *config_args(cfg), "--init_from=resume"], capsys))
    assert "is truncated or corrupt" in line


ANOTHER_CHECKPOINT = ("restore it from a backup, or read another checkpoint of the run (keep_last's ckpt_0000300.pt, "
                      "ckpt_best.pt)")


def test_a_damaged_checkpoint_gives_each_reader_a_fix_it_has_and_the_whole_cause(data_dir, tmp_path, capsys):
    """Bug: sample.py, export.py and hellaswag.py advised --init_from=scratch (which they refuse), and quoted torch's
    error cut mid-sentence at 200 characters. The fix is one each has; the cause is torch's first line or sentence,
    whole, or cut at a word and marked so."""
    train(tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2))
    path = tmp_path / "out" / "ckpt.pt"
    data = path.read_bytes()
    examples = tmp_path / "hs.jsonl"
    examples.write_text(json.dumps({"ctx": "The king", "endings": ["speaks", "hath", "to", "and"], "label": 0}) + "\n")
    for damaged in (data[: len(data) // 2], b"garbage"):  # cut short; bytes that are not a checkpoint
        path.write_bytes(damaged)
        with pytest.raises(Exception) as torch_says:  # what torch itself says of the file
            torch.load(str(path), weights_only=True, mmap=True)
        first_line = str(torch_says.value).strip().splitlines()[0]
        for args in (["sample.py", f"--out_dir={path.parent}", "--device=cpu"],
                     ["export.py", f"--out_dir={path.parent}", f"--to={tmp_path / 'hf'}"],
                     ["hellaswag.py", f"--out_dir={path.parent}", f"--path={examples}", "--device=cpu"]):
            line = _error_line(run_in_process(args, capsys))
            m = re.fullmatch(rf"error: checkpoint {re.escape(str(path))} is truncated or corrupt \({type(torch_says.value).__name__}: "
                             rf"(.+)\): {re.escape(ANOTHER_CHECKPOINT)}", line)
            assert m, (args, line)
            quoted = m[1]
            assert (quoted == first_line or first_line.startswith(quoted + ". ")
                    or quoted.endswith(" ...") and first_line.startswith(quoted[:-4] + " ")), (args, quoted)


@pytest.mark.slow
@pytest.mark.parametrize("field", ["optimizer", "iter_num", "best_val_loss"])
def test_a_stripped_checkpoint_is_one_line_naming_the_field_and_its_weights_still_sample(data_dir, tmp_path, field,
                                                                                         capsys):
    """People strip checkpoints to save space: a resume (init_from=resume, or auto) of one without what a resume
    continues says which field is missing and how to start from its weights; the weights-only readers read it."""
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    path = tmp_path / "out" / "ckpt.pt"
    ckpt = load_checkpoint(str(path))
    del ckpt[field]
    save_checkpoint(str(path), ckpt)
    for init_from in ("resume", "auto"):
        line = _error_line(run_in_process(["train.py", *config_args(cfg), f"--init_from={init_from}"], capsys))
        assert line == (f"error: checkpoint {path} has no {field}, so a resume cannot continue it: start a new run "
                        f"from its weights with --init_from={path}")
    save_checkpoint(str(path), {k: ckpt[k] for k in ("model", "model_args")})
    assert run_in_process(["export.py", f"--out_dir={path.parent}", f"--to={tmp_path / 'hf'}"], capsys).returncode == 0
    save_checkpoint(str(path), {k: ckpt[k] for k in ("model", "model_args", "meta")})  # its characters, to decode
    assert run_in_process(["sample.py", f"--out_dir={path.parent}", "--num_samples=1", "--max_new_tokens=4",
                           "--device=cpu"], capsys).returncode == 0


def test_a_checkpoint_with_non_finite_weights_is_one_line_for_each_reader(data_dir, tmp_path, capsys):
    """Bug: sample.py crashed inside torch.multinomial, hellaswag.py reported figures without a warning, a resume
    trained and then blamed the learning rate. Each reader now names the file, the count and the tensor."""
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    path = tmp_path / "out" / "ckpt.pt"
    ckpt = load_checkpoint(str(path))
    ckpt["model"]["transformer.h.1.mlp.c_fc.weight"][0, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])
    save_checkpoint(str(path), ckpt)
    examples = tmp_path / "hs.jsonl"
    examples.write_text(json.dumps({"ctx": "The king", "endings": ["speaks", "hath", "to", "and"], "label": 0}) + "\n")
    want = f"error: checkpoint {path} has 3 non-finite weights in transformer.h.1.mlp.c_fc.weight: {ANOTHER_CHECKPOINT}"
    for args in (["sample.py", f"--out_dir={path.parent}", "--device=cpu", "--num_samples=1", "--max_new_tokens=4"],
                 ["hellaswag.py", f"--out_dir={path.parent}", f"--path={examples}", "--device=cpu"],
                 ["train.py", *config_args(cfg), "--init_from=resume", "--max_iters=4"]):
        assert _error_line(run_in_process(args, capsys)) == want, args


def test_resume_with_another_model_shape_is_refused_and_names_the_keys(data_dir, tmp_path, capsys):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    line = _error_line(run_in_process(["train.py", *config_args(cfg), "--init_from=resume", "--n_embd=64"], capsys))
    assert "cannot resume: the checkpoint's model differs (n_embd: 32 -> 64)" in line
    line = _error_line(run_in_process(["train.py", *config_args(cfg), "--init_from=resume", "--gelu=tanh"], capsys))
    assert "cannot resume: the checkpoint's model differs (gelu: 'erf' -> 'tanh')" in line


def test_resume_compares_the_gelu_with_the_checkpoint_model_even_an_old_one(data_dir, tmp_path):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2, gelu="erf")
    train(cfg)
    path = str(tmp_path / "out" / "ckpt.pt")
    resumed = dataclasses.replace(cfg, init_from="resume", max_iters=3, gelu=None)  # None: the checkpoint's
    assert train(resumed)["model"].config.gelu == "erf"
    old = load_checkpoint(path)  # as written before the gelu setting: no gelu in model_args or config
    del old["model_args"]["gelu"], old["config"]["gelu"]
    save_checkpoint(path, old)
    with pytest.raises(UserError, match=r"model differs \(gelu: 'tanh' -> 'erf'\)"):  # this repo's old ones: tanh
        train(dataclasses.replace(resumed, gelu="erf"))
    assert train(dataclasses.replace(resumed, max_iters=4))["model"].config.gelu == "tanh"


def test_checkpoint_whose_weights_do_not_fit_names_the_keys(data_dir, tmp_path, capsys):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    path = str(tmp_path / "out" / "ckpt.pt")
    ckpt = load_checkpoint(path)
    ckpt["model"]["transformer.h.0.attn.c_proj.weight"] = torch.zeros(7, 32)
    save_checkpoint(path, ckpt)
    line = _error_line(run_in_process(["train.py", *config_args(cfg), "--init_from=resume"], capsys))
    assert "does not fit the model: shapes differ" in line
    assert "transformer.h.0.attn.c_proj.weight (7, 32) vs (32, 32)" in line
    ckpt["model"]["transformer.wpe.weight"] = torch.zeros(7, 32)  # a shape model_args state: named before any build
    save_checkpoint(path, ckpt)
    line = _error_line(run_in_process(["train.py", *config_args(cfg), "--init_from=resume"], capsys))
    assert "its model_args do not match its weights: block_size=32 (its weights have 7)" in line


@pytest.mark.slow
def test_resume_with_changed_settings_lists_them(data_dir, tmp_path):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    r = run_script(["train.py", *config_args(cfg), "--init_from=resume", "--max_iters=4", "--batch_size=8",
                    "--learning_rate=0.001"])
    assert r.returncode == 0, r.stderr[-2000:]
    changes = [l for l in r.stdout.splitlines() if l.startswith("resuming with a changed setting")]
    assert changes == [
        "resuming with a changed setting (it applies from here on): batch_size: 4 -> 8",
        "resuming with a changed setting (it applies from here on): learning_rate: 0.003 -> 0.001",
        "resuming with a changed setting (it applies from here on): max_iters: 2 -> 4",
    ]
    assert f"resuming from {tmp_path / 'out' / 'ckpt.pt'} at iter 2" in r.stdout
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 4


CHANGED_OPTIMIZER = {
    "adamw": dict(weight_decay=0.5, beta1=0.8, beta2=0.9),
    "muon": dict(weight_decay=0.5, beta1=0.8, beta2=0.9, muon_weight_decay=0.3, muon_momentum=0.8),
}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_changed_optimizer_settings_apply_after_a_resume(data_dir, tmp_path, monkeypatch, optimizer):
    """Bug: the changes were announced, then load_state_dict restored the checkpoint's param_groups, so only the
    learning rate took effect. The groups after the resume hold the new values, the moments are the checkpoint's,
    and the weights differ from a resume with the old settings."""

    run = dict(max_iters=2, eval_interval=2, optimizer=optimizer, dropout=0.0)
    train(tiny_config(data_dir, tmp_path / "out", **run))
    seen = []
    real = checkpoints.load_training_state

    def spy(model, optim, ckpt):
        real(model, optim, ckpt)
        seen.append([{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups])
        seen.append({id(p): s for opt in optim.optimizers.values() for p, s in opt.state.items()})

    monkeypatch.setattr(checkpoints, "load_training_state", spy)
    changed = CHANGED_OPTIMIZER[optimizer]
    out = {}
    for name, changes in (("same", {}), ("changed", changed)):
        shutil.copytree(tmp_path / "out", tmp_path / name)
        out[name] = train(tiny_config(data_dir, tmp_path / name, **{**run, "max_iters": 3}, **changes,
                                      init_from="resume"))
    groups, state = seen[2], seen[3]
    decayed = [g for g in groups if "betas" in g and g["weight_decay"] != 0.0]
    assert decayed and all(g["weight_decay"] == 0.5 and g["betas"] == (0.8, 0.9) for g in decayed)
    assert all(g["betas"] == (0.8, 0.9) for g in groups if "betas" in g)  # the undecayed AdamW group too
    if optimizer == "muon":
        muon = [g for g in groups if "betas" not in g]
        assert muon and all(g["weight_decay"] == 0.3 and g["momentum"] == 0.8 for g in muon)
    assert state and all(s for s in state.values())  # the checkpoint's moments were restored, not a fresh optimizer
    same, other = out["same"]["model"].state_dict(), out["changed"]["model"].state_dict()
    assert any(not torch.equal(same[k], other[k]) for k in same)


@pytest.mark.parametrize("case", ["ids_beyond_vocab", "odd_size", "block_too_large", "one_token", "missing_meta"])
def test_bad_data_files_are_clear_errors(tmp_path, case, capsys):
    d = tmp_path / "mydata"
    meta = make_char_dataset(d, n_chars=5000)
    cfg = tiny_config(d, tmp_path / "out")
    args = ["train.py", *config_args(cfg)]
    if case == "ids_beyond_vocab":
        ids = np.fromfile(d / "val.bin", dtype=np.uint16)
        ids[10] = 999
        ids.tofile(d / "val.bin")
        expected = f"{d / 'val.bin'} holds token id 999 but the vocab size is {meta['vocab_size']}"
    elif case == "odd_size":
        with open(d / "train.bin", "ab") as f:
            f.write(b"\x01")
        expected = "not a whole number of uint16 tokens"
    elif case == "block_too_large":
        args.append("--block_size=600")  # val.bin has 500 tokens
        expected = (f"the val split ({d / 'val.bin'}) has 500 tokens, too few for block_size=600 (a window is "
                    f"block_size + 1 tokens): use --block_size=499 or smaller, or more data")
    elif case == "one_token":  # a tiny input's split: no block_size makes a window of it (it said --block_size=0)
        (d / "val.bin").write_bytes(np.array([3], dtype=np.uint16).tobytes())
        expected = (f"the val split ({d / 'val.bin'}) has 1 token, too few for any window (a window is block_size + 1 "
                    f"tokens, block_size at least 1): prepare the dataset from more text")
    else:
        os.remove(d / "meta.json")
        expected = (f"no meta.json in {d}: a dataset folder holds train.bin and val.bin (uint16 token ids) and "
                    "meta.json (see the README's \"Your own data\") or nanoGPT's meta.pkl; for GPT-2 BPE tokens (nanoGPT's "
                    'openwebtext) write meta.json as {"vocab_size": 50257, "tokenizer": "gpt2"}')  # no such script
    assert expected in _error_line(run_in_process(args, capsys))
    assert not (tmp_path / "out").exists()  # checked before out_dir is made


def test_ids_beyond_a_checkpoints_vocabulary_are_refused_on_resume(tmp_path, capsys):
    """Resumed weights bring their own vocabulary: the ids are checked against it once the checkpoint is read."""
    d = tmp_path / "mydata"
    meta = make_char_dataset(d, n_chars=5000)
    cfg = tiny_config(d, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    ids = np.fromfile(d / "train.bin", dtype=np.uint16)
    ids[3] = 999
    ids.tofile(d / "train.bin")
    r = run_in_process(["train.py", *config_args(dataclasses.replace(cfg, init_from="resume", max_iters=4))], capsys)
    assert f"{d / 'train.bin'} holds token id 999 but the vocab size is {meta['vocab_size']}" in _error_line(r)
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 2  # nothing saved over


def test_a_start_refused_for_its_data_leaves_the_folder_of_an_earlier_run_as_it_was(tmp_path, capsys):
    """A new run in a folder that holds a run moves it aside; a start that fails on its data must not (nor make an
    out_dir that was not there)."""
    d = tmp_path / "mydata"
    make_char_dataset(d, n_chars=5000)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"iter": 1, "loss": 4.0}\n')
    outdir.begin_run(str(out))  # a run's folder: its run.json
    os.remove(d / "meta.json")
    assert "no meta.json" in _error_line(run_in_process(["train.py", *config_args(tiny_config(d, out))], capsys))
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "run.json"]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 400), block=st.integers(1, 64), batch=st.integers(1, 8), seed=st.integers(0, 2**31),
       step=st.integers(0, 10**6), index=st.integers(0, 64))
def test_get_batch_windows_stay_inside_the_data(tmp_path_factory, n, block, batch, seed, step, index):
    path = tmp_path_factory.mktemp("b") / "train.bin"
    data = np.arange(n, dtype=np.uint16)  # token == position, so a window's first token is its offset
    data.tofile(path)
    if n <= block:
        with pytest.raises(UserError, match=f"has {n} tokens, too few for block_size={block}"):
            get_batch(str(path), batch, block, batch_generator(seed, "train", step, index))
        return
    x, y = get_batch(str(path), batch, block, batch_generator(seed, "train", step, index))
    assert x.shape == y.shape == (batch, block)
    start = x[:, 0]
    assert (start >= 0).all() and (start + block <= n - 1).all()  # y's last token exists
    assert torch.equal(x, start[:, None] + torch.arange(block)) and torch.equal(y, x + 1)


def _step_with(loss_scale: float, scaler_enabled: bool, optimizer: str = "adamw"):
    """One train_step of a tiny model whose loss is multiplied by loss_scale (inf, nan or 1)."""
    [(loss, norm, applied, unchanged)], scaler = _steps_with([loss_scale], scaler_enabled, optimizer)
    return loss, norm, applied, unchanged, scaler


def _steps_with(loss_scales: list[float], scaler_enabled: bool, optimizer: str = "adamw"):
    """train_steps of one tiny model, optimizer and scaler, the i-th with its loss multiplied by loss_scales[i].
    Returns [(loss, norm, applied, parameters unchanged by the step)] per step, and the scaler."""
    from nanogpt.distributed import Dist
    from model import GPTConfig
    from nanogpt.optim import build_optimizer
    from nanogpt.config import TrainConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=16))
    opt = build_optimizer(model, TrainConfig(optimizer=optimizer, learning_rate=1e-2), "cpu", verbose=False)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled, init_scale=1024.0)
    x = torch.randint(0, 20, (2, 8))
    steps = steps_with_loss_scales(model, opt, scaler, x, torch.autocast("cpu", enabled=False), Dist(), loss_scales)
    return steps, scaler


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_grad_scaler_skips_overflowing_steps_and_halves_its_scale(optimizer):
    # float16's scaler (enabled on the CPU to exercise the same order: scale, backward, unscale, clip, step, update)
    loss, norm, applied, unchanged, scaler = _step_with(1.0, scaler_enabled=True, optimizer=optimizer)
    assert applied and not unchanged and scaler.get_scale() == 1024.0
    # a loss that is finite but whose gradients overflow: skipped by the scaler, which lowers its scale
    loss, norm, applied, unchanged, scaler = _step_with(1e36, scaler_enabled=True, optimizer=optimizer)
    assert np.isfinite(loss) and not np.isfinite(norm)
    assert not applied and unchanged and scaler.get_scale() == 512.0


def test_float16_scaler_steps_on_after_a_skipped_nonfinite_loss():
    # max_nonfinite_skips > 0 with float16: a NaN loss skips the step after unscale_, and the next step must run
    # (it raised "unscale_() has already been called on this optimizer since the last update()")
    steps, scaler = _steps_with([float("nan"), 1.0, 1.0], scaler_enabled=True)
    assert [applied for _, _, applied, _ in steps] == [False, True, True]
    assert steps[0][3] and not steps[1][3]  # the NaN step left the weights alone, the next one trained them
    assert scaler.get_scale() == 512.0  # the NaN step's gradients were not finite: the scale halved once


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_nan_loss_is_never_applied_with_or_without_the_scaler(optimizer):
    for enabled in (False, True):
        loss, norm, applied, unchanged, _ = _step_with(float("nan"), scaler_enabled=enabled, optimizer=optimizer)
        assert np.isnan(loss) and not applied and unchanged


def test_a_second_ctrl_c_exits_at_once_and_a_forwarded_duplicate_does_not(monkeypatch):
    """StopRequest's rule, on a clock the test sets: a SIGINT within 1 s of the first is the same Ctrl-C (torchrun
    forwards the terminal's to workers that already got it); a later one exits at once; SIGTERMs never do."""
    now = {"t": 100.0}
    monkeypatch.setattr(signals.time, "monotonic", lambda: now["t"])
    with signals.StopRequest() as stop:
        stop.arm()  # the start accepted: signals ask for a stop with a checkpoint
        assert not stop.requested()
        stop._handle(signal.SIGINT, None)
        now["t"] += 0.1
        stop._handle(signal.SIGINT, None)  # the forwarded duplicate: still one graceful stop
        assert stop.requested() and stop.signal == signal.SIGINT
        now["t"] += 1.4
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C: exiting without a checkpoint"):
            stop._handle(signal.SIGINT, None)
    with signals.StopRequest() as stop:
        stop.arm()
        stop._handle(signal.SIGTERM, None)
        now["t"] += 5
        stop._handle(signal.SIGTERM, None)  # a scheduler repeating itself: never an exit without a checkpoint
        assert stop.signal == signal.SIGTERM


def test_train_py_exits_1_on_a_second_ctrl_c(monkeypatch, capsys):
    def interrupted(cfg, given=None):
        raise signals.SecondCtrlC("second Ctrl-C: exiting without a checkpoint")

    monkeypatch.setattr(train_module, "train", interrupted)
    with pytest.raises(SystemExit) as e:
        train_module.main(["--device=cpu"])
    assert e.value.code == 1  # no checkpoint: not a clean stop's 130
    assert capsys.readouterr().err.strip() == "interrupted: second Ctrl-C: exiting without a checkpoint"


CTRL_C_MID_SAVE = """
import os, signal, sys, types
sys.path[:0] = [{root!r}, {tests!r}]
import torch, signal_at_step, train
from nanogpt import signals
from nanogpt.errors import exit_on_user_error
signals.time = types.SimpleNamespace(monotonic=iter(range(0, 10**6, 10)).__next__)  # signals 10 s apart
real_save, saves = torch.save, []


class SecondCtrlCOnWrite:  # the stop's checkpoint: a second Ctrl-C in its third write, torch.save still writing
    def __init__(self, f):
        self.f, self.writes = f, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def save(obj, f, *args, **kwargs):
    saves.append(f)  # the first save (iter 2) is left alone
    return real_save(obj, f if len(saves) == 1 else SecondCtrlCOnWrite(f), *args, **kwargs)


torch.save = save
signal_at_step.signal_during_step(signal.SIGINT, 4)  # the first Ctrl-C: a stop with a checkpoint at iter 3
exit_on_user_error(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_second_ctrl_c_while_the_stops_checkpoint_is_written_is_one_line(data_dir, tmp_path):
    """Bug: a second Ctrl-C inside the stop's torch.save was a double traceback ending in torch's zip writer's
    "unexpected pos". It is the second Ctrl-C's one line and exit 1; the save at iter 2 stays, no temporary file."""
    script = tmp_path / "ctrl_c_mid_save.py"
    script.write_text(CTRL_C_MID_SAVE.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=20, eval_interval=2, log_interval=1)
    r = run_script([str(script), *config_args(cfg)])
    assert (r.returncode, r.stderr) == (1, "interrupted: second Ctrl-C: exiting without a checkpoint\n"), r.stderr
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["iter_num"] == 2
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp" in n]


def test_a_ctrl_c_before_the_runs_handlers_is_one_line_and_exit_130(data_dir, tmp_path, monkeypatch, capsys):
    """Bug: a Ctrl-C in train.py before StopRequest's handlers were in place (the settings' checks) was taken for a
    second Ctrl-C: `interrupted: Ctrl-C`, exit status 1. Nothing had started: 130, as any Ctrl-C, and one line."""
    from nanogpt import start

    def ctrl_c(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(start, "check_out_dir", ctrl_c)
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "out"))], capsys)
    assert (r.returncode, r.stderr) == (130, "interrupted (Ctrl-C)\n")
    assert not (tmp_path / "out").exists()


START_STOPPED = "stopped by SIGTERM during the start, before the first step: nothing was saved, and the run folder is as it was"


class SwallowedSignal:
    """A SIGTERM that arrives while a finalizer runs: the StopRequest's exception is raised there, and Python prints
    and drops it ("Exception ignored in"), as it does any exception of a __del__; the start goes on."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_whose_exception_was_swallowed_during_the_start_still_stops_it(data_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    """Bug: StopRequest.arm() set `armed` before it asked whether a signal had come, so it never did: a SIGTERM during
    the start whose exception something swallowed let the start be accepted, and the run saved a checkpoint at iter 0
    instead of leaving the folder as it was. And an error after such a signal (a module whose import the signal cut
    short, then used: numpy.linalg's RecursionError) was a traceback: the signal's doing, it stops the start too."""
    from nanogpt import start

    with signals.StopRequest() as stop:
        with pytest.raises(errors.Interrupted):
            stop._handle(signal.SIGTERM, None)  # the exception a caller then swallows
        with pytest.raises(errors.Interrupted, match="stopped by SIGTERM during the start"):
            stop.arm()
        assert not stop.armed

    load_model = start.load_model

    def swallowed(*args, **kwargs):
        SwallowedSignal()  # collected at once
        return load_model(*args, **kwargs)

    def swallowed_then_failed(*args, **kwargs):
        SwallowedSignal()
        raise RuntimeError("a module whose import the signal cut short")

    for name, load in (("swallowed", swallowed), ("failed", swallowed_then_failed)):
        out = tmp_path / name
        with monkeypatch.context() as m:
            m.setattr(start, "load_model", load)
            r = run_in_process(["train.py", *config_args(tiny_config(data_dir, out, max_iters=4))], capsys)
        assert r.returncode == 143, (name, r.stderr[-3000:])
        assert r.stderr.splitlines()[-1] == START_STOPPED, name
        assert not out.exists(), name  # a new folder, gone as it came


def test_a_sigterm_wrapped_by_pythons_set_name_still_stops_the_start_in_one_line(data_dir, tmp_path, monkeypatch,
                                                                                   capsys):
    """Bug: a SIGTERM while Python set a class body's names (a dataclass field in `import torch._dynamo` during the
    start) came out as `RuntimeError: Error calling __set_name__ ...` (Python 3.11 wraps what __set_name__ raises):
    a traceback and exit status 1. Now the start's one line, once, and 143."""
    from nanogpt import start

    load_model = start.load_model

    class SignalledWhenNamed:
        def __set_name__(self, owner, name):
            signal.raise_signal(signal.SIGTERM)  # runs the handler here, as a signal landing here would

    def signalled(*args, **kwargs):
        class Fields:  # noqa: F841
            field = SignalledWhenNamed()

        return load_model(*args, **kwargs)

    monkeypatch.setattr(start, "load_model", signalled)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # train.main itself, as a caller in Python runs it
        train_module.main(config_args(tiny_config(data_dir, tmp_path / "out", max_iters=4)))
    assert e.value.code == 143
    err = capsys.readouterr().err
    assert err.count(START_STOPPED) == 1 and err.splitlines()[-1] == START_STOPPED
    assert not (tmp_path / "out").exists()
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "out", max_iters=4))], capsys)
    assert r.returncode == 143 and r.stderr.count(START_STOPPED) == 1, r.stderr[-3000:]  # its __main__'s way too


def test_a_stop_during_an_eval_cuts_it_short_and_skips_it(data_dir, tmp_path, monkeypatch):
    """SIGINT during the first batch of the eval at iter 5 (50 batches per split): the run stops with a checkpoint
    at iter 5 after at most one more batch per split, and logs no eval for iter 5 (its figures would be partial).
    torchrun SIGKILLs a worker --shutdown-timeout seconds after the signal, so a stop must not wait for an eval."""
    forward, evals = GPT.forward, {"n": 0}

    def signalled(self, idx, targets=None, **kw):
        if not self.training:
            evals["n"] += 1
            if evals["n"] == 2 * 50 + 1:  # the first batch of the second eval (iter 5)
                os.kill(os.getpid(), signal.SIGINT)
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", signalled)
    cfg = tiny_config(data_dir, tmp_path / "run", max_iters=50, eval_interval=5, eval_iters=50, log_interval=1)
    with pytest.raises(SystemExit, match="stopped by SIGINT after iter 5; checkpoint saved"):
        train(cfg)
    assert evals["n"] == 2 * 50 + 1  # the signal's batch; the val split then stops before its first
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter_num"] == 5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records if "val_loss" in r] == [0]


@pytest.mark.slow
def test_a_stop_between_micro_steps_drops_the_step_and_resumes_bitwise(data_dir, tmp_path, monkeypatch):
    # SIGTERM during micro-step 2 of 4 of iteration 5: the run stops before micro-step 3 (not after the whole step:
    # under torchrun a big model's step may outlast the SIGKILL that follows), saving the state before iteration 5,
    # dropout RNG included, so the resumed run is bitwise the uninterrupted one
    run = dict(max_iters=10, lr_decay_iters=10, eval_interval=1000, gradient_accumulation_steps=4, dropout=0.1)
    reference = train(tiny_config(data_dir, tmp_path / "ref", **run))
    forward, calls = GPT.forward, {"n": 0}

    def signalled(self, idx, targets=None, **kw):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 4 * 5 + 2:
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, idx, targets, **kw)

    monkeypatch.setattr(GPT, "forward", signalled)
    with pytest.raises(SystemExit, match="stopped by SIGTERM after iter 5; checkpoint saved"):
        train(tiny_config(data_dir, tmp_path / "run", **run))
    assert calls["n"] == 4 * 5 + 2  # no micro-step after the signal's
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter_num"] == 5
    monkeypatch.undo()
    resumed = train(tiny_config(data_dir, tmp_path / "run", **run, init_from="resume"))
    assert resumed["iter_num"] == 10 and resumed["last_loss"] == reference["last_loss"]


SHARED_PROBE = """
import os, sys
sys.path.insert(0, {root!r})
from nanogpt.errors import UserError
from nanogpt.distributed import cleanup_distributed, setup_distributed
from nanogpt.distributed import check_shared_out_dir
d = setup_distributed("cpu")
for case in ("shared", "local"):
    # "local": each rank gets its own folder, as nodes whose out_dir is on a local disk
    out = os.path.join(sys.argv[1], case, "rank0" if case == "shared" or d.rank == 0 else f"rank{{d.rank}}")
    os.makedirs(out, exist_ok=True)
    try:
        check_shared_out_dir(out, d)
        line = f"{{case}} rank {{d.rank}}: ok"
    except UserError as e:
        line = f"{{case}} rank {{d.rank}}: error: {{e}}"
    os.write(1, (line + "\\n").encode())  # one write per line: both ranks share the pipe, print() may interleave
cleanup_distributed(d)
"""


@pytest.mark.slow
def test_an_out_dir_that_not_every_rank_sees_is_named_at_start(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SHARED_PROBE.format(root=ROOT))
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                    str(tmp_path / "out")], timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = sorted(line for line in r.stdout.splitlines() if line.startswith(("shared", "local")))
    assert lines[0].startswith("local rank 0: error: ") and lines[1].startswith("local rank 1: error: ")
    assert lines[2:] == ["shared rank 0: ok", "shared rank 1: ok"]
    for line in lines[:2]:  # every rank stops, with the same line naming the node and the rank that cannot see
        assert "is not shared:" in line and "(node rank 0): ranks 1 cannot see the files rank 0 writes" in line
    assert os.listdir(tmp_path / "out" / "shared" / "rank0") == []  # the marker is removed
