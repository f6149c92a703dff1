"""Dataset files and tokenizers: the one place that reads and writes data/<dataset>/.

Layout of a prepared dataset (nanoGPT compatible, except that the metadata is JSON, not pickle):

    data/<dataset>/train.bin   raw uint16 token ids, no header
    data/<dataset>/val.bin     same
    data/<dataset>/meta.json   {"vocab_size", "tokenizer": "char"|"gpt2", "itos" (char only),
                                "train_tokens", "val_tokens", "dtype": "uint16", "source"}
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from common import UserError

DTYPE = np.uint16
MAX_TOKEN_ID = int(np.iinfo(DTYPE).max)  # 65535
GPT2_EOT = 50256
CHECK_CHUNK = 2**24  # tokens per chunk when scanning a token file for its max id


def _prepare_hint(data_dir: str | os.PathLike[str]) -> str:
    return f"run `python data/{Path(data_dir).name}/prepare.py` first"


def _fsync_replace(tmp: Path, path: Path) -> None:
    """Make `tmp` durable, then give it its final name, so readers never see a half-written file."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _check_id_range(arr: np.ndarray, what: str) -> None:
    if arr.size == 0:
        return
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        raise UserError(f"{what}: token id {lo} is negative; token ids must be in [0, {MAX_TOKEN_ID}]")
    if hi > MAX_TOKEN_ID:
        raise UserError(
            f"{what}: max token id {hi} does not fit in uint16 (max {MAX_TOKEN_ID}); "
            "use a tokenizer with at most 65536 tokens"
        )


def write_tokens(path: str | os.PathLike[str], ids: Iterable[int] | np.ndarray) -> int:
    """Write token ids as raw uint16 to `path` (through a temporary file); return the number written."""
    path = Path(path)
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
    _check_id_range(arr, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    arr.astype(DTYPE).tofile(tmp)
    _fsync_replace(tmp, path)
    return int(arr.size)


class TokenWriter:
    """Fill a uint16 token file of known total length batch by batch, as nanoGPT's openwebtext prepare does.

    The file is a memmap preallocated to `total` tokens under a temporary name; `close()` checks that
    exactly `total` tokens were written and only then renames it, so an interrupted run leaves no
    `train.bin` that looks complete. Use as a context manager: an exception removes the temporary file.
    """

    def __init__(self, path: str | os.PathLike[str], total: int) -> None:
        self.path = Path(path)
        self.total = int(total)
        self.written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        # np.memmap cannot map an empty file, so an empty split is just an empty file
        self._arr: np.memmap | None = None
        if self.total > 0:
            self._arr = np.memmap(self._tmp, dtype=DTYPE, mode="w+", shape=(self.total,))
        else:
            self._tmp.write_bytes(b"")

    def write(self, ids: np.ndarray | Iterable[int]) -> None:
        """Append a batch of token ids."""
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if self.written + arr.size > self.total:
            raise ValueError(f"{self.path}: writing {arr.size} more tokens overflows the {self.total} preallocated")
        if arr.size == 0:
            return
        _check_id_range(arr, str(self.path))
        if self._arr is None:  # cannot happen: total > 0 whenever arr.size > 0 fits
            raise RuntimeError(f"{self.path}: no buffer to write into")
        self._arr[self.written : self.written + arr.size] = arr
        self.written += arr.size

    def close(self) -> None:
        """Flush, check the count, and move the file to its final name."""
        if self.written != self.total:
            raise ValueError(f"{self.path}: wrote {self.written} tokens, expected {self.total}")
        if self._arr is not None:
            self._arr.flush()
            self._arr = None  # drop the mapping before the rename
        _fsync_replace(self._tmp, self.path)

    def abort(self) -> None:
        """Drop the temporary file."""
        self._arr = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_meta(data_dir: str | os.PathLike[str], meta: dict[str, Any]) -> Path:
    """Write `meta` as data_dir/meta.json (through a temporary file); return its path."""
    path = Path(data_dir) / "meta.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _fsync_replace(tmp, path)
    return path


def load_meta(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Read data_dir/meta.json; a missing or malformed file is a UserError that says how to make it."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise UserError(f"no meta.json in {data_dir}: {_prepare_hint(data_dir)}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}): delete it and {_prepare_hint(data_dir)}") from e
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a {type(meta).__name__}, not a JSON object: {_prepare_hint(data_dir)}")
    missing = [k for k in ("vocab_size", "tokenizer") if k not in meta]
    if missing:
        raise UserError(f"{path} lacks key(s) {', '.join(missing)}: {_prepare_hint(data_dir)}")
    return meta


