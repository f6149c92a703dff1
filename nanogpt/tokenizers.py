"""The tokenizers (per character over a dataset's own characters, or GPT-2 BPE through tiktoken), which one meta.json
or a checkpoint names, and the check that weights train only on data of their own tokenizer."""
from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any, Callable, Protocol

import numpy as np

from nanogpt.dataio import dataset_dir, find_meta, meta_problem, tokenizer_meta
from nanogpt.errors import UserError


class Tokenizer(Protocol):
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
            raise UserError(f"character(s) {shown} not in the vocabulary: a char-level model knows only its "
                            f"dataset's {self.vocab_size} characters; remove them from the text")
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
            raise UserError(f"cannot load the GPT-2 BPE with tiktoken ({type(e).__name__}: {e}); allow the download, "
                            "or set TIKTOKEN_CACHE_DIR to a folder that holds tiktoken's cache files for gpt2") from e
        self.vocab_size = self.enc.n_vocab
        self.eot: int | None = self.enc.eot_token

    def encode(self, text: str) -> list[int]:
        """A prompt: the literal "<|endoftext|>" is the end-of-text token."""
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def encode_ordinary(self, text: str) -> list[int]:
        """Corpus text: special-token strings in it are ordinary text."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the GPT-2 vocabulary of {self.vocab_size} tokens")
        return self.enc.decode(ids)


@lru_cache(maxsize=1)
def gpt2_tokenizer() -> GPT2Tokenizer:
    return GPT2Tokenizer()


def get_tokenizer(meta: dict[str, Any]) -> CharTokenizer | GPT2Tokenizer:
    kind = meta.get("tokenizer")
    if kind == "gpt2":
        return gpt2_tokenizer()
    if kind == "char":
        if (why := meta_problem(meta)) is not None:
            raise UserError(f"meta.json: {why}: rerun prepare.py")
        return CharTokenizer(meta["itos"])
    raise UserError(f"meta.json tokenizer {kind!r} is unknown: expected 'char' or 'gpt2'")


def recorded_meta(ckpt: dict[str, Any]) -> tuple[dict | None, str]:
    """The tokenizer a checkpoint's model was trained with and where that was found: the one it records, else its
    dataset's meta.json; (None, why) when neither is there (nanoGPT's GPT-2 BPE runs name none)."""
    if ckpt.get("meta"):
        meta = ckpt["meta"]
        if not (isinstance(meta, dict) and meta.get("tokenizer") in ("char", "gpt2")
                and type(meta.get("vocab_size")) is int and meta["vocab_size"] >= 1):
            raise UserError(f"the checkpoint records a tokenizer that is not one ({str(meta)[:80]}): restore the "
                            f"checkpoint from a backup")
        return meta, "recorded in the checkpoint"
    run_config = ckpt.get("config") or {}
    if "dataset" not in run_config and not run_config.get("data_dir"):
        return None, "the checkpoint names no dataset"
    data_dir = dataset_dir(run_config.get("dataset", ""), run_config.get("data_dir"))
    meta = find_meta(data_dir)
    return (tokenizer_meta(meta), f"from {data_dir}") if meta else (None, f"no tokenizer description in {data_dir}")


def checkpoint_tokenizer(ckpt: dict[str, Any], log: Callable[[str], None] = print) -> Tokenizer:
    """recorded_meta's tokenizer, else GPT-2 BPE (nanoGPT's checkpoints of GPT-2 BPE data name none)."""
    meta, where = recorded_meta(ckpt)
    if meta is None:
        log(f"tokenizer: GPT-2 BPE ({where})")
        return gpt2_tokenizer()
    log(f"tokenizer: {meta['tokenizer']} ({meta['vocab_size']} tokens, {where})")
    return get_tokenizer(meta)


def check_tokenizer(model_vocab: int, model_meta: dict | None, meta: dict, source: str, dataset: str) -> None:
    """A model trains on a dataset only with its own tokenizer (when known) and a vocabulary that holds every id;
    more rows are fine for BPE (nanoGPT's GPT-2 runs have 50304 for its 50257 tokens)."""
    problem = None
    if model_meta is not None and (model_meta["tokenizer"], model_meta.get("itos")) != (meta["tokenizer"],
                                                                                      meta.get("itos")):
        problem = "the tokenizers differ" if model_meta["tokenizer"] != meta["tokenizer"] else "the characters differ"
    elif model_vocab < meta["vocab_size"] or (model_vocab > meta["vocab_size"] and meta["tokenizer"] != "gpt2"):
        problem = "the vocabulary sizes differ"
    if problem is None:
        return
    what = f"{model_meta['tokenizer']}, {model_vocab} tokens" if model_meta else f"{model_vocab} tokens"
    raise UserError(
        f"{source} was trained with another tokenizer ({what}) than dataset {dataset!r} ({meta['tokenizer']}, "
        f"{meta['vocab_size']} tokens): {problem}; train it on a dataset prepared with its tokenizer (GPT-2 "
        f"weights: GPT-2 BPE, e.g. data/shakespeare/prepare.py), or start from scratch"
    )
