"""
A drop-in for nanoGPT users: checkpoints written in karpathy/nanoGPT's format sample, resume (with their optimizer
state) and start fine-tunes here. The tests write such checkpoints themselves, from nanoGPT's field list:

  ckpt.pt = {"model": state_dict (with "_orig_mod." prefixes after torch.compile), "optimizer": AdamW state_dict,
             "model_args": {n_layer, n_head, n_embd, block_size, bias, vocab_size, dropout}, "iter_num": int,
             "best_val_loss": a 0-d tensor (its estimate_loss returns tensor means), "config": its train.py globals}

Its vocab_size is the number of rows (65 for characters, 50304 for its GPT-2-sized runs), GELU is nn.GELU() (the
exact form), and checkpoints from before PyTorch 2.0 also hold each layer's causal mask as a buffer `attn.bias`.
"""
from __future__ import annotations

import collections
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanogpt import dataio
from nanogpt.checkpoint_file import load_checkpoint
from helpers import config_args, run_in_process, tiny_config
from model import GPT, GPTConfig
from sample import SampleConfig, load_model, sample
from train import train

# nanoGPT's train.py globals, which it saves as checkpoint["config"] (its config_keys: the int/float/bool/str ones)
NANOGPT_CONFIG_KEYS = (
    "out_dir", "eval_interval", "log_interval", "eval_iters", "eval_only", "always_save_checkpoint", "init_from",
    "wandb_log", "wandb_project", "wandb_run_name", "dataset", "gradient_accumulation_steps", "batch_size",
    "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "learning_rate", "max_iters", "weight_decay",
    "beta1", "beta2", "grad_clip", "decay_lr", "warmup_iters", "lr_decay_iters", "min_lr", "backend", "device",
    "dtype", "compile",
)
NANOGPT_MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
# its defaults for the keys a run seldom changes (a GPU run: nccl, cuda, bf16, compiled)
NANOGPT_DEFAULTS = {"backend": "nccl", "device": "cuda", "dtype": "bfloat16", "compile": True, "init_from": "scratch"}
# tiny shakespeare's 65 characters, the vocabulary of nanoGPT's shakespeare_char
SHAKESPEARE_CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def nanogpt_checkpoint(model_state: dict, optimizer_state: dict, model_args: dict, run: dict, iter_num: int,
                       best_val_loss: float, old_masks: bool = False) -> dict:
    """A checkpoint as nanoGPT's train.py writes it, for a compiled model (every key prefixed `_orig_mod.`)."""
    state = {f"_orig_mod.{k}": v for k, v in model_state.items()}
    if old_masks:  # pre-2.0 nanoGPT: a (1, 1, T, T) float tril per layer, saved with the weights
        T = model_args["block_size"]
        for i in range(model_args["n_layer"]):
            state[f"_orig_mod.transformer.h.{i}.attn.bias"] = torch.ones(T, T).tril().view(1, 1, T, T)
    return {
        "model": state,
        "optimizer": optimizer_state,
        "model_args": {k: model_args[k] for k in NANOGPT_MODEL_ARGS},
        "iter_num": iter_num,
        "best_val_loss": torch.tensor(best_val_loss),
        "config": {k: run.get(k, NANOGPT_DEFAULTS.get(k)) for k in NANOGPT_CONFIG_KEYS},
    }


def nanogpt_adamw(model: GPT) -> torch.optim.AdamW:
    """nanoGPT's optimizer layout: two AdamW groups, the >= 2-D parameters decayed, in named_parameters order."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))


def nanogpt_model(vocab_size: int, seed: int = 0, **changes) -> GPT:
    """A model with nanoGPT's shape: vocab_size rows exactly, exact GELU, biases."""
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, bias=True, vocab_size=vocab_size, dropout=0.0)
    args.update(changes)
    torch.manual_seed(seed)
    return GPT(GPTConfig(**args, vocab_padding_multiple=1, gelu="erf")).eval()


def model_args_of(model: GPT) -> dict:
    return {k: getattr(model.config, k) for k in NANOGPT_MODEL_ARGS}


