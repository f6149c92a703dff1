"""FineWeb-Edu's prepare script (shards, restart) and the sharded loader train.py reads (windows, resume, DDP)."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanogpt import dataio
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.checkpoint_file import load_checkpoint
from helpers import ROOT, config_args, make_char_dataset, run_script, tiny_config
from train import train
from nanogpt.step import batch_generator, get_batch, train_batches
from train import main as train_main

PREPARE = os.path.join(ROOT, "data", "fineweb_edu", "prepare.py")


def _load_prepare():
    """The prepare script as a module (registered, so that pool workers can unpickle what it hands them)."""
    if "prepare_fineweb_edu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("prepare_fineweb_edu", PREPARE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["prepare_fineweb_edu"] = module
        spec.loader.exec_module(module)
    return sys.modules["prepare_fineweb_edu"]


fw = _load_prepare()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def documents(n: int, seed: int = 0) -> list[str]:
    """Documents of varied length with what BPE round trips must survive: the literal "<|endoftext|>", non-ASCII
    text, newlines and spaces at the ends."""
    rng = random.Random(seed)
    words = ["the", "river", "éclair", "日本語", "<|endoftext|>", "  ", "\n", "data", "42", "!"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) + rng.choice(["", "\n", " "])
            for _ in range(n)]


def write_jsonl(path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return str(path)


def shard_files(out_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out_dir.iterdir()) if p.is_file()}


# ----------------------------------------------------------------------------------------------- prepare


def test_prepare_shards_decode_to_the_documents_with_separators(tmp_path, gpt2_bpe):
    docs = documents(120)
    meta = fw.prepare(write_jsonl(tmp_path / "docs.jsonl", docs), tmp_path / "out", num_proc=2, shard_tokens=157,
                      cache_dir=str(tmp_path / "hf"))
    names = meta["shards"]["val"] + meta["shards"]["train"]
    assert names[0] == "val_000000.bin" and names[1:3] == ["train_000001.bin", "train_000002.bin"]
    stream = np.concatenate([np.fromfile(tmp_path / "out" / n, dtype=np.uint16) for n in names])
    # the data itself is the reference: every document, in order, each preceded by <|endoftext|>
    assert gpt2_bpe.decode(stream.tolist()) == "".join("<|endoftext|>" + d for d in docs)
    starts = np.flatnonzero(stream == dataio.GPT2_EOT)  # the literal "<|endoftext|>" in the text is not id 50256
    assert len(starts) == len(docs) == meta["documents"]
    assert [gpt2_bpe.decode(p.tolist()) for p in np.split(stream, starts)[1:]] == ["<|endoftext|>" + d for d in docs]
    # fixed-size shards (the last one shorter), each described by its sidecar
    sizes = [len(np.fromfile(tmp_path / "out" / n, dtype=np.uint16)) for n in names]
    assert sizes[:-1] == [157] * (len(names) - 1) and 0 < sizes[-1] <= 157
    for i, n in enumerate(names):
        side = dataio.shard_info(tmp_path / "out" / n)
        assert (side["index"], side["tokens"], side["tokenizer"], side["split"]) == (
            i, sizes[i], "gpt2", "val" if i == 0 else "train")
    assert (meta["val_tokens"], meta["train_tokens"]) == (157, sum(sizes[1:]))
    assert dataio.load_meta(tmp_path / "out") == meta
    # run again: nothing to do; without meta.json (a kill after the last shard): every document skipped, meta written
    files = shard_files(tmp_path / "out")
    assert fw.prepare(write_jsonl(tmp_path / "docs.jsonl", docs), tmp_path / "out", shard_tokens=157,
                      cache_dir=str(tmp_path / "hf")) == meta
    os.remove(tmp_path / "out" / "meta.json")
    assert fw.prepare(str(tmp_path / "docs.jsonl"), tmp_path / "out", shard_tokens=157,
                      cache_dir=str(tmp_path / "hf")) == meta
    assert shard_files(tmp_path / "out") == files
    assert dataio.open_split(tmp_path / "out", "train", vocab_size=50257).total == meta["train_tokens"]


KILL = """
import os, signal, sys
sys.path.insert(0, {root!r})
import importlib.util
spec = importlib.util.spec_from_file_location("prep", {prepare!r})
prep = importlib.util.module_from_spec(spec); spec.loader.exec_module(prep)
prep.DOCS_PER_TASK = 1  # a batch per document, so the hook runs often
def kill(shard, buffered):  # a hard kill (no cleanup) part-way into a shard after the third
    if shard >= 3 and buffered > 0:
        os.kill(os.getpid(), signal.SIGKILL)
