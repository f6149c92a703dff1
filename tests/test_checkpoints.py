"""checkpoints.py: a run's checkpoints in either format (ckpt.pt or FSDP's sharded folder). A resume reads the
newest by iteration whatever the format and says which it read; no checkpoint names what the folder holds; a stop
before the first step resumes exactly (DDP and FSDP, AdamW and Muon); saves in either format remove only the names
they write; a sharded folder is read wherever a file is (sample.py, export.py, init_from); weights of another
tokenizer are refused before any is read; reading the weights maps the file and never reads the optimizer state.
FSDP runs here are process groups of one (the 2-rank paths: tests/test_fsdp.py); one file's own tests:
tests/test_checkpoint_file.py; a sharded folder's: tests/test_checkpoint_sharded.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from nanogpt import checkpoint_file
from nanogpt import checkpoints, start
import export
import convert_sharded
import train as train_module
from nanogpt.errors import UserError
from helpers import ROOT, make_char_dataset, tiny_config
from sample import SampleConfig, load_model
from train import train

TOL = 1e-5  # FSDP vs one process, float32 (tests/test_fsdp.py)
RUN = dict(gradient_accumulation_steps=2, max_iters=8, lr_decay_iters=8, eval_interval=4, log_interval=1,
           dropout=0.0)


def metrics(out_dir, key: str) -> list[dict]:
    return [r for r in map(json.loads, open(out_dir / "metrics.jsonl")) if key in r]


def params_of(path: str) -> dict[str, torch.Tensor]:
    return checkpoints.read_weights(path)["model"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
def test_resume_reads_the_newest_checkpoint_by_iteration_whatever_the_format(data_dir, tmp_path, capsys):
    """Bug: FSDP always took the sharded folder and DDP the file, so a folder at iter 4 beside a ckpt.pt at iter 6
    restarted an FSDP run at 4, silently. Here: FSDP to 4, without FSDP to 6 (from the folder: the only
    checkpoint), FSDP to 8 (from ckpt.pt: newer); every resume says what it read, no iteration runs twice."""
    out = tmp_path / "run"
    reference = train(tiny_config(data_dir, tmp_path / "ref", **RUN))
    train(tiny_config(data_dir, out, **{**RUN, "max_iters": 4}, parallelism="fsdp"))
    capsys.readouterr()
    train(tiny_config(data_dir, out, **{**RUN, "max_iters": 6}, init_from="resume"))
    assert f"resuming from {out / 'ckpt_sharded'} at iter 4\n" in capsys.readouterr().out
    resumed = train(tiny_config(data_dir, out, **RUN, parallelism="fsdp", init_from="resume"))
    resumed_line = f"resuming from {out / 'ckpt.pt'} at iter 6 (ckpt_sharded is at iter 4, older)\n"
    assert resumed_line in capsys.readouterr().out
    assert [r["iter"] for r in metrics(out, "loss")] == list(range(1, 9))
    assert resumed["last_loss"] == pytest.approx(reference["last_loss"], abs=TOL)
    assert max_diff(reference["model"].state_dict(), params_of(str(out / "ckpt_sharded"))) < TOL
    # sample.py and export.py read the newest too, and say which iteration
    model, _ = load_model(SampleConfig(out_dir=str(out), device="cpu", dtype="float32"))
    assert f"checkpoint: {out / 'ckpt_sharded'} at iter 8\n" in capsys.readouterr().err
    # at the same iteration (a converted folder) an FSDP run reads the folder, any other the file, and says so
    convert_sharded.main([str(out / "ckpt_sharded")])
    fsdp = checkpoints.find_checkpoint(str(out), prefer_sharded=True)
    assert fsdp.describe("resuming from") == (f"resuming from {out / 'ckpt_sharded'} at iter 8 (ckpt.pt is at the "
                                              f"same iteration: an FSDP run reads the sharded one)")
    assert checkpoints.find_checkpoint(str(out)).path == str(out / "ckpt.pt")


def test_no_checkpoint_names_what_the_folder_holds(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError) as e:
        checkpoints.find_checkpoint(str(tmp_path / "run"))
    assert str(e.value) == (f"no checkpoint in {tmp_path / 'run'} (neither ckpt.pt nor ckpt_sharded; "
                            f"{tmp_path / 'run'} holds metrics.jsonl): train first, or set --out_dir to the run's folder")


def stop_at(monkeypatch, stage: str) -> None:
    """SIGTERM to this process at `stage` of the first iteration: during the iter-0 eval, or between the two
    micro-steps of the first step (which is then dropped): the save happens before any optimizer step."""
    if stage == "iter-0 eval":
        real = train_module.estimate_loss

        def eval_then_signal(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # the StopRequest handler sets its flag
            return real(*args, **kwargs)

        monkeypatch.setattr(train_module, "estimate_loss", eval_then_signal)
    else:
        real_step = train_module.train_step

        def step_then_signal(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return real_step(*args, **kwargs)

        monkeypatch.setattr(train_module, "train_step", step_then_signal)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism, optimizer", [("fsdp", "adamw"), ("ddp", "adamw"), ("ddp", "muon")])
@pytest.mark.parametrize("stage", ["iter-0 eval", "first step"])
def test_a_stop_before_the_first_step_resumes_exactly(data_dir, tmp_path, monkeypatch, parallelism, optimizer,
                                                      stage):
    """Bug (FSDP): DCP's get_state_dict filled the empty AdamW state with a zero-gradient step, saving step=1, so
    the resumed run's losses differed (4.1692 vs 4.1627)."""
    run = {**RUN, "parallelism": parallelism, "optimizer": optimizer, "eval_interval": 1000}
    reference = train(tiny_config(data_dir, tmp_path / "ref", **run))
    with monkeypatch.context() as m:
        stop_at(m, stage)
        with pytest.raises(SystemExit, match="stopped by SIGTERM after iter 0; checkpoint saved"):
            train(tiny_config(data_dir, tmp_path / "run", **run))
    found = checkpoints.find_checkpoint(str(tmp_path / "run"))
    assert found.iter_num == 0 and found.name == ("ckpt_sharded" if parallelism == "fsdp" else "ckpt.pt")
    resumed = train(tiny_config(data_dir, tmp_path / "run", **run, init_from="resume"))
    assert resumed["last_loss"] == reference["last_loss"]
    saved = [params_of(checkpoints.find_checkpoint(str(tmp_path / name)).path) for name in ("ref", "run")]
    assert max_diff(*saved) == 0.0  # from the saves: a sharded run returns no model (its group is gone)