def write_char_dataset(data_dir, n_chars: int = 40_000, seed: int = 0) -> dict:
    """A learnable text (words in a random order) over nanoGPT's 65-character shakespeare vocabulary."""
    rng = np.random.default_rng(seed)
    words = ["The", "king", "QUEEN", "speaks;", "to", "his", "lord,", "and", "lady", "of", "York!", "hath", "3"]
    text = "".join(" ".join(rng.choice(words, size=rng.integers(3, 9))) + ".\n" for _ in range(n_chars // 20))
    ids = np.array([SHAKESPEARE_CHARS.index(c) for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    os.makedirs(data_dir, exist_ok=True)
    dataio.write_tokens(os.path.join(data_dir, "train.bin"), ids[:n])
    dataio.write_tokens(os.path.join(data_dir, "val.bin"), ids[n:])
    meta = {"vocab_size": 65, "tokenizer": "char", "itos": list(SHAKESPEARE_CHARS), "train_tokens": n,
            "val_tokens": len(ids) - n, "dtype": "uint16", "source": "tests"}
    dataio.write_meta(data_dir, meta)
    return meta


@pytest.fixture()
def repo_root(tmp_path, monkeypatch):
    """nanoGPT's checkpoints name a dataset, found as data/<dataset> beside train.py: point that at tmp_path."""
    monkeypatch.setattr(dataio, "ROOT", str(tmp_path))
    return tmp_path


def greedy_reference(model: GPT, idx: torch.Tensor, n: int, vocab_size: int) -> list[int]:
    """Greedy decoding the obvious way: a full forward per token, argmax over the first vocab_size ids."""
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx)
            idx = torch.cat((idx, logits[:, -1, :vocab_size].argmax(-1, keepdim=True)), dim=1)
    return idx[0].tolist()


CPU_GREEDY = dict(device="cpu", dtype="float32", temperature=0.0, num_samples=1, max_new_tokens=20)


def test_char_checkpoint_of_65_rows_samples_unpadded(repo_root):
    """Before: 'shapes differ ... lm_head.weight (65, 32) vs (128, 32)' (65 rows re-padded to 128)."""
    write_char_dataset(repo_root / "data" / "shakespeare_char")
    source = nanogpt_model(65, seed=1)
    out_dir = repo_root / "out-shakespeare-char"
    os.makedirs(out_dir)
    run = {"dataset": "shakespeare_char", "out_dir": "out-shakespeare-char"}
    state = nanogpt_checkpoint(source.state_dict(), nanogpt_adamw(source).state_dict(), model_args_of(source), run,
                               iter_num=250, best_val_loss=1.47, old_masks=True)
    torch.save(state, out_dir / "ckpt.pt")

    cfg = SampleConfig(out_dir=str(out_dir), start="KING", **CPU_GREEDY)
    model, tokenizer = load_model(cfg)
    assert model.lm_head.weight.shape == (65, 32) and tokenizer.vocab_size == 65
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items())
    result = sample(model, tokenizer, "KING", cfg)
    prompt = torch.tensor([[SHAKESPEARE_CHARS.index(c) for c in "KING"]])
    expected = greedy_reference(source, prompt, 20, 65)
    assert result.ids[0] == expected
    assert result.texts[0] == "".join(SHAKESPEARE_CHARS[i] for i in expected)


@pytest.mark.slow
def test_gpt2_sized_checkpoint_never_samples_or_decodes_the_padded_ids(repo_root, gpt2_bpe):
    """nanoGPT's GPT-2 runs have 50304 rows for GPT-2 BPE's 50257 tokens. Rows past the tokenizer get logits that
    would take all the probability; sampling must still draw only real tokens, which then decode."""
    rows = 50304
    source = nanogpt_model(rows, seed=2, n_layer=1, n_embd=16)
    C = source.config.n_embd
    with torch.no_grad():  # ln_f with zero gain outputs its bias b: rows 5·b score 5·|b|², far above the others
        b = torch.randn(C, generator=torch.Generator().manual_seed(3))
        source.transformer.ln_f.weight.zero_()
        source.transformer.ln_f.bias.copy_(b)
        source.lm_head.weight[gpt2_bpe.vocab_size :] = 5.0 * b
        logits, _ = source(torch.tensor([gpt2_bpe.encode("Hello")]))
    assert F.softmax(logits[0, -1], -1)[gpt2_bpe.vocab_size :].sum() > 0.999, "padded ids must dominate unmasked"
    out_dir = repo_root / "out"
    os.makedirs(out_dir)
    state = nanogpt_checkpoint(source.state_dict(), nanogpt_adamw(source).state_dict(), model_args_of(source),
                               {"dataset": "openwebtext"}, iter_num=600000, best_val_loss=2.85)
    torch.save(state, out_dir / "ckpt.pt")

    cfg = SampleConfig(out_dir=str(out_dir), start="Hello", device="cpu", dtype="float32", temperature=1.0,
                       top_k=None, num_samples=4, max_new_tokens=50)
    model, tokenizer = load_model(cfg)
    assert model.lm_head.weight.shape == (rows, C)
    result = sample(model, tokenizer, "Hello", cfg)
    new = [i for ids in result.ids for i in ids[1:]]
    assert max(new) < gpt2_bpe.vocab_size and len(set(new)) > 50
    assert all(text == gpt2_bpe.decode(ids) for text, ids in zip(result.texts, result.ids))


def to_nanogpt_format(ckpt_path, run_keys: dict) -> None:
    """Rewrite a checkpoint of this repo in nanoGPT's format (its fields only, compiled-model prefixes)."""
    ours = load_checkpoint(str(ckpt_path))
    model_args = {**ours["model_args"], "dropout": ours["config"]["dropout"]}
    run = {k: v for k, v in ours["config"].items() if k in NANOGPT_CONFIG_KEYS} | run_keys
    state = nanogpt_checkpoint(ours["model"], ours["optimizer"], model_args, run, ours["iter_num"],
                               ours["best_val_loss"])
    torch.save(state, ckpt_path)


@pytest.mark.slow
def test_resume_from_a_nanogpt_checkpoint_continues_its_optimizer_state_bitwise(tmp_path):
    """4 steps + nanoGPT-format checkpoint + resume for 4 more == 8 uninterrupted steps, bitwise (CPU float32, no
    dropout). Adam restarted from zero moments would differ, so this shows that its state was continued."""
    write_char_dataset(tmp_path / "nanochar")
    # the nanoGPT shape: rows == vocabulary (65), exact GELU
    common = dict(max_iters=8, lr_decay_iters=8, eval_interval=4, vocab_padding_multiple=1, gelu="erf", bias=True)
    full = train(tiny_config(tmp_path / "nanochar", tmp_path / "full", **common))
    train(tiny_config(tmp_path / "nanochar", tmp_path / "split", **{**common, "max_iters": 4}))
    to_nanogpt_format(tmp_path / "split" / "ckpt.pt", NANOGPT_DEFAULTS)

    # the optimizer state loads by position: our groups list the parameters in nanoGPT's order
    ours = full["model"].configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu", verbose=False)
    theirs = nanogpt_adamw(full["model"])
    assert [list(map(id, g["params"])) for g in ours.param_groups] == [
        list(map(id, g["params"])) for g in theirs.param_groups]

    resumed = train(tiny_config(tmp_path / "nanochar", tmp_path / "split", **{**common, "gelu": None},
                                init_from="resume"))
    assert resumed["iter_num"] == 8 and resumed["last_loss"] == full["last_loss"]
    a, b = (load_checkpoint(str(tmp_path / d / "ckpt.pt")) for d in ("full", "split"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert b["optimizer"]["state"][0]["step"] == 8


def test_nanogpt_checkpoint_starts_a_fine_tune(tmp_path):
    """init_from=<checkpoint file>: its weights (65 rows, cropped to the new block_size) start a new run, with a
    fresh optimizer and iteration count, in another out_dir."""
    write_char_dataset(tmp_path / "nanochar")
    source = nanogpt_model(65, seed=4, block_size=64)
    path = tmp_path / "nanogpt" / "ckpt.pt"
    os.makedirs(path.parent)
    torch.save(nanogpt_checkpoint(source.state_dict(), nanogpt_adamw(source).state_dict(), model_args_of(source),
                                  {"dataset": "shakespeare_char"}, iter_num=5000, best_val_loss=1.47), path)
    start = dict(init_from=str(path), block_size=16, learning_rate=1e-3)
    untouched = train(tiny_config(tmp_path / "nanochar", tmp_path / "ft0", max_iters=0, **start))["model"]
    expected = {**source.state_dict(), "transformer.wpe.weight": source.transformer.wpe.weight[:16]}
    assert all(torch.equal(v, expected[k]) for k, v in untouched.state_dict().items())

    tuned = train(tiny_config(tmp_path / "nanochar", tmp_path / "ft", max_iters=10, eval_interval=10, **start))
    ckpt = load_checkpoint(str(tmp_path / "ft" / "ckpt.pt"))
    assert ckpt["iter_num"] == 10 and ckpt["optimizer"]["state"][0]["step"] == 10  # fresh, not 5000 + 10
    assert ckpt["model_args"]["vocab_size"] == 65 and ckpt["model"]["lm_head.weight"].shape == (65, 32)
    first_eval = [r for r in map(json.loads, open(tmp_path / "ft" / "metrics.jsonl")) if "start" not in r][0]
    assert first_eval["iter"] == 0 and tuned["val_loss"] < first_eval["val_loss"]


# ----------------------------------------------------------------------------------- nanoGPT's dataset folders


def write_nanogpt_char_folder(data_dir, meta: object = None) -> None:
    """The files of nanoGPT's data/shakespeare_char/prepare.py: train.bin and val.bin (np.uint16 .tofile, as
    dataio.write_tokens writes them), and instead of meta.json a meta.pkl, pickle.dump of `meta`, by default what
    nanoGPT dumps: {'vocab_size': 65, 'itos': {0: '\\n', ...}, 'stoi': {'\\n': 0, ...}}."""
    write_char_dataset(data_dir)
    os.remove(os.path.join(data_dir, "meta.json"))
    if meta is None:
        stoi = {ch: i for i, ch in enumerate(SHAKESPEARE_CHARS)}
        itos = {i: ch for i, ch in enumerate(SHAKESPEARE_CHARS)}
        meta = {"vocab_size": len(SHAKESPEARE_CHARS), "itos": itos, "stoi": stoi}
    with open(os.path.join(data_dir, "meta.pkl"), "wb") as f:
        pickle.dump(meta, f)


def test_nanogpt_char_folder_with_meta_pkl_trains_and_samples(tmp_path):
    data_dir = tmp_path / "shakespeare_char"
    write_nanogpt_char_folder(data_dir)
    assert dataio.load_meta(data_dir) == {"vocab_size": 65, "tokenizer": "char", "itos": list(SHAKESPEARE_CHARS)}

    result = train(tiny_config(data_dir, tmp_path / "out"))
    assert result["model"].config.vocab_size == 65 and result["val_loss"] < math.log(65)  # learnt: below uniform

    cfg = SampleConfig(out_dir=str(tmp_path / "out"), start="KING", **CPU_GREEDY)
    model, tokenizer = load_model(cfg)  # the tokenizer from the run's data_dir: meta.pkl's characters
    assert tokenizer.itos == list(SHAKESPEARE_CHARS)
    out = sample(model, tokenizer, "KING", cfg)
    assert out.ids[0][:4] == [SHAKESPEARE_CHARS.index(c) for c in "KING"] and len(out.ids[0]) == 4 + 20
    assert out.texts[0] == "".join(SHAKESPEARE_CHARS[i] for i in out.ids[0])


class Meta(collections.OrderedDict):
    """A dict subclass: pickled as a reference to this class, which loading would import and call."""


class RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):  # unpickling calls os.system(command)
        return os.system, (self.command,)


@pytest.mark.parametrize("case", ["os_system", "ordered_dict", "dict_subclass", "tuple"])
def test_meta_pkl_with_more_than_plain_data_is_refused_unrun(tmp_path, case, capsys):
    marker = tmp_path / "ran"
    plain = {"vocab_size": 65, "itos": dict(enumerate(SHAKESPEARE_CHARS))}
    meta, names = {
        "os_system": ({**plain, "stoi": RunsCommand(f"touch {marker}")}, f"it names {os.name}.system"),
        "ordered_dict": (collections.OrderedDict(plain), "it names collections.OrderedDict"),
        "dict_subclass": (Meta(plain), f"it names {__name__}.Meta"),
        "tuple": ({**plain, "itos": tuple(SHAKESPEARE_CHARS)}, "it holds a tuple"),
    }[case]
    data_dir = tmp_path / "nanochar"
    write_nanogpt_char_folder(data_dir, meta)

    result = run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "out"))], capsys)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    refused = "refused, nothing in it was run: " if case != "tuple" else "refused: "
    assert result.stderr.startswith(f"error: {data_dir / 'meta.pkl'} {refused}{names}, and a meta.pkl may hold only "
                                    "dicts, lists, strings and numbers, as nanoGPT's does"), result.stderr
    assert not marker.exists() and not (tmp_path / "out" / "ckpt.pt").exists()


