"""Prepare OpenWebText (or any document corpus) in GPT-2 BPE: train.bin, val.bin (uint16 ids) and meta.json.

    python data/openwebtext/prepare.py [--source Skylion007/openwebtext] [--num_proc 8] [--out_dir DIR]
    python data/openwebtext/prepare.py --source my_docs.jsonl --text_field body

Each document is encoded (tiktoken's encode_ordinary) and followed by <|endoftext|>; a random 0.05% of the documents
(seed 2357) are val, as nanoGPT does (~9B train and ~4M val tokens for the full corpus). datasets >= 4 refuses
nanoGPT's dataset script, so the hub dataset is read from its Parquet copy (revision refs/convert/parquet). --source
may name a local file or folder of .json/.jsonl (the text under --text_field), .txt (a document per line) or .parquet.
"""
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for nanogpt/ and data/
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from data.corpus import corpus_parser, local_data_files, no_bars_in_logs, progress  # noqa: E402
from nanogpt.dataio import GPT2_EOT, TokenWriter, write_meta  # noqa: E402
from nanogpt.tokenizers import gpt2_tokenizer  # noqa: E402

SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_SOURCE = "Skylion007/openwebtext"
DEFAULT_REVISION = "refs/convert/parquet"
VAL_WARN_TOKENS = 1024  # GPT-2's block: a val split shorter than one window gives no val loss worth reading
WRITE_SHARDS = 1024  # the splits are copied into the memmaps this many contiguous pieces at a time


def load_documents(source: str, local: tuple[str, list[str]] | None, num_proc: int, text_field: str,
                   revision: str | None, cache_dir: str | None) -> Any:
    from datasets import load_dataset  # slow to import; only this script needs it

    if local is None:
        print(f"loading hub dataset {source} at revision {revision}")
        try:
            ds = load_dataset(source, revision=revision, split="train", num_proc=num_proc, cache_dir=cache_dir)
        except OSError as e:  # no network (ConnectionError), unknown dataset or revision (FileNotFoundError)
            raise UserError(f"cannot load hub dataset {source} at revision {revision} ({type(e).__name__}: {e}); "
                            "check the network and the names, or pass --source with a local .json/.jsonl/.txt/.parquet "
                            "file or folder") from e
    else:
        builder, files = local
        if builder == "text" and text_field != "text":
            raise UserError(f"--text_field {text_field}: .txt files have one document per line in field 'text'; "
                            "drop --text_field")
        print(f"loading {len(files)} local {builder} file(s) from {source}")
        ds = load_dataset(builder, data_files=files, split="train", num_proc=num_proc, cache_dir=cache_dir)
    if text_field not in ds.column_names:
        raise UserError(f"--text_field {text_field}: no such field in {source}; its fields are {ds.column_names}")
    return ds


def tokenize_batch(batch: dict[str, list], text_field: str) -> dict[str, list]:
    """datasets.map function: each document's GPT-2 ids and <|endoftext|>, and their count."""
    enc = gpt2_tokenizer()  # cached per worker process
    ids = [enc.encode_ordinary(text) + [GPT2_EOT] for text in batch[text_field]]
    return {"ids": ids, "len": [len(x) for x in ids]}


def write_split(dset: Any, path: Path) -> int:
    """The split's tokens into one uint16 file, a contiguous piece at a time; returns how many."""
    total = int(np.sum(dset.with_format("numpy")["len"], dtype=np.uint64))
    n_shards = max(1, min(WRITE_SHARDS, len(dset)))  # a tiny corpus has fewer documents than 1024
    with TokenWriter(path, total) as writer:
        for i in progress(range(n_shards), desc=f"writing {path}"):
            batch = dset.shard(num_shards=n_shards, index=i, contiguous=True).with_format("numpy")
            if len(batch):
                writer.write(np.concatenate(list(batch["ids"])))
    return total


def prepare(source: str, out_dir: str | os.PathLike[str], num_proc: int, val_fraction: float = 0.0005,
            seed: int = 2357, text_field: str = "text", revision: str | None = DEFAULT_REVISION,
            cache_dir: str | None = None) -> dict[str, Any]:
    """Tokenize `source` into out_dir/{train.bin,val.bin,meta.json}; return meta. `revision`: hub datasets only."""
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction {val_fraction} must be between 0 and 1 (nanoGPT uses 0.0005)")
    if num_proc < 1:
        raise UserError(f"num_proc {num_proc} must be >= 1")
    no_bars_in_logs()
    out_dir = Path(out_dir)
    local = local_data_files(source)
    ds = load_documents(source, local, num_proc, text_field, revision, cache_dir)
    if len(ds) < 2:
        raise UserError(f"--source {source} has {len(ds)} document(s): need at least 2 to split into train and val")

    # train_test_split puts at least one document in val however small the fraction
    split = ds.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
    split["val"] = split.pop("test")
    tokenized = split.map(tokenize_batch, batched=True, fn_kwargs={"text_field": text_field},
                          remove_columns=ds.column_names, desc="tokenizing the splits", num_proc=num_proc)

    meta: dict[str, Any] = {"vocab_size": gpt2_tokenizer().vocab_size, "tokenizer": "gpt2"}
    for name, dset in tokenized.items():
        meta[f"{name}_tokens"] = write_split(dset, out_dir / f"{name}.bin")
        meta[f"{name}_documents"] = len(dset)
    meta.update(dtype="uint16", source=source if local is None else str(Path(source).expanduser().resolve()),
                revision=revision if local is None else None, text_field=text_field, val_fraction=val_fraction,
                seed=seed, eot=GPT2_EOT)
    write_meta(out_dir, meta)
    if meta["val_tokens"] < VAL_WARN_TOKENS:
        print(f"warning: the val split has {meta['val_tokens']:,} tokens ({meta['val_documents']} document(s)), fewer "
              f"than one {VAL_WARN_TOKENS}-token window of GPT-2: its val loss will be noise or refused; raise "
              f"--val_fraction (now {val_fraction}) for a corpus this small", file=sys.stderr)
    return meta


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = corpus_parser(__doc__, DEFAULT_SOURCE, SCRIPT_DIR, "train.bin, val.bin, meta.json")
    parser.add_argument("--revision", default=DEFAULT_REVISION, help="hub revision (ignored for local files)")
    parser.add_argument("--val_fraction", type=float, default=0.0005, help="share of documents held out as val")
    parser.add_argument("--seed", type=int, default=2357, help="seed of the train/val shuffle")
    args = parser.parse_args(argv)
    meta = prepare(args.source, args.out_dir, args.num_proc, args.val_fraction, args.seed, args.text_field,
                   args.revision)
    print(f"train has {meta['train_tokens']:,} tokens in {meta['train_documents']:,} documents")
    print(f"val has {meta['val_tokens']:,} tokens in {meta['val_documents']:,} documents")
    print(f"wrote {args.out_dir}/{{train.bin,val.bin,meta.json}}")
    return meta


if __name__ == "__main__":
    exit_on_user_error(main)
