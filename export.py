"""
Export a checkpoint as a Hugging Face GPT-2 folder (GPT2LMHeadModel), for lm-evaluation-harness, vLLM, TGI, the Hub.

$ python export.py --out_dir=out-shakespeare --to=hf-shakespeare
$ python export.py --out_dir=out-shakespeare-char --ckpt=ckpt_best.pt --to=hf-char

The folder gets config.json, model.safetensors (float32, as trained), generation_config.json and, for a GPT-2 BPE
run, the tokenizer files (tiktoken's "gpt2" encoding is HF's `gpt2` tokenizer: its vocab.json and merges.txt are
tiktoken's encoder.json and vocab.bpe, read from tiktoken's cache), for a char-level run its meta.json (HF has no
tokenizer for it; sample.py and hellaswag.py read it). Works for this repo's checkpoints (ckpt.pt,
ckpt_best.pt, an FSDP run's sharded folder) and for nanoGPT's ckpt.pt. The padded vocabulary rows are dropped
(50304 -> 50257); GELU "tanh" becomes HF's gelu_new, "erf" its gelu; a model without biases gets zero biases where
GPT-2's layout has them. A setting that GPT-2 in transformers cannot express is refused, never exported wrong.
The files are written into a temporary folder inside the target first and renamed into it once all are written
(files.write_files): a write that fails (a full disk) is one line, exit status 2, and leaves the target as it was.

Config: the ExportConfig defaults below, then config files and --key=value overrides in the order given.

Reads checkpoints through checkpoints.py; imports nothing from train.py or sample.py.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import torch

from nanogpt import checkpoints, dataio, files, outdir, tokenizers
from nanogpt.checkpoint_file import checkpoint_model_config, clean_state_dict
from nanogpt.config import Folder, check, declared_problems
from nanogpt.errors import UserError, exit_on_user_error
from configurator import configure
from model import HF_CONV1D_WEIGHTS, GPTConfig

GPT2_BPE_FILES = {  # HF's file name: the URL tiktoken's gpt2 encoding reads (and caches) it from
    "vocab.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "merges.txt": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
}
HF_ACTIVATION = {"tanh": "gelu_new", "erf": "gelu"}  # GPTConfig.gelu -> the name HF writes (model.HF_ACTIVATIONS reads)
# model_args keys with a GPT-2 equivalent. The attention path and kernel change nothing that the weights compute;
# dropout is a training setting (HF's *_pdrop); anything else (a setting added later) must be mapped here first.
EXPRESSIBLE = {"block_size", "vocab_size", "vocab_padding_multiple", "n_layer", "n_head", "n_embd", "dropout", "bias",
               "attention", "sdpa_backend", "gelu", "fused_loss"}  # fused_loss: older checkpoints' loss setting
# every name an export writes: an earlier export's file that this one does not write is removed (files.write_files),
# so that no tokenizer or weights of another model stay beside this one
EXPORT_FILES = re.compile(r"config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?"
                          r"|vocab\.json|merges\.txt|tokenizer(_config)?\.json|special_tokens_map\.json"
                          r"|added_tokens\.json|meta\.json")


@dataclass
class ExportConfig:
    out_dir: Folder = "out"  # the training run's folder
    ckpt: str | None = None  # in out_dir; None: the newest; ckpt_best.pt or ckpt_sharded_best: the best val loss's
    to: str = ""  # the folder to write (created; an earlier export there is replaced whole or not at all)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_expressible(model_args: dict) -> None:
    """One UserError naming every setting that GPT2LMHeadModel cannot express."""
    unknown = sorted(set(model_args) - EXPRESSIBLE)
    if unknown:
        shown = ", ".join(f"{k}={model_args[k]!r}" for k in unknown)
        raise UserError(f"cannot export: {shown} has no equivalent in HF's GPT-2 (GPT2LMHeadModel), so the exported "
                        f"model would compute something else; export.py must learn to map it first")


def real_vocab_size(config: GPTConfig, tokenizer: tokenizers.Tokenizer | None) -> int:
    """The number of real tokens: the config's vocab_size, except for nanoGPT's GPT-2-sized runs, whose
    vocab_size is 50304 rows for GPT-2 BPE's 50257 tokens."""
    if isinstance(tokenizer, tokenizers.GPT2Tokenizer) and config.vocab_size > tokenizer.vocab_size:
        return tokenizer.vocab_size
    return config.vocab_size


def hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our state dict -> GPT2LMHeadModel's: the first vocab_size embedding rows, Conv1D weights as (in, out),
    zero biases where the model has none."""
    state = clean_state_dict(state)
    if "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]):
        raise UserError("cannot export: lm_head.weight differs from transformer.wte.weight, and GPT-2 ties them")
    C = config.n_embd
    out = {
        "transformer.wte.weight": state["transformer.wte.weight"][:vocab_size],
        "transformer.wpe.weight": state["transformer.wpe.weight"],
    }
    biases = {"ln_1": C, "attn.c_attn": 3 * C, "attn.c_proj": C, "ln_2": C, "mlp.c_fc": 4 * C, "mlp.c_proj": C}
    for i in range(config.n_layer):
        for name, size in biases.items():
            prefix = f"transformer.h.{i}.{name}"
            w = state[f"{prefix}.weight"]
            out[f"{prefix}.weight"] = w.t() if f"{prefix}.weight".endswith(HF_CONV1D_WEIGHTS) else w  # (out, in) -> (in, out)
            out[f"{prefix}.bias"] = state.get(f"{prefix}.bias", torch.zeros(size, dtype=w.dtype))
    ln_f = state["transformer.ln_f.weight"]
    out["transformer.ln_f.weight"] = ln_f
    out["transformer.ln_f.bias"] = state.get("transformer.ln_f.bias", torch.zeros(C, dtype=ln_f.dtype))
    return {k: v.float().contiguous() for k, v in out.items()}


def export(ckpt: dict, folder: str, tokenizer: tokenizers.Tokenizer | None) -> "GPT2LMHeadModel":  # noqa: F821
    """Write the checkpoint as a HF GPT-2 folder; returns the HF model that was saved."""
    from transformers import GPT2Config, GPT2LMHeadModel

    check_expressible(ckpt["model_args"])
    config = checkpoint_model_config(ckpt["model_args"])
    vocab_size = real_vocab_size(config, tokenizer)
    eot = tokenizer.eot if tokenizer is not None and tokenizer.eot is not None and tokenizer.eot < vocab_size else None
    hf_config = GPT2Config(
        vocab_size=vocab_size, n_positions=config.block_size, n_embd=config.n_embd, n_layer=config.n_layer,
        n_head=config.n_head, activation_function=HF_ACTIVATION[config.gelu], resid_pdrop=config.dropout,
        embd_pdrop=config.dropout, attn_pdrop=config.dropout, layer_norm_epsilon=1e-5, bos_token_id=eot,
        eos_token_id=eot, tie_word_embeddings=True,
    )
    hf_model = GPT2LMHeadModel(hf_config)
    weights = hf_state_dict(ckpt["model"], config, vocab_size)
    missing, unexpected = hf_model.load_state_dict(weights, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:  # lm_head is tied to wte
        raise UserError(f"cannot export: GPT-2's keys differ: missing {sorted(missing)[:4]}, "
                        f"unexpected {unexpected[:4]}")
    hf_model.tie_weights()
    hf_model.save_pretrained(folder)
    return hf_model


def write_tokenizer(folder: str, tokenizer: tokenizers.Tokenizer | None, block_size: int, shown: str | None = None) -> str:
    """The HF tokenizer files for a GPT-2 BPE run, a char-level run's meta.json (HF has no tokenizer for it, sample.py
    and hellaswag.py read it); returns a note for the user, which names the folder as `shown` (the export's --to,
    where `folder` is where it is written first)."""
    if isinstance(tokenizer, tokenizers.CharTokenizer):
        dataio.write_meta(folder, {"vocab_size": tokenizer.vocab_size, "tokenizer": "char", "itos": tokenizer.itos})
        return f"tokenizer: the run's {tokenizer.vocab_size} characters in meta.json (for sample.py, hellaswag.py)"
    if not isinstance(tokenizer, tokenizers.GPT2Tokenizer):
        return "no HF tokenizer fits this vocabulary (not GPT-2 BPE): the folder has no tokenizer files"
    import tiktoken.load
    from transformers import GPT2TokenizerFast

    try:
        files = {name: tiktoken.load.read_file_cached(url) for name, url in GPT2_BPE_FILES.items()}  # its cache, else
    except (OSError, ValueError) as e:                                                                # its download
        return (f"GPT-2 BPE files not available ({type(e).__name__}), so the folder has no tokenizer: add it with "
                f"python -c \"from transformers import AutoTokenizer; "
                f"AutoTokenizer.from_pretrained('gpt2').save_pretrained('{shown or folder}')\"")
    for name, data in files.items():  # a failed write is the export's failure, not a missing tokenizer
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    # read back as HF reads GPT-2's files (the constructor's arguments differ between transformers versions),
    # then saved with tokenizer.json and tokenizer_config.json
    GPT2TokenizerFast.from_pretrained(folder, model_max_length=block_size).save_pretrained(folder)
    return "tokenizer: GPT-2 BPE (HF's gpt2 tokenizer)"


def main(argv: list[str] | None = None) -> None:
    cfg = configure(ExportConfig(), sys.argv[1:] if argv is None else argv)
    if not cfg.to:
        raise UserError("to='' : name the folder to write, e.g. --to=hf-model")
    check(declared_problems(cfg))
    if os.path.lexists(cfg.to) and not os.path.isdir(cfg.to):
        raise UserError(f"to={cfg.to!r} is a file, not a folder: give a folder to write the model in")
    if run := outdir.run_files_in(cfg.to):  # --init_from=FOLDER would then read the HF files, not the checkpoint
        raise UserError(f"to={cfg.to!r} is a training run's folder ({', '.join(run)}): give the export a folder of "
                        f"its own, e.g. --to=hf-model")
    found = checkpoints.find_checkpoint(cfg.out_dir, cfg.ckpt)
    path = found.path
    ckpt = checkpoints.read_weights(path, found.state)  # mapped, weights only (a sharded folder gathered on the CPU)
    check_expressible(ckpt["model_args"])
    log(f"checkpoint: {path} at iter {ckpt['iter_num']}")
    tokenizer = tokenizers.checkpoint_tokenizer(ckpt, log)  # the tokenizer sample.py would use
    config = checkpoint_model_config(ckpt["model_args"])
    if not isinstance(tokenizer, tokenizers.GPT2Tokenizer) and tokenizer.vocab_size != config.vocab_size:
        raise UserError(f"the run's tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                        f"{config.vocab_size}: export needs the meta.json of the dataset the model was trained on")
    if isinstance(tokenizer, tokenizers.GPT2Tokenizer) and config.vocab_size < tokenizer.vocab_size:
        tokenizer = None  # no meta.json found, and too few rows for GPT-2 BPE: a vocabulary we do not know
    written = {}

    def write(folder: str) -> None:
        written["model"] = export(ckpt, folder, tokenizer)
        written["note"] = write_tokenizer(folder, tokenizer, config.block_size, shown=cfg.to)

    # written whole into a folder of its own first: a full disk leaves an earlier export in --to as it was
    removed = files.write_files(cfg.to, write, "the exported model into", fix="free disk space, or give another --to",
                                 stale=EXPORT_FILES)
    hf_model, note = written["model"], written["note"]
    log(f"exported {path} to {cfg.to}: GPT2LMHeadModel, vocab_size {hf_model.config.vocab_size}, activation "
        f"{hf_model.config.activation_function}; {note}"
        + (f"; removed the earlier export's {', '.join(removed)}" if removed else ""))


if __name__ == "__main__":
    exit_on_user_error(main)