prep.prepare({source!r}, {out!r}, num_proc=1, shard_tokens=101, cache_dir={cache!r}, on_batch=kill)
"""


@pytest.mark.slow
def test_prepare_killed_then_restarted_writes_the_shards_of_an_uninterrupted_run(tmp_path, gpt2_bpe):
    docs = documents(90, seed=1)
    pq.write_table(pa.table({"text": docs, "id": list(range(90))}), tmp_path / "docs.parquet")
    source, cache = str(tmp_path / "docs.parquet"), str(tmp_path / "hf")
    fw.prepare(source, tmp_path / "whole", shard_tokens=101, cache_dir=cache)

    out = tmp_path / "killed"
    r = run_script(["-c", KILL.format(root=ROOT, prepare=PREPARE, source=source, out=str(out), cache=cache)])
    assert r.returncode == -9, r.stderr[-2000:]
    k = len(list(out.glob("*.bin")))  # complete shards, each with its sidecar; no meta.json
    assert 3 <= k < len(list((tmp_path / "whole").glob("*.bin"))) and len(os.listdir(out)) == 2 * k
    # what a kill at other moments leaves: a torn temporary file, a renamed shard whose sidecar never came
    (out / f"train_{k:06d}.bin.tmp").write_bytes(b"\x01\x02\x03")
    (out / f"train_{k + 1:06d}.bin").write_bytes(np.arange(101, dtype=np.uint16).tobytes())
    meta = fw.prepare(source, out, shard_tokens=101, cache_dir=cache, streaming=True)  # restart, by skipping a stream
    assert shard_files(out) == shard_files(tmp_path / "whole")
    assert meta["documents"] == 90


def test_prepare_errors(tmp_path, gpt2_bpe, monkeypatch):
    source, cache = write_jsonl(tmp_path / "docs.jsonl", documents(40)), str(tmp_path / "hf")
    out = tmp_path / "out"
    fw.prepare(source, out, shard_tokens=50, cache_dir=cache)
    # a shard that does not match its sidecar (here: cut short) stops a restart and a training run
    with open(out / "train_000002.bin", "r+b") as f:
        f.truncate(60)
    for call in (lambda: fw.prepare(source, out, shard_tokens=50, cache_dir=cache),
                 lambda: dataio.open_split(out, "train")):
        with pytest.raises(UserError, match=r"shard .*train_000002.bin has 30 tokens but its sidecar says 50: delete"):
            call()
    # a field the corpus does not have (the documents are read in the pool's feeder thread: the error still comes)
    with pytest.raises(UserError, match=r"--text_field body: no such field in .*docs.jsonl; its fields are \['text'\]"):
        fw.prepare(source, tmp_path / "nofield", num_proc=2, text_field="body", cache_dir=cache)
    # a restart with settings that would give other shards
    with pytest.raises(UserError, match=r"prepared with other settings \(shard_tokens 50 -> 64\)"):
        fw.prepare(source, out, shard_tokens=64, cache_dir=cache)
    # a corpus smaller than the val shard
    with pytest.raises(UserError, match=r"not more than one shard of --shard_tokens 100,000"):
        fw.prepare(source, tmp_path / "small", shard_tokens=100_000, cache_dir=cache)
    # a tokenizer whose ids do not fit uint16 is refused before anything is written

    class Big:
        vocab_size = 70_000

    monkeypatch.setattr(fw, "gpt2_tokenizer", lambda: Big())
    with pytest.raises(UserError, match=r"the tokenizer has 70000 tokens, more than uint16 shards hold \(65536\)"):
        fw.prepare(source, tmp_path / "big", cache_dir=cache)
    assert not (tmp_path / "big").exists()


def one_line_error(main, capsys) -> list[str]:
    """Run a script's main as its `__main__` does; return the lines it printed on stderr (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(main)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_prepare_missing_corpus_is_a_one_line_error(tmp_path, capsys):
    argv = ["--source", str(tmp_path / "nowhere.jsonl"), "--out_dir", str(tmp_path / "out")]
    assert one_line_error(lambda: fw.main(argv), capsys) == [
        f"error: --source {tmp_path / 'nowhere.jsonl'}: no such file or folder; pass a .json/.jsonl/.txt/.parquet "
        "file or a folder of them"
    ]