# ----------------------------------------------------------------------------------- nanoGPT's command lines

# Every command line of nanoGPT's README (karpathy/nanoGPT, README.md) that runs on one machine, as it is written
# there; `python train.py --batch_size=32 --compile=False` is from its train.py docstring.
NANOGPT_COMMANDS = """
python data/shakespeare_char/prepare.py
python train.py config/train_shakespeare_char.py
python sample.py --out_dir=out-shakespeare-char
python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
python sample.py --out_dir=out-shakespeare-char --device=cpu
python data/openwebtext/prepare.py
torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
python sample.py
python train.py config/eval_gpt2.py
python train.py config/eval_gpt2_medium.py
python train.py config/eval_gpt2_large.py
python train.py config/eval_gpt2_xl.py
python data/shakespeare/prepare.py
python train.py config/finetune_shakespeare.py
python sample.py --out_dir=out-shakespeare
python sample.py --init_from=gpt2-xl --start="What is the answer to life, the universe, and everything?" --num_samples=5 --max_new_tokens=100
python sample.py --start=FILE:prompt.txt
python bench.py
python train.py --batch_size=32 --compile=False
"""
# Left out: its two-node lines (`torchrun --nproc_per_node=8 --nnodes=2 ... train.py` with the default
# gradient_accumulation_steps=40 over 16 ranks) fail nanoGPT's own assert (40 % 16 != 0); the README's 2-node
# example here uses a divisible setting.


