"""Prepare FineWeb-Edu's sample-10BT (or a local corpus) in GPT-2 BPE as shards of uint16 tokens, as build-nanogpt does.

    python data/fineweb_edu/prepare.py [--num_proc 8] [--shard_tokens 100000000] [--streaming] [--out_dir DIR]
    python data/fineweb_edu/prepare.py --source my_docs.jsonl --text_field body   # a local .json/.jsonl/.txt/.parquet

Each document is <|endoftext|> and its tokens; the stream fills shards of --shard_tokens one after another, the first
one val (val_000000.bin, train_000001.bin, ...), each with a JSON sidecar, listed in meta.json (sample-10BT: 100
shards of 200 MB). Interrupted, the same command continues after the last complete shard, with the same result as one
uninterrupted run; the options that decide the shards (source, name, text field, shard size) must not change.
HF `datasets` (any version with Dataset.skip) downloads the parquet files (tens of GB); --streaming reads them over
the network instead, and a restart then re-reads the documents it skips.
"""
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for nanogpt/ and data/
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from data.corpus import corpus_parser, eot_then_tokens, local_data_files, no_bars_in_logs, progress  # noqa: E402
from nanogpt.dataio import (GPT2_EOT, MAX_TOKEN_ID, load_meta, shard_info, sidecar_path,  # noqa: E402
                            write_meta, write_shard)
from nanogpt.tokenizers import gpt2_tokenizer  # noqa: E402

SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_SOURCE, DEFAULT_NAME = "HuggingFaceFW/fineweb-edu", "sample-10BT"
SHARD_TOKENS = 100_000_000
DOCS_PER_TASK = 256  # documents per pool task: large enough to amortise the pickling, small enough to spread
SETTINGS = ("source", "name", "text_field", "shard_tokens")  # what decides the shards


def shard_path(out_dir: Path, index: int) -> Path:
    return out_dir / f"{'val' if index == 0 else 'train'}_{index:06d}.bin"


def open_corpus(source: str, local: tuple[str, list[str]] | None, name: str | None, streaming: bool, num_proc: int,
                cache_dir: str | None) -> Any:
    from datasets import load_dataset  # slow to import; only this script needs it

    if local is not None:
        builder, files = local
        print(f"reading {len(files)} local {builder} file(s) from {source}")
        kwargs: dict[str, Any] = dict(data_files=files)
    else:
        print(f"reading hub dataset {source} ({name}){' streaming' if streaming else ''}")
        builder, kwargs = source, dict(name=name)
    if not streaming:
        kwargs["num_proc"] = num_proc
    try:
        return load_dataset(builder, split="train", streaming=streaming, cache_dir=cache_dir, **kwargs)
    except OSError as e:  # no network (ConnectionError), an unknown dataset or name (FileNotFoundError)
        if local is not None:
            raise
        raise UserError(f"cannot load hub dataset {source} ({name}) ({type(e).__name__}: {e}); check the network and "
                        "the names, or pass --source with a local .json/.jsonl/.txt/.parquet file or folder") from e


def text_batches(ds: Any, skip: int, text_field: str, source: str) -> Iterator[list[str]]:
    if ds.column_names is not None and text_field not in ds.column_names:  # None: a stream that does not say
        raise UserError(f"--text_field {text_field}: no such field in {source}; its fields are {ds.column_names}")
    if skip and skip >= getattr(ds, "num_rows", skip + 1):  # all read (Dataset.skip refuses; a stream just ends)
        return
    for batch in ds.skip(skip).select_columns([text_field]).iter(batch_size=DOCS_PER_TASK):
        yield batch[text_field]


def resume_point(out_dir: Path, settings: dict[str, Any]) -> tuple[list[dict[str, Any]], list[int]]:
    """The complete shards' sidecars and where the next shard starts: [document, token]. Later files are removed."""
    done: list[dict[str, Any]] = []
    while shard_path(out_dir, len(done)).is_file() and sidecar_path(shard_path(out_dir, len(done))).is_file():
        side = shard_info(shard_path(out_dir, len(done)))  # a shard that does not match its sidecar: UserError
        changed = [f"{k} {side.get(k)!r} -> {settings[k]!r}" for k in SETTINGS if side.get(k) != settings[k]]
        if changed:
            raise UserError(f"{out_dir} holds shards prepared with other settings ({'; '.join(changed)}): prepare "
                            "with the same settings to continue, or into another --out_dir")
        done.append(side)
    for stale in out_dir.glob("*_*.*"):  # a torn shard's temporary file, a shard whose sidecar was never written
        if stale.name.startswith(("val_", "train_")) and _index(stale) >= len(done):
            stale.unlink()
    return done, (list(done[-1]["end"]) if done else [0, 0])


def _index(path: Path) -> int:
    digits = path.name.split("_", 1)[1].split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