def open_tokens(path: str | os.PathLike[str], vocab_size: int | None = None) -> np.memmap:
    """Map a token file read-only; with `vocab_size`, also check that every id is below it."""
    path = Path(path)
    hint = _prepare_hint(path.parent)
    if not path.is_file():
        raise UserError(f"missing {path}: {hint}")
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"{path} is empty (0 tokens): {hint} again")
    itemsize = np.dtype(DTYPE).itemsize
    if size % itemsize:
        raise UserError(
            f"{path} has {size} bytes, not a whole number of uint16 tokens ({itemsize} bytes each): "
            f"the file is truncated or not a token file; {hint} again"
        )
    arr = np.memmap(path, dtype=DTYPE, mode="r")
    if vocab_size is not None:
        max_id = max(int(arr[i : i + CHECK_CHUNK].max()) for i in range(0, len(arr), CHECK_CHUNK))
        if max_id >= vocab_size:
            raise UserError(
                f"{path} holds token id {max_id} but the vocab size is {vocab_size}: the tokens were written "
                f"with another tokenizer than meta.json describes; {hint} again"
            )
    return arr


class Tokenizer(Protocol):
    """What train/sample need from a tokenizer."""

    vocab_size: int
    eot: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class CharTokenizer:
    """One token per character, over the dataset's own character set (`itos`)."""

    def __init__(self, itos: list[str]) -> None:
        self.itos = list(itos)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.vocab_size = len(self.itos)
        self.eot: int | None = None

    def encode(self, text: str) -> list[int]:
        missing = set(text) - self.stoi.keys()
        if missing:
            shown = ", ".join(repr(c) for c in sorted(missing))
            raise UserError(
                f"character(s) {shown} not in the vocabulary: a char-level model knows only its dataset's "
                f"{self.vocab_size} characters; remove them from the text"
            )
        stoi = self.stoi
        return [stoi[c] for c in text]

    encode_ordinary = encode

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            bad = int(ids.max()) if ids.max() >= self.vocab_size else int(ids.min())
            raise UserError(f"token id {bad} is outside the char vocabulary of {self.vocab_size} characters")
        itos = self.itos
        return "".join([itos[i] for i in ids.tolist()])


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken: 50257 tokens, <|endoftext|> = 50256."""

    def __init__(self) -> None:
        import tiktoken

        try:
            self.enc = tiktoken.get_encoding("gpt2")
        except (OSError, ValueError) as e:  # requests' errors are OSErrors; a bad cache file is a ValueError
            raise UserError(
                f"cannot load the GPT-2 BPE with tiktoken ({type(e).__name__}: {e}); allow the download, or set "
                "TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's cache files for gpt2"
            ) from e
        self.vocab_size = self.enc.n_vocab
        self.eot: int | None = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        """Encode a prompt: the literal "<|endoftext|>" becomes the end-of-text token."""
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode corpus text: special-token strings in it are ordinary text."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the GPT-2 vocabulary of {self.vocab_size} tokens")
        return self.enc.decode(ids)


@lru_cache(maxsize=1)
def gpt2_tokenizer() -> GPT2Tokenizer:
    """The GPT-2 tokenizer, e.g. to sample from GPT-2 weights when there is no meta.json."""
    return GPT2Tokenizer()


def get_tokenizer(meta: dict[str, Any]) -> CharTokenizer | GPT2Tokenizer:
    """The tokenizer that meta.json describes."""
    kind = meta.get("tokenizer")
    if kind == "gpt2":
        return gpt2_tokenizer()
    if kind == "char":
        itos = meta.get("itos")
        if not isinstance(itos, list) or not all(isinstance(c, str) and len(c) == 1 for c in itos):
            raise UserError("meta.json of a char tokenizer needs 'itos', a list of single characters: rerun prepare.py")
        if meta.get("vocab_size", len(itos)) != len(itos):
            raise UserError(
                f"meta.json says vocab_size {meta['vocab_size']} but 'itos' has {len(itos)} characters: "
                "rerun prepare.py"
            )
        return CharTokenizer(itos)
    raise UserError(f"meta.json tokenizer {kind!r} is unknown: expected 'char' or 'gpt2'")
