"""Fine-tuning from GPT-2 weights: a local HF folder learns a GPT-2 BPE dataset, the finetune config parses, and
GPT-2 names go to from_pretrained (and fail clearly offline)."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy as np
import pytest
import torch

from nanogpt import dataio, tokenizers
import train as train_module
from nanogpt.device import resolve_attention, resolve_device, resolve_dtype
from nanogpt.checkpoint_file import load_checkpoint
from configurator import configure
from helpers import ROOT, run_script, run_script_waiting, tiny_config
from model import GPT
from nanogpt.errors import UserError
from nanogpt.hf_gpt2 import pretrained_gpt2
from sample import SampleConfig, load_model
from nanogpt.config import TrainConfig
from nanogpt import start
from nanogpt.start import init_model

CPU = TrainConfig(device="cpu", dtype="float32").machine()
from train import train





def make_bpe_dataset(data_dir, tokenizer: tokenizers.GPT2Tokenizer, n_lines: int = 1500, seed: int = 0) -> dict:
    """Short sentences over a dozen words, GPT-2 BPE tokens, written as prepare.py does (train/val.bin, meta.json)."""
    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "lady", "of", "york", "hath"]
    text = "".join(" ".join(rng.choice(words, size=rng.integers(3, 9))).capitalize() + ".\n" for _ in range(n_lines))
    ids = np.array(tokenizer.encode_ordinary(text), dtype=np.uint16)
    n = int(0.9 * len(ids))
    dataio.write_tokens(os.path.join(data_dir, "train.bin"), ids[:n])
    dataio.write_tokens(os.path.join(data_dir, "val.bin"), ids[n:])
    meta = {"vocab_size": tokenizer.vocab_size, "tokenizer": "gpt2", "train_tokens": n, "val_tokens": len(ids) - n,
            "dtype": "uint16", "source": "tests"}
    dataio.write_meta(data_dir, meta)
    return meta


@pytest.mark.slow
def test_finetune_from_a_local_hf_gpt2_folder_lowers_the_loss(tmp_path, gpt2_bpe):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=50257))
    folder = tmp_path / "tiny-gpt2"
    hf.save_pretrained(folder)
    data_dir, out_dir = tmp_path / "tinybpe", tmp_path / "out"
    make_bpe_dataset(data_dir, gpt2_bpe)

    # A random GPT-2 of width 32 over 50257 tokens moves slowly: at learning_rate=1e-3 the val loss falls only
    # 10.82 -> 10.26 in 15 iters, at 3e-3 10.82 -> 9.30.
    cfg = tiny_config(data_dir, out_dir, init_from=str(folder), block_size=32, max_iters=15, eval_interval=15,
                      learning_rate=3e-3, min_lr=3e-4, warmup_iters=2)
    result = train(cfg)
    evals = [r for r in map(json.loads, open(out_dir / "metrics.jsonl")) if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 15]
    first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
    print(f"\nfine-tune from a random HF GPT-2: val loss {first:.3f} -> {last:.3f} in 15 iters")
    assert first == pytest.approx(np.log(50257), abs=0.3)  # random weights: about uniform over the vocabulary
    assert last < first - 1.0, (first, last)
    assert result["val_loss"] == last

    ckpt = load_checkpoint(str(out_dir / "ckpt.pt"))
    args = ckpt["model_args"]
    assert args["bias"] is True  # GPT-2's, not the config's bias=False
    assert (args["n_layer"], args["n_head"], args["n_embd"], args["vocab_size"]) == (2, 2, 32, 50257)
    assert args["block_size"] == 32  # cropped from n_positions=128 to the run's block_size
    assert ckpt["model"]["transformer.wpe.weight"].shape == (32, 32)

    # sample.py finds the dataset's meta.json through the checkpoint and picks the GPT-2 BPE
    _, tokenizer = load_model(SampleConfig(out_dir=str(out_dir), device="cpu", dtype="float32"))
    assert isinstance(tokenizer, tokenizers.GPT2Tokenizer)


@pytest.mark.parametrize("activation, gelu, other", [("gelu_new", "tanh", "erf"), ("gelu", "erf", "tanh")])
def test_gelu_follows_the_gpt2_weights_and_a_mismatch_is_refused(tmp_path, activation, gelu, other):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = str(tmp_path / "tiny-gpt2")
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=32, vocab_size=300, activation_function=activation)
    GPT2LMHeadModel(config).save_pretrained(folder)
    assert init_model(TrainConfig(init_from=folder, block_size=32), CPU, None, None).config.gelu == gelu  # by default
    assert init_model(TrainConfig(init_from=folder, block_size=32, gelu=gelu), CPU, None, None).config.gelu == gelu
    with pytest.raises(UserError, match=rf"gelu='{other}' does not match the weights of "
                       rf".*tiny-gpt2', which were trained with gelu='{gelu}': remove the gelu setting"):
        init_model(TrainConfig(init_from=folder, block_size=32, gelu=other), CPU, None, None)
    scratch = TrainConfig(n_layer=1, n_head=2, n_embd=32, block_size=32)  # from scratch: nanoGPT's exact GELU
    assert init_model(scratch, CPU, {"vocab_size": 300}, None).config.gelu == "erf"
    assert init_model(dataclasses.replace(scratch, gelu="tanh"), CPU, {"vocab_size": 300}, None).config.gelu == "tanh"


def test_finetune_shakespeare_config_parses_and_routes_to_from_pretrained(monkeypatch):
    cfg = configure(TrainConfig(), [os.path.join(ROOT, "config", "finetune_shakespeare.py")])
    assert (cfg.init_from, cfg.dataset, cfg.out_dir) == ("gpt2-xl", "shakespeare", "out-shakespeare")
    assert (cfg.learning_rate, cfg.decay_lr, cfg.max_iters) == (3e-5, False, 20)
    assert (cfg.batch_size, cfg.gradient_accumulation_steps, cfg.always_save_checkpoint) == (1, 32, False)

    calls = []

    def fake_pretrained(name, overrides=None, vocab_padding_multiple=64):
        calls.append((name, overrides, vocab_padding_multiple))
        raise RuntimeError("stop here: no weights in a test")

    monkeypatch.setattr(start, "pretrained_gpt2", fake_pretrained)
    with pytest.raises(RuntimeError, match="stop here"):
        init_model(cfg, CPU, None, None)
    # attention="auto": the path for this machine's device and dtype (device.resolve_attention, tested there)
    device = resolve_device("auto")
    attention = resolve_attention("auto", device, resolve_dtype("auto", device))[0]
    assert calls == [("gpt2-xl", {"dropout": 0.0, "attention": attention, "sdpa_backend": "auto"}, 64)]


def gpt2_token_files(data_dir) -> None:
    """train.bin and val.bin of GPT-2 token ids, no meta.json (nanoGPT's openwebtext folder is so)."""
    for split in ("train", "val"):
        dataio.write_tokens(data_dir / f"{split}.bin", np.arange(3000) % 50257)


@pytest.mark.slow
def test_gpt2_name_with_the_hub_unreachable_fails_fast_naming_hf_hub_offline(tmp_path):
    # Not offline mode, no cache, and a hub address that refuses connections (so no test machine downloads GPT-2).
    # from_pretrained's own retries took ~30 s here (5 per file, with backoff) before the same error.
    gpt2_token_files(tmp_path / "data")
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
           "HF_ENDPOINT": "http://127.0.0.1:1"}
    args = ["train.py", "--init_from=gpt2", f"--out_dir={tmp_path / 'out'}", f"--data_dir={tmp_path / 'data'}",
            "--device=cpu", "--dtype=float32", "--compile=False", "--block_size=64"]
    r, waits = run_script_waiting(args, timeout=180, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    [line] = r.stderr.splitlines()
    assert re.fullmatch(  # the transport's reason (here "ConnectError: [Errno 111] Connection refused") varies
        re.escape("error: could not load GPT-2 weights 'gpt2' (http://127.0.0.1:1 is unreachable (") + r"\w+: .+"
        + re.escape(f") and they are not in the HF cache {tmp_path / 'hf-home' / 'hub'}): connect once to download "
                    f"them, or pass a local folder written by save_pretrained; offline, set HF_HUB_OFFLINE=1 so that "
                    f"nothing waits on the network"), line), line
    # no backoff: from_pretrained's retries wait 1, 2, 4, 8, 8 s (a polling loop on a busy machine may nap for 1 ms)
    assert sum(waits) < 0.5, waits


@pytest.mark.slow
def test_gpt2_name_offline_without_cache_is_a_one_line_error(tmp_path):
    gpt2_token_files(tmp_path / "data")  # the data is checked first
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = run_script(
        ["train.py", "config/finetune_shakespeare.py", f"--out_dir={tmp_path / 'out'}",
         f"--data_dir={tmp_path / 'data'}", "--device=cpu", "--dtype=float32", "--compile=False"],
        timeout=180, env=env,
    )
    assert r.returncode != 0
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: could not load GPT-2 weights 'gpt2-xl' ("), line


def test_a_folder_without_weights_is_a_one_line_error_naming_it(tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "config-only"
    GPT2Config(n_layer=1, n_head=2, n_embd=32).save_pretrained(folder)  # config.json, no weights
    with pytest.raises(UserError) as e:
        pretrained_gpt2(str(folder))
    assert str(e.value).startswith(f"could not load GPT-2 weights '{folder}' (")
    assert str(e.value).endswith("): pass a local folder written by save_pretrained")


@pytest.mark.slow
def test_a_shape_key_that_disagrees_with_the_weights_is_refused_and_the_report_shows_the_shape_that_trains(tmp_path):
    """Bug: --n_head/--n_embd given with init_from=<checkpoint> were silently replaced by the checkpoint's, while the
    config line and report.md showed the user's values."""
    from helpers import make_char_dataset
    from nanogpt.errors import UserError

    data_dir = tmp_path / "data"
    make_char_dataset(data_dir)
    train(tiny_config(data_dir, tmp_path / "src", max_iters=2, eval_interval=2))  # 2 layers, 2 heads, 32 wide
    ckpt = str(tmp_path / "src" / "ckpt.pt")
    with pytest.raises(UserError) as e:
        train(tiny_config(data_dir, tmp_path / "ft", init_from=ckpt, n_embd=64, n_head=4))
    assert str(e.value) == (f"init_from={ckpt!r}: n_head=4 (the weights have 2), n_embd=64 (the weights have 32): "
                            f"the model's shape is its weights'; remove these settings")
    assert not (tmp_path / "ft").exists()  # a refused start leaves no empty out_dir behind
    defaults = dict(n_layer=12, n_head=12, n_embd=768)  # left at the defaults: the weights' shape trains
    train(tiny_config(data_dir, tmp_path / "ft", init_from=ckpt, max_iters=2, eval_interval=2, report=True,
                      **defaults))
    saved = torch.load(tmp_path / "ft" / "ckpt.pt", weights_only=False)["config"]
    assert (saved["n_layer"], saved["n_head"], saved["n_embd"]) == (2, 2, 32)
    assert "| n_layer | `2` | `12` |" in (tmp_path / "ft" / "report.md").read_text()