# ----------------------------------------------------------------------------------------------- the loader


def make_sharded(data_dir, val: np.ndarray, train_parts: list[np.ndarray], vocab_size: int, meta: dict | None = None):
    """A sharded dataset written with dataio's writers, as prepare.py lays it out (`meta`: more meta.json keys)."""
    meta = {"tokenizer": "test", **(meta or {}), "vocab_size": vocab_size}
    names = []
    for i, part in enumerate([val, *train_parts]):
        name = f"{'val' if i == 0 else 'train'}_{i:06d}.bin"
        dataio.write_shard(data_dir / name, part, {"index": i, "tokenizer": meta["tokenizer"], "vocab_size": vocab_size})
        names.append(name)
    dataio.write_meta(data_dir, {**meta, "shards": {"val": names[:1], "train": names[1:]}})


@pytest.mark.slow
def test_sharded_split_reads_exactly_the_windows_of_its_concatenation(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 1000).astype(np.uint16)
    dataio.write_tokens(tmp_path / "train.bin", tokens)
    make_sharded(tmp_path / "shards", tokens[:50], [tokens[:300], tokens[300:550], tokens[550:]], 1000)
    split = dataio.open_split(tmp_path / "shards", "train", vocab_size=1000)
    crossed = 0
    for index in range(40):
        gen_args = (7, "train", 3, index)
        x, y = get_batch(split, 8, 64, batch_generator(*gen_args))
        x_bin, y_bin = get_batch(str(tmp_path / "train.bin"), 8, 64, batch_generator(*gen_args))
        assert torch.equal(x, x_bin) and torch.equal(y, y_bin)
        for row_x, row_y in zip(x.numpy(), y.numpy()):  # each window is a slice of the concatenated stream
            starts = [s for s in range(1000 - 64) if np.array_equal(tokens[s : s + 64], row_x)]
            assert starts and np.array_equal(tokens[starts[0] + 1 : starts[0] + 65], row_y)
            crossed += any(starts[0] < end < starts[0] + 65 for end in (300, 550))
    assert crossed > 10  # windows that run across a shard's end were read, and read right


def test_every_token_of_every_shard_is_reachable_and_no_window_leaves_the_stream(tmp_path):
    tokens = np.arange(400, dtype=np.uint16)  # token == position in the stream
    make_sharded(tmp_path, tokens[:40], [tokens[:130], tokens[130:131], tokens[131:]], 400)
    split = dataio.open_split(tmp_path, "train")
    seen = np.zeros(400, dtype=bool)
    for index in range(200):
        x, y = get_batch(split, 8, 16, batch_generator(0, "train", 0, index))
        assert torch.equal(x, x[:, :1] + torch.arange(16)) and torch.equal(y, x + 1)  # contiguous, in bounds
        seen[x.numpy().ravel()] = seen[y.numpy().ravel()] = True
    assert seen.all()  # the first and the last token, and the one-token shard
    with pytest.raises(UserError, match=r"the train split of .* \(3 shards\) has 400 tokens, too few for block_size=400"):
        get_batch(split, 1, 400, batch_generator(0, "train", 0, 0))