def prepare(source: str = DEFAULT_SOURCE, out_dir: str | os.PathLike[str] = SCRIPT_DIR, num_proc: int = 1,
            shard_tokens: int = SHARD_TOKENS, name: str | None = DEFAULT_NAME, text_field: str = "text",
            streaming: bool = False, cache_dir: str | None = None,
            on_batch: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Tokenize `source` into shards, after the complete ones already there; return meta. `on_batch(shard index,
    tokens buffered)` runs after each batch of documents (tests inject faults there)."""
    if num_proc < 1:
        raise UserError(f"--num_proc {num_proc} must be >= 1")
    if shard_tokens < 1:
        raise UserError(f"--shard_tokens {shard_tokens} must be >= 1 (build-nanogpt uses 100,000,000)")
    local = local_data_files(source)  # a missing local path fails here, before the tokenizer or any file
    tok = gpt2_tokenizer()
    if tok.vocab_size > MAX_TOKEN_ID + 1:  # uint16 shards: refuse, never truncate
        raise UserError(f"the tokenizer has {tok.vocab_size} tokens, more than uint16 shards hold ({MAX_TOKEN_ID + 1})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = dict(source=source if local is None else str(Path(source).expanduser().resolve()),
                    name=name if local is None else None, text_field=text_field, shard_tokens=shard_tokens)
    done, (doc, offset) = resume_point(out_dir, settings)
    if (out_dir / "meta.json").is_file():
        meta = load_meta(out_dir)
        names = [shard_path(out_dir, i).name for i in range(max(1, len(done)))]
        if meta.get("shards") == {"val": names[:1], "train": names[1:]}:
            print(f"{out_dir} is prepared already: its meta.json lists the {len(done)} complete shards there")
            return meta
    if done:
        print(f"continuing after {len(done)} complete shard(s), at document {doc:,}")
    no_bars_in_logs()
    ds = open_corpus(source, local, name, streaming, num_proc, cache_dir)

    buf = np.empty(shard_tokens, dtype=np.uint16)
    fill, start = 0, [doc, offset]  # tokens in buf; stream position of buf[0]
    bar = progress(unit="tok", unit_scale=True, desc="tokenizing", initial=sum(s["tokens"] for s in done))

    def flush() -> None:
        nonlocal fill, start
        index = len(done)
        info = dict(settings, index=index, split="val" if index == 0 else "train", tokenizer="gpt2",
                    vocab_size=tok.vocab_size, start=start, end=[doc, offset])
        done.append(write_shard(shard_path(out_dir, index), buf[:fill], info))
        fill, start = 0, [doc, offset]
        bar.set_postfix(shards=len(done))

    pool = multiprocessing.Pool(num_proc) if num_proc > 1 else None
    try:
        batches = text_batches(ds, doc, text_field, source)
        tokenized = pool.imap(eot_then_tokens, batches) if pool else map(eot_then_tokens, batches)
        for docs in tokenized:  # in the corpus' order: imap keeps it
            bar.update(sum(len(ids) for ids in docs) - offset)
            for ids in docs:
                ids = ids[offset:]  # the first document after a restart: what the last shard did not take
                while len(ids):
                    take = min(shard_tokens - fill, len(ids))
                    buf[fill : fill + take] = ids[:take]
                    fill, offset, ids = fill + take, offset + take, ids[take:]
                    if fill == shard_tokens:
                        flush()
                doc, offset = doc + 1, 0
            if on_batch is not None:
                on_batch(len(done), fill)
        if fill:
            flush()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()

    if len(done) < 2:
        raise UserError(f"--source {source} has {sum(s['tokens'] for s in done):,} tokens: not more than one shard "
                        f"of --shard_tokens {shard_tokens:,}, which is the val shard; prepare again into an empty "
                        "--out_dir with a lower --shard_tokens")
    shards = [shard_path(out_dir, i).name for i in range(len(done))]
    meta = dict(vocab_size=tok.vocab_size, tokenizer="gpt2", dtype="uint16", eot=GPT2_EOT, **settings,
                shards={"val": shards[:1], "train": shards[1:]}, val_tokens=done[0]["tokens"],
                train_tokens=sum(s["tokens"] for s in done[1:]), documents=doc)
    write_meta(out_dir, meta)
    return meta


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = corpus_parser(__doc__, DEFAULT_SOURCE, SCRIPT_DIR, "the shards and meta.json")
    parser.add_argument("--name", default=DEFAULT_NAME, help="the hub dataset's config (ignored for local files)")
    parser.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS, help="tokens per shard")
    parser.add_argument("--streaming", action="store_true", help="stream the hub dataset instead of downloading it")
    args = parser.parse_args(argv)
    meta = prepare(args.source, args.out_dir, args.num_proc, args.shard_tokens, args.name, args.text_field,
                   args.streaming)
    print(f"{meta['documents']:,} documents: val {meta['val_tokens']:,} tokens in 1 shard, train "
          f"{meta['train_tokens']:,} tokens in {len(meta['shards']['train'])} shards, in {args.out_dir}")
    return meta


if __name__ == "__main__":
    exit_on_user_error(main)
