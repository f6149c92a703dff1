"""Prepare tiny shakespeare in GPT-2 BPE (tiktoken): train.bin, val.bin (uint16 ids) and meta.json.

    python data/shakespeare/prepare.py [--input PATH] [--out_dir DIR]

The text is split 90/10 by characters, then each part is encoded on its own, as nanoGPT does; with tiny
shakespeare that gives 301,966 train and 36,059 val tokens. Where the text comes from: see
data/shakespeare_text.py. Offline, point TIKTOKEN_CACHE_DIR at a tiktoken cache holding the gpt2 files.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for nanogpt/ and data/
from nanogpt.errors import exit_on_user_error  # noqa: E402
from data.shakespeare_text import prepare_main, write_split  # noqa: E402
from nanogpt.tokenizers import gpt2_tokenizer  # noqa: E402

SCRIPT_DIR = Path(__file__).resolve().parent


def prepare(text: str, source: str, out_dir: Path) -> dict:
    tok = gpt2_tokenizer()
    # encode_ordinary: a literal "<|endoftext|>" in the corpus is text, not the special token
    return write_split(out_dir, text, tok.encode_ordinary, {"vocab_size": tok.vocab_size, "tokenizer": "gpt2",
                                                             "source": source})


def main(argv: list[str] | None = None) -> dict:
    return prepare_main(prepare, SCRIPT_DIR, __doc__, argv)


if __name__ == "__main__":
    exit_on_user_error(main)