def test_two_ranks_read_what_one_rank_reads_in_two_micro_steps(tmp_path):
    make_sharded(tmp_path, np.arange(50, dtype=np.uint16), [np.arange(300, dtype=np.uint16)] * 3, 300)
    split = dataio.open_split(tmp_path, "train")
    cfg = tiny_config(tmp_path, tmp_path / "out", batch_size=4, block_size=32)
    for step in (0, 5):
        one_rank = train_batches(split, cfg, step, rank=0, accum_steps=2)
        two_ranks = train_batches(split, cfg, step, rank=0, accum_steps=1) + train_batches(split, cfg, step, 1, 1)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(one_rank, two_ranks))
        assert not torch.equal(one_rank[0][0], one_rank[1][0])
    assert not torch.equal(train_batches(split, cfg, 1, 0, 1)[0][0], train_batches(split, cfg, 0, 0, 1)[0][0])


def test_run_from_shards_resumed_equals_an_uninterrupted_run_from_train_bin(tmp_path):
    """The same tokens as train.bin/val.bin and as shards: 6 steps from train.bin == 3 steps from the shards and
    a resume for 3 more (bitwise: the same windows, and the data stream continues after the resume)."""
    bin_dir = tmp_path / "bin"
    meta = make_char_dataset(bin_dir, n_chars=20_000)
    tr, va = (np.fromfile(bin_dir / f"{s}.bin", dtype=np.uint16) for s in ("train", "val"))
    shard_dir = tmp_path / "shards"
    make_sharded(shard_dir, va, [tr[:5000], tr[5000:5001], tr[5001:]], meta["vocab_size"], meta=meta)
    common = dict(max_iters=6, lr_decay_iters=6, eval_interval=3, eval_iters=2, dropout=0.1)
    full = train(tiny_config(bin_dir, tmp_path / "full", **common))
    train(tiny_config(shard_dir, tmp_path / "split", **{**common, "max_iters": 3}))
    resumed = train(tiny_config(shard_dir, tmp_path / "split", **common, init_from="resume"))
    assert (resumed["last_loss"], resumed["val_loss"]) == (full["last_loss"], full["val_loss"])
    a, b = (load_checkpoint(str(tmp_path / d / "ckpt.pt"))["model"] for d in ("full", "split"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_is_a_one_line_error(tmp_path, capsys):
    d = tmp_path / "shardy"
    make_sharded(d, np.arange(100, dtype=np.uint16), [np.arange(100, dtype=np.uint16)] * 2, 100)
    os.remove(d / "train_000002.bin")
    args = config_args(tiny_config(d, tmp_path / "out"))
    assert one_line_error(lambda: train_main(args), capsys) == [
        f"error: missing shard {d / 'train_000002.bin'} (meta.json lists 2 train shards): rerun "
        "`python data/shardy/prepare.py`, which rewrites the shards from the first missing one"
    ]


def test_fineweb_config_is_build_nanogpts_recipe():
    from configurator import configure
    from nanogpt.config import TrainConfig
    from train import get_lr

    cfg = configure(TrainConfig(), [os.path.join(ROOT, "config", "train_gpt2_fineweb.py")])
    for world_size in (1, 2, 4, 8):
        cfg.check(world_size)
    assert cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size == 2**19  # 524,288 tokens per step
    assert (cfg.max_iters, cfg.warmup_iters, cfg.dataset, cfg.hellaswag) == (19073, 715, "fineweb_edu", True)
    assert get_lr(715, cfg) == 6e-4 and get_lr(19073, cfg) == pytest.approx(6e-5)  # max LR, cosine to 10%
    assert (cfg.weight_decay, cfg.beta1, cfg.beta2, cfg.dtype, cfg.compile, cfg.sdpa_backend) == (
        0.1, 0.9, 0.95, "bfloat16", True, "flash")
    assert cfg.vocab_padding_multiple == 64 and cfg.bias  # 50304 rows; GPT-2's biases
