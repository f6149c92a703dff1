"""Prepare tiny shakespeare for character-level training: train.bin, val.bin (uint16 ids) and meta.json.

    python data/shakespeare_char/prepare.py [--input PATH] [--out_dir DIR]

With tiny shakespeare: 65 characters, 1,003,854 train and 111,540 val tokens (the first 90% / last 10%).
Where the text comes from: see data/shakespeare_text.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for nanogpt/ and data/
from nanogpt.errors import exit_on_user_error  # noqa: E402
from data.shakespeare_text import prepare_main, write_split  # noqa: E402
from nanogpt.tokenizers import get_tokenizer  # noqa: E402

SCRIPT_DIR = Path(__file__).resolve().parent


def prepare(text: str, source: str, out_dir: Path) -> dict:
    chars = sorted(set(text))  # the vocabulary, ordered as nanoGPT orders it
    meta = {"vocab_size": len(chars), "tokenizer": "char", "itos": chars}
    return write_split(out_dir, text, get_tokenizer(meta).encode, {**meta, "source": source})


def main(argv: list[str] | None = None) -> dict:
    return prepare_main(prepare, SCRIPT_DIR, __doc__, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