@pytest.mark.slow
def test_saves_remove_only_the_names_they_write(data_dir, tmp_path):
    """Bug: every sharded save deleted any out_dir entry starting with ckpt_sharded_, a user's backup too."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt_sharded_keep_iter5").mkdir()
    (out / "ckpt_sharded_keep_iter5" / "notes.txt").write_text("mine")
    (out / "ckpt_sharded_notes.txt").write_text("mine")
    (out / "ckpt_5.pt").write_text("mine")  # keep_last writes 7-digit names only
    (out / "ckpt_sharded_0000002_0").mkdir()  # as a killed save leaves it: removed by the next save
    train(tiny_config(data_dir, out, max_iters=4, eval_interval=2, parallelism="fsdp"))
    train(tiny_config(data_dir, out, max_iters=6, eval_interval=2, init_from="resume", keep_last=1))
    assert sorted(os.listdir(out)) == ["ckpt.pt", "ckpt_0000006.pt", "ckpt_5.pt", "ckpt_sharded",
                                       "ckpt_sharded_0000004_0", "ckpt_sharded_keep_iter5", "ckpt_sharded_notes.txt",
                                       "metrics.jsonl", "previous", "run.json"]
    # the killed save's folder is a run's file: the new run moved it aside with the rest, the user's files stayed
    assert [p.name for p in (out / "previous").glob("*/*")] == ["ckpt_sharded_0000002_0"]
    assert (out / "ckpt_sharded_keep_iter5" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_sharded_folder_is_read_wherever_a_file_is(data_dir, tmp_path, capsys):
    """Bug: export.py called the folder 'truncated or corrupt ... start again', a folder with only ckpt_sharded
    had 'no checkpoint', and init_from=out/ckpt_sharded tried to download GPT-2."""
    from transformers import GPT2LMHeadModel

    out = tmp_path / "run"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2, parallelism="fsdp"))
    ours = params_of(str(out / "ckpt_sharded"))
    export.main([f"--out_dir={out}", f"--to={tmp_path / 'hf'}"])  # the newest: the folder, with no ckpt.pt there
    export.main([f"--out_dir={out}", "--ckpt=ckpt_sharded", f"--to={tmp_path / 'hf2'}"])
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").state_dict()
    assert torch.equal(hf["transformer.wpe.weight"], ours["transformer.wpe.weight"])
    assert torch.equal(hf["transformer.h.0.mlp.c_fc.weight"], ours["transformer.h.0.mlp.c_fc.weight"].t())
    # a new run starts from its weights (a file, the folder, or the run folder: the same weights)
    for init_from in (out / "ckpt_sharded", out):
        started = train(tiny_config(data_dir, tmp_path / f"ft{len(str(init_from))}", max_iters=0,
                                    init_from=str(init_from)))
        assert max_diff(ours, started["model"].state_dict()) == 0.0


@pytest.fixture()
def other_char_data(tmp_path):
    """A char dataset of the same size of vocabulary but other characters than data_dir's."""
    d = tmp_path / "otherchar"
    meta = make_char_dataset(d, seed=0)
    meta["itos"] = [c.upper() if c.isalpha() else c for c in meta["itos"]]
    with open(d / "meta.json", "w") as f:
        json.dump(meta, f)
    return d


