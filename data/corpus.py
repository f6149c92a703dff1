"""What the corpus prepare scripts (openwebtext, fineweb_edu) share, among it the tokenizer worker their process pools
run (in a module of its own, so that workers can import it)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from nanogpt.errors import UserError
from nanogpt.dataio import GPT2_EOT
from nanogpt.tokenizers import gpt2_tokenizer

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".txt": "text", ".parquet": "parquet"}


def local_data_files(source: str) -> tuple[str, list[str]] | None:
    """(datasets builder name, files) for a local file or folder; None if `source` is a hub dataset id."""
    path = Path(source).expanduser()
    looks_local = source.startswith((".", "/", "~")) or path.suffix in LOCAL_FORMATS
    if not path.exists():
        if looks_local:
            raise UserError(f"--source {source}: no such file or folder; pass a .json/.jsonl/.txt/.parquet file or a "
                            "folder of them")
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in LOCAL_FORMATS)
    builders = {LOCAL_FORMATS.get(p.suffix) for p in files}
    if not files or None in builders:
        found = [p.name for p in files[:5]]
        raise UserError(f"--source {source}: expected .json/.jsonl/.txt/.parquet files, found {found}")
    if len(builders) > 1:
        raise UserError(f"--source {source}: mixes formats {sorted(builders)}; put files of one format in a folder")
    return builders.pop(), [str(p) for p in files]


def eot_then_tokens(texts: list[str]) -> list[np.ndarray]:
    """Per document: <|endoftext|> then its GPT-2 ids as uint16 (the caller checked the vocabulary fits)."""
    enc = gpt2_tokenizer()  # cached per worker process
    return [np.array([GPT2_EOT, *enc.encode_ordinary(text)], dtype=np.uint16) for text in texts]


def corpus_parser(description: str, default_source: str, out_dir: Path, writes: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=default_source, help="hub dataset id, or a local file or folder")
    parser.add_argument("--text_field", default="text", help="the field that holds each document's text")
    parser.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="worker processes")
    parser.add_argument("--out_dir", default=str(out_dir), help=f"where to write {writes}")
    return parser


def progress(iterable=None, desc: str = "", **kwargs):
    """A tqdm progress bar on a terminal; in a log (stderr not a terminal), one line for the stage instead."""
    from tqdm import tqdm

    if sys.stderr.isatty():
        return tqdm(iterable, desc=desc, **kwargs)
    print(f"{desc}...", flush=True)
    return tqdm(iterable, desc=desc, disable=True, **kwargs)


def no_bars_in_logs() -> None:
    """HF datasets' own progress bars off where stderr is not a terminal."""
    if not sys.stderr.isatty():
        try:
            import datasets

            datasets.disable_progress_bars()
        except ImportError:
            pass
