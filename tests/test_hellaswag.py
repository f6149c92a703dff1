"""HellaSwag scoring (nanogpt/hellaswag.py, and the hellaswag.py command) against a brute-force loss, in training runs and standalone, and its errors."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from nanogpt import dataio, tokenizers
import hellaswag
import nanogpt.hellaswag
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.distributed import Dist
from helpers import run_script, tiny_config
from model import GPT, GPTConfig
from train import main as train_main
from train import train

SUBJECTS = ["the king", "a lady", "his lord", "the queen", "her horse", "old york", "the duke", "a fool"]
ACTIONS = ["rides to the sea", "speaks of war", "sings a song", "eats the bread", "hath a sword",
           "sleeps all day", "reads the law", "counts the gold"]


def write_examples(path, seed: int = 0) -> list[dict]:
    """HellaSwag-format examples whose right ending is the one each context goes with in the training text, and
    whose wrong endings are other examples' endings spelt backwards (the same characters, in an order that the
    training text never has)."""
    rng = random.Random(seed)
    rows = []
    for i, (subject, action) in enumerate(zip(SUBJECTS, ACTIONS)):
        wrong = [a[::-1] for a in rng.sample([a for a in ACTIONS if a != action], 3)]
        label = rng.randrange(4)
        endings = wrong[:label] + [action] + wrong[label:]
        rows.append({"ind": i, "ctx": subject.capitalize(), "endings": endings, "label": label})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return rows


def make_dataset(data_dir, rows: list[dict], n_lines: int = 3000) -> dict:
    """A char dataset of the examples' right completions, in random order."""
    rng = random.Random(1)
    right = [f"{r['ctx']} {r['endings'][r['label']]}.\n" for r in rows]
    text = "".join(rng.choice(right) for _ in range(n_lines))
    itos = sorted(set(text) | {c for r in rows for e in [r["ctx"], *r["endings"]] for c in e})
    ids = np.array([itos.index(c) for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    dataio.write_tokens(data_dir / "train.bin", ids[:n])
    dataio.write_tokens(data_dir / "val.bin", ids[n:])
    meta = {"vocab_size": len(itos), "tokenizer": "char", "itos": itos}
    dataio.write_meta(data_dir, meta)
    return meta


def brute_force(model_double: GPT, ids: list[int], n_end: int) -> tuple[float, float]:
    """Total and mean loss of a row's last n_end tokens: the row alone, one position at a time, in float64."""
    logits, _ = model_double(torch.tensor([ids]))
    nll = [-torch.log_softmax(logits[0, t - 1], -1)[ids[t]].item() for t in range(len(ids) - n_end, len(ids))]
    return sum(nll), sum(nll) / n_end


def test_batched_scores_equal_a_brute_force_loss_per_example(tmp_path):
    rows = write_examples(tmp_path / "hs.jsonl")
    rows.append({"ctx": "A", "endings": ["b", "the king rides to the sea and far away", "c", "of"], "label": 1})
    (tmp_path / "hs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    meta = make_dataset(tmp_path, rows, n_lines=10)
    tok = tokenizers.get_tokenizer(meta)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=meta["vocab_size"], n_layer=2, n_head=2, n_embd=32, bias=True))
    reference = GPT(model.config)
    reference.load_state_dict(model.state_dict())
    model_double = reference.double().eval()
    encoded = nanogpt.hellaswag.encode(nanogpt.hellaswag.load_examples(str(tmp_path / "hs.jsonl")), tok, 64)
    # examples of different lengths in one padded batch
    total, mean = nanogpt.hellaswag.ending_losses(model.eval(), encoded, "cpu", torch.autocast("cpu", enabled=False))
    right = [0, 0]
    for k, (ex_rows, n_ends, label) in enumerate(encoded):
        expected = [brute_force(model_double, ids, n_end) for ids, n_end in zip(ex_rows, n_ends)]
        assert total[k].tolist() == pytest.approx([e[0] for e in expected], abs=1e-4)
        assert mean[k].tolist() == pytest.approx([e[1] for e in expected], abs=1e-4)
        right[0] += min(range(4), key=lambda j: expected[j][0]) == label
        right[1] += min(range(4), key=lambda j: expected[j][1]) == label
    # in bf16 autocast the same losses, to bf16's precision (8 bits of mantissa: ~0.5% of a ~3.3 per-token loss)
    total_bf16, mean_bf16 = nanogpt.hellaswag.ending_losses(model, encoded, "cpu", torch.autocast("cpu", dtype=torch.bfloat16))
    assert total_bf16.dtype == torch.float32 and not torch.equal(mean_bf16, mean)
    assert torch.allclose(mean_bf16, mean, atol=0.05)
    # acc and acc_norm from the brute-force losses; under "DDP" the ranks' shares add up to the same counts
    result = nanogpt.hellaswag.evaluate(model, encoded, Dist(), torch.autocast("cpu", enabled=False), examples_per_batch=3)
    assert (result["hellaswag_acc"], result["hellaswag_acc_norm"]) == (right[0] / 9, right[1] / 9)
    shares = [nanogpt.hellaswag.evaluate(model, encoded, Dist(rank=r, world_size=4), torch.autocast("cpu", enabled=False))
              for r in range(4)]
    assert sum(s["hellaswag_n"] for s in shares) == 9
    assert sum(s["hellaswag_acc"] * s["hellaswag_n"] for s in shares) == pytest.approx(right[0])
    assert sum(s["hellaswag_acc_norm"] * s["hellaswag_n"] for s in shares) == pytest.approx(right[1])


@pytest.mark.slow
def test_training_with_hellaswag_logs_acc_and_learns_the_right_endings(tmp_path, capsys):
    write_examples(tmp_path / "hs.jsonl")
    rows = [json.loads(line) for line in open(tmp_path / "hs.jsonl")]
    (tmp_path / "data").mkdir()
    make_dataset(tmp_path / "data", rows)
    cfg = tiny_config(tmp_path / "data", tmp_path / "out", block_size=64, max_iters=30, eval_interval=15,
                      hellaswag=True, hellaswag_interval=30, hellaswag_path=str(tmp_path / "hs.jsonl"),
                      learning_rate=1e-2)
    train(cfg)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    evals = [r for r in records if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 15, 30]
    assert [r["iter"] for r in evals if "hellaswag_acc" in r] == [0, 30]  # at every second eval
    first, last = evals[0], evals[-1]
    # trained on the right endings, the model picks every one of them (by total loss; by mean loss nearly all)
    assert first["hellaswag_acc"] < 0.5 and (last["hellaswag_acc"], last["hellaswag_n"]) == (1.0, 8)
    assert last["hellaswag_acc_norm"] >= 0.75
    out = capsys.readouterr().out
    assert "step 30: train loss" in out and f"HellaSwag acc 1.0000, acc_norm {last['hellaswag_acc_norm']:.4f}" in out
    # the standalone script on the run's checkpoint gives the same figures
    result = hellaswag.main([f"--out_dir={tmp_path / 'out'}", f"--path={tmp_path / 'hs.jsonl'}", "--device=cpu"])
    assert result == {k: last[k] for k in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n")}
    out = capsys.readouterr().out
    assert "HellaSwag acc 1.0000" in out and "(8 examples) in " in out and "(cpu, float32, 1 rank)" in out
    # and so does it under torchrun: 2 ranks score 4 examples each, and the counts are summed
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hellaswag.py",
                    f"--out_dir={tmp_path / 'out'}", f"--path={tmp_path / 'hs.jsonl'}", "--device=cpu"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{nanogpt.hellaswag.describe(result)} in " in r.stdout and "(cpu, float32, 2 ranks)" in r.stdout


def test_a_resume_with_nothing_left_to_train_scores_hellaswag_at_its_one_evaluation(tmp_path, capsys):
    """Bug: a resume past a lowered max_iters evaluates once and saves nothing (as eval_only does), but HellaSwag was
    scored only for --eval_only itself: that one evaluation's record had no hellaswag_acc."""
    from dataclasses import replace

    rows = write_examples(tmp_path / "hs.jsonl")
    (tmp_path / "data").mkdir()
    make_dataset(tmp_path / "data", rows, n_lines=300)
    cfg = tiny_config(tmp_path / "data", tmp_path / "out", block_size=64, max_iters=4, eval_interval=4,
                      hellaswag=True, hellaswag_interval=8, hellaswag_path=str(tmp_path / "hs.jsonl"))
    train(cfg)  # HellaSwag at iter 0 and at the last eval, iter 4
    capsys.readouterr()
    train(replace(cfg, init_from="resume", max_iters=2))  # iter 4: not a multiple of 8, not max_iters
    evals = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(evals) == 1 and evals[0].startswith("step 4: train loss ") and "HellaSwag acc " in evals[0], evals


@pytest.mark.parametrize("line, message", [
    (b"{not json", "line 2 is not JSON"),
    (b'{"ctx": "A", "endings": ["a", "b", "c"], "label": 0}', "line 2 is not a HellaSwag example"),
    (b'{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 4}', "line 2 is not a HellaSwag example"),
    (b'{"context": "A", "endings": ["a", "b", "c", "d"], "label": 1}', "line 2 is not a HellaSwag example"),
    (b'{"ctx": "\xff"}', "line 2 is not UTF-8 text"),
    (b"[" * 100_000, "line 2 is not JSON that Python reads (RecursionError)"),
    (b"1" * 5000, "line 2 is not JSON that Python reads (ValueError)"),
])
def test_a_malformed_hellaswag_file_is_a_one_line_error(tmp_path, capsys, line, message):
    good = b'{"ctx": "A", "endings": ["a", "b", "c", "d"], "label": 1}'
    (tmp_path / "hs.jsonl").write_bytes(good + b"\n" + line + b"\n")
    with pytest.raises(SystemExit):
        exit_on_user_error(lambda: hellaswag.main([f"--path={tmp_path / 'hs.jsonl'}", "--device=cpu"]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and 'expected JSON lines of {"ctx": text' in lines[0], lines


@pytest.mark.parametrize("extra, message", [
    ([], "error: hellaswag path {nope!r}: no such file; give a file of JSON lines of "
         '{{"ctx": text, "endings": [4 texts], "label": 0-3}}, or None to download it'),
    (["--eval_interval=10", "--hellaswag_interval=25"],
     "error: hellaswag_interval=25 must be 0 or a multiple of eval_interval=10 (HellaSwag runs at evals)"),
])
def test_hellaswag_settings_in_training_are_one_line_errors(tmp_path, capsys, extra, message):
    rows = write_examples(tmp_path / "hs.jsonl")
    (tmp_path / "data").mkdir()
    make_dataset(tmp_path / "data", rows, n_lines=200)
    args = [f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--compile=False",
            "--n_layer=1", "--n_head=1", "--n_embd=16", "--block_size=16", "--hellaswag=True",
            f"--hellaswag_path={tmp_path / 'nope.jsonl'}", *extra]
    with pytest.raises(SystemExit):
        exit_on_user_error(lambda: train_main(args))
    assert capsys.readouterr().err.strip().splitlines() == [message.format(nope=str(tmp_path / "nope.jsonl"))]


def test_a_folder_given_as_the_examples_file_is_named_a_folder(tmp_path, capsys):
    """Bug: hellaswag.py --path=/tmp (a folder) said "no such file". Now it says the path is a folder, from
    hellaswag.py and from train.py's hellaswag_path alike (one reader)."""
    folder = tmp_path / "examples"
    folder.mkdir()
    message = (f"hellaswag path {str(folder)!r} is a folder, not a file: give a file of JSON lines of "
               '{"ctx": text, "endings": [4 texts], "label": 0-3}, or None to download it')
    with pytest.raises(UserError) as e:
        nanogpt.hellaswag.load_examples(str(folder))
    assert str(e.value) == message
    rows = write_examples(tmp_path / "hs.jsonl")
    (tmp_path / "data").mkdir()
    make_dataset(tmp_path / "data", rows, n_lines=200)
    args = [f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--compile=False",
            "--n_layer=1", "--n_head=1", "--n_embd=16", "--block_size=16", "--hellaswag=True",
            f"--hellaswag_path={folder}"]
    with pytest.raises(SystemExit) as stop:
        exit_on_user_error(lambda: train_main(args))
    assert stop.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]


def test_an_init_from_that_names_no_weights_is_refused_before_the_download(tmp_path, capsys, monkeypatch):
    """Bug: hellaswag.py downloaded the validation set (or read --path) before it found that init_from names no
    weights; sample.py refused it at once. Both now check it with the other settings (config.WeightsSource)."""
    import sample

    downloads = []
    monkeypatch.setattr(nanogpt.hellaswag, "download", lambda *a, **k: downloads.append(a))
    message = (f"error: init_from={str(tmp_path / 'nope')!r} is not one of resume, gpt2, gpt2-medium, gpt2-large, "
               f"gpt2-xl, a folder with a HF GPT-2 model, or a checkpoint file or sharded folder")
    for main in (hellaswag.main, sample.main):
        with pytest.raises(SystemExit) as e:
            exit_on_user_error(lambda: main([f"--init_from={tmp_path / 'nope'}", "--device=cpu"]))
        assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [message], main
    assert downloads == []


def test_download_fetches_the_validation_set_once_and_checks_it(tmp_path, monkeypatch):
    line = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2}) + "\n"
    full, short = tmp_path / "full.jsonl", tmp_path / "short.jsonl"
    full.write_text(line * nanogpt.hellaswag.VAL_EXAMPLES, encoding="utf-8")
    short.write_text(line * 10, encoding="utf-8")
    cache = tmp_path / "cache" / "hellaswag_val.jsonl"
    monkeypatch.setattr(nanogpt.hellaswag, "CACHE", str(cache))
    monkeypatch.setattr(nanogpt.hellaswag, "URL", short.as_uri())  # urllib reads file:// URLs as it reads https://
    with pytest.raises(UserError, match=f"gave 10 examples, not HellaSwag validation's {nanogpt.hellaswag.VAL_EXAMPLES}"):
        nanogpt.hellaswag.load_examples()
    monkeypatch.setattr(nanogpt.hellaswag, "URL", (tmp_path / "missing.jsonl").as_uri())
    with pytest.raises(UserError, match="cannot download HellaSwag from .*; check the network, or set the hellaswag path"):
        nanogpt.hellaswag.load_examples()
    assert not cache.exists() and os.listdir(cache.parent) == []  # no partial copy left to be read later
    monkeypatch.setattr(nanogpt.hellaswag, "URL", full.as_uri())
    assert len(nanogpt.hellaswag.load_examples()) == nanogpt.hellaswag.VAL_EXAMPLES and cache.read_bytes() == full.read_bytes()
    full.unlink()  # the cached copy is used from now on
    assert nanogpt.hellaswag.load_examples()[0] == nanogpt.hellaswag.Example("A man", ["a", "b", "c", "d"], 2)


def test_gpt2_weights_are_scored_with_the_bpe_as_hf_scores_them(tmp_path, gpt2_bpe, capsys):
    """A HF GPT-2 folder (tiny, random weights) through the standalone script == HF's own model, row by row."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)).eval()
    hf.save_pretrained(tmp_path / "tiny-gpt2")
    rows = [{"ctx": "The cat sat on", "endings": [" the mat.", "a dog", "the roof of the old house", "it"], "label": 0},
            {"ctx": "Rain <|endoftext|> falls", "endings": ["up", "down slowly", "sideways", "on the plain"], "label": 1}]
    (tmp_path / "hs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    result = hellaswag.main([f"--init_from={tmp_path / 'tiny-gpt2'}", f"--path={tmp_path / 'hs.jsonl'}",
                             "--device=cpu", "--dtype=float32"])
    right, right_first = [0, 0], []
    for r in rows:
        ctx = gpt2_bpe.encode_ordinary(r["ctx"])
        losses = []
        for e in r["endings"]:
            end = gpt2_bpe.encode_ordinary(" " + e)
            with torch.no_grad():
                logits = hf(torch.tensor([ctx + end])).logits[0].double()
            nll = -torch.log_softmax(logits[len(ctx) - 1 : -1], -1)[torch.arange(len(end)), torch.tensor(end)]
            losses.append((nll.sum().item(), nll.mean().item()))
        right[0] += min(range(4), key=lambda j: losses[j][0]) == r["label"]
        right[1] += min(range(4), key=lambda j: losses[j][1]) == r["label"]
        right_first.append(float(min(range(4), key=lambda j: losses[j][0]) == r["label"]))
    assert (result["hellaswag_acc"], result["hellaswag_acc_norm"]) == (right[0] / 2, right[1] / 2)
    assert "build-nanogpt's figures" not in capsys.readouterr().out  # printed for gpt2 and gpt2-xl on the full set
    first = hellaswag.main([f"--init_from={tmp_path / 'tiny-gpt2'}", f"--path={tmp_path / 'hs.jsonl'}",
                            "--device=cpu", "--dtype=float32", "--max_examples=1"])
    assert (first["hellaswag_n"], first["hellaswag_acc"]) == (1, right_first[0])