def test_nanogpt_readme_commands_are_valid_here():
    """Each line parses with its script's typed config and passes the script's checks for its world size (what
    would stop it before any work); data preparation lines name scripts that exist."""
    import re
    import shlex

    import bench
    import sample as sample_module
    from configurator import configure
    from helpers import ROOT
    from nanogpt.config import TrainConfig

    lines = NANOGPT_COMMANDS.strip().splitlines()
    assert len(lines) == 19
    for line in lines:
        words = shlex.split(line)
        at = next(i for i, w in enumerate(words) if w.endswith(".py"))
        script, args = words[at], words[at + 1 :]
        assert os.path.isfile(os.path.join(ROOT, script)), line
        world = int(dict(re.findall(r"--(nproc_per_node)=(\d+)", line)).get("nproc_per_node", 1))
        if script == "train.py":
            configure(TrainConfig(), args).check(world)
        elif script == "sample.py":
            sample_module.check_config(configure(SampleConfig(), args))
        elif script == "bench.py":
            bench.load_config(args)
        else:
            assert script.startswith("data/") and script.endswith("/prepare.py") and not args, line


@pytest.mark.slow
def test_a_nanogpt_cpu_checkpoint_with_its_float16_default_resumes_on_the_cpu(tmp_path, capsys):
    """Bug (a regression no test caught): nanoGPT records dtype='float16' (its default, also for a CPU run); a resume
    without a config took it and refused it on the CPU. It now runs in this machine's best dtype, saying so."""
    from helpers import run_in_process

    write_char_dataset(tmp_path / "nanochar")
    common = dict(max_iters=4, eval_interval=4, vocab_padding_multiple=1, gelu="erf", bias=True)
    train(tiny_config(tmp_path / "nanochar", tmp_path / "run", **common))
    to_nanogpt_format(tmp_path / "run" / "ckpt.pt", {**NANOGPT_DEFAULTS, "device": "cpu", "dtype": "float16",
                                                      "compile": False})
    r = run_in_process(["train.py", "--init_from=resume", f"--out_dir={tmp_path / 'run'}", "--max_iters=6",
                        f"--data_dir={tmp_path / 'nanochar'}", "--eval_interval=2"], capsys)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "dtype: the run's 'float16' cannot run here, so 'auto' (" in r.stdout
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter_num"] == 6