def test_weights_of_another_tokenizer_are_refused_at_start(data_dir, other_char_data, tmp_path, monkeypatch):
    """Bug: init_from=gpt2 (or a BPE checkpoint, a HF folder) trained on a char-level dataset, silently."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "tiny-gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=32, vocab_size=50257)).save_pretrained(
        folder)
    loads = []
    monkeypatch.setattr(start, "pretrained_gpt2", lambda *a, **k: loads.append(a))
    for init_from in ("gpt2", str(folder)):
        with pytest.raises(UserError) as e:
            train(tiny_config(data_dir, tmp_path / "ft", init_from=init_from))
        assert str(e.value) == (
            f"init_from={init_from!r} was trained with another tokenizer (gpt2, 50257 tokens) than dataset "
            f"'tinychar' (char, 30 tokens): the tokenizers differ; train it on a dataset prepared with its tokenizer "
            f"(GPT-2 weights: GPT-2 BPE, e.g. data/shakespeare/prepare.py), or start from scratch")
    assert loads == []  # refused before any weights were read
    # a char checkpoint on other characters: same vocabulary size, another alphabet
    train(tiny_config(data_dir, tmp_path / "char", max_iters=2, eval_interval=2))
    with pytest.raises(UserError, match=r"was trained with another tokenizer \(char, 30 tokens\) than dataset "
                                        r"'otherchar' \(char, 30 tokens\): the characters differ"):
        train(tiny_config(other_char_data, tmp_path / "ft2", init_from=str(tmp_path / "char" / "ckpt.pt")))


READ_RSS = """
import resource, sys
sys.path.insert(0, {root!r})
from nanogpt import checkpoints
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = checkpoints.read_weights({path!r})
total = sum(t.float().sum().item() for t in weights["model"].values())  # every weight read
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_reading_weights_maps_the_file_and_never_reads_the_optimizer_state(tmp_path):
    """Bug: sample.py, export.py and hellaswag.py read the whole checkpoint, optimizer state included, into memory
    (1,031 vs 615 MB max RSS for a 45M model)."""
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50))
    moments = {"exp_avg": torch.ones(100_000_000 // 4 // 2), "exp_avg_sq": torch.ones(100_000_000 // 4 // 2)}
    state = {"model": model.state_dict(), "model_args": {**vars(model.config)}, "iter_num": 3,
             "optimizer": {"state": {0: moments}, "param_groups": []}}
    checkpoint_file.save_checkpoint(str(tmp_path / "ckpt.pt"), state)
    r = subprocess.run([sys.executable, "-c", READ_RSS.format(root=ROOT, path=str(tmp_path / "ckpt.pt"))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    grown_mb = int(r.stdout.strip().splitlines()[-1])
    print(f"max RSS growth reading the weights of a checkpoint with 100 MB of optimizer state: {grown_mb} MB")
    assert grown_mb < 50


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_an_optimizer_moment_of_the_wrong_shape_is_refused_at_the_resume(data_dir, tmp_path, optimizer):
    """Bug: a checkpoint whose exp_avg (or Muon's momentum_buffer) is not its parameter's shape was resumed, saved
    again, and then stopped with 'non-finite loss ... lower learning_rate' (the fused AdamW kernel read past the short
    tensor): torch's load_state_dict takes any tensor. Now one line at the resume, before out_dir changes."""
    from helpers import folder_state

    out = tmp_path / "out"
    cfg = tiny_config(data_dir, out, max_iters=2, eval_interval=2, optimizer=optimizer)
    train(cfg)
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    state = ckpt["optimizer"] if optimizer == "adamw" else ckpt["optimizer"][optimizer]
    first = next(iter(state["state"].values()))
    key = "exp_avg" if "exp_avg" in first else "momentum_buffer"
    first[key] = torch.zeros(3)
    torch.save(ckpt, out / "ckpt.pt")
    before = folder_state(out)
    with pytest.raises(UserError, match=rf"^the checkpoint's optimizer state does not fit this run's optimizer "
                                        rf"\(ValueError: {key} of parameter 0 has shape \(3,\), the parameter"):
        train(tiny_config(data_dir, out, max_iters=4, eval_interval=2, optimizer=optimizer, init_from="resume"))
    after = folder_state(out)
    after.pop("run.lock", None)
    assert after == {k: v for k, v in before.items() if k != "run.lock"}


def test_a_damaged_model_args_value_is_named_as_the_checkpoints(data_dir, tmp_path):
    """Bug: a checkpoint whose model_args held attention=5 or dropout='x' was refused as 'attention=5 is not one of
    math, sdpa', as if the user had given it. The line says the checkpoint's model_args are damaged."""
    out = tmp_path / "out"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    ckpt = torch.load(out / "ckpt.pt", weights_only=False)
    ckpt["model_args"]["attention"] = 5  # GPTConfig's own check refuses it
    torch.save(ckpt, out / "ckpt.pt")
    message = r"^a checkpoint's model_args do not make a model \(attention=5 is not one of math, sdpa"
    with pytest.raises(UserError, match=message):
        load_model(SampleConfig(out_dir=str(out), device="cpu", dtype="float32"))
    with pytest.raises(UserError, match=message):
        checkpoint_file.checkpoint_model_config(ckpt["model_args"], dropout=0.1)  # a setting given beside it: still its
    with pytest.raises(UserError, match=r"^dropout=2.0 must be in \[0, 1\)"):  # a bad setting given: the setting's
        checkpoint_file.checkpoint_model_config({**ckpt["model_args"], "attention": "sdpa"}, dropout=2.0)
