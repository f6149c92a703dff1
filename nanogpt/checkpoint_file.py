"""One checkpoint file (ckpt.pt), the format of a one-process or DDP run and of nanoGPT's: written atomically, read
without running code from it (weights_only), each recorded field checked before it is used. It holds the model's and
optimizer's state dicts and the train state (iteration, best val loss, model_args, the run's config and id, the
tokenizer, the RNG). nanoGPT's files are read too, their compiled and DDP prefixes and pre-2.0 masks dropped."""
from __future__ import annotations

import contextlib
import errno
import math
import os
import pickle
import re
import shutil
from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn

from nanogpt import dataio, files
from nanogpt.errors import UserError, WriteError
from nanogpt.distributed import Dist
from nanogpt.text import first_sentence, plural, shown
from nanogpt.outdir import BEST, CKPT, KEPT, SHARDED, SHARDED_BEST, kept_name
from model import GPT, GPTConfig

# the fix of a damaged checkpoint, one that every reader has (--ckpt, --init_from=PATH)
ANOTHER_CHECKPOINT = ("restore it from a backup, or read another checkpoint of the run (keep_last's ckpt_0000300.pt, "
                      "ckpt_best.pt)")


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically (files.atomic_write): a crash leaves the old checkpoint or the new one, never
    a torn file; a failed write is a WriteError."""
    folder, name = os.path.split(os.path.abspath(path))
    if os.path.isdir(folder):
        for entry in os.listdir(folder):  # left by a process killed mid-write: only the names atomic_write writes
            if entry.startswith(name + ".tmp.") and entry[len(name) + 5:].isdigit():
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, entry))

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)  # on a full disk torch raises RuntimeError("... unexpected pos ...") from the OSError
            f.flush()
            os.fsync(f.fileno())

    files.atomic_write(path, write, "checkpoint")


def keep_as(path: str, other: str) -> None:
    """Make `other` name the same file as `path` (a hard link, so no copy), atomically: a crash leaves either the
    old `other` or the new one. Where the file system has no hard links, a copy."""

    def link(tmp: str) -> None:
        try:
            os.link(path, tmp)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP):  # links refused: copy
                raise
            shutil.copyfile(path, tmp)

    files.atomic_write(other, link, "checkpoint")


def save_run_checkpoint(state: dict, out_dir: str, improved: bool, best_file: str | None,
                        always_save_checkpoint: bool, keep_last: int = 0) -> str | None:
    """Save `state` to out_dir/ckpt.pt, where a resume continues; returns the file that now holds the run's best
    weights (None: not kept), which the state records. With always_save_checkpoint=False ckpt.pt holds the best
    weights, so a stop between evals first keeps them as ckpt_best.pt (a hard link); an eval that improves again
    writes ckpt_best.pt, links ckpt.pt to it, then removes it: at every moment of a crash the best weights have a
    name. keep_last > 0 also keeps the last K saves (ckpt_0000300.pt). Only this run's files are replaced or removed."""
    path, best_path = os.path.join(out_dir, CKPT), os.path.join(out_dir, BEST)
    run_id = state.get("run_id")
    if improved:
        best_file = CKPT
    elif best_file == CKPT:  # ckpt.pt holds the best, and this save overwrites it
        keep = not always_save_checkpoint and os.path.exists(path)
        if keep:
            keep_as(path, _writable(best_path, run_id))
        best_file = BEST if keep else None
    state = {**state, "best_file": best_file}
    if improved and is_ours(best_path, run_id):
        save_checkpoint(best_path, state)
        keep_as(best_path, path)
        files.remove_file(best_path, "checkpoint")
    else:
        save_checkpoint(path, state)
    if keep_last > 0:
        keep_as(path, _writable(os.path.join(out_dir, kept_name(state["iter_num"])), run_id))
        kept = sorted((int(m.group(1)), f) for f in os.listdir(out_dir)
                      if (m := KEPT.fullmatch(f)) and is_ours(os.path.join(out_dir, f), run_id))
        for _, f in kept[:-keep_last]:
            files.remove_file(os.path.join(out_dir, f), "checkpoint")
    return best_file


def is_ours(path: str, run_id: str | None) -> bool:
    """Whether `path` is a checkpoint of the run `run_id` (the id it records): the only files a save replaces or
    removes. A user's file of a checkpoint's name, another run's checkpoint, one without a run id: not ours."""
    try:  # mapped, and unchecked: only its run id is read (a save asks this of every kept file)
        return run_id is not None and torch.load(path, mmap=True, weights_only=True).get("run_id") == run_id
    except Exception:  # not a checkpoint (a user's file), or not a dict
        return False


def _writable(path: str, run_id: str | None) -> str:
    """`path`, where nothing stands or a file of this run's; a foreign file there is never written over."""
    if os.path.lexists(path) and not is_ours(path, run_id):
        raise WriteError(f"{path} is not a checkpoint of this run ({run_id}) and a save must write there: move it "
                         f"out of {os.path.dirname(path)} (a run never writes over a file it did not write)")
    return path


def train_state(model: GPT, scaler, iter_num: int, best_val_loss: float, config: dict, dist: Dist, elapsed_s: float,
                meta: dict | None, run_id: str | None = None) -> dict:
    """A checkpoint's entries besides the model and optimizer tensors: `config` the run's settings, `meta` the
    dataset's tokenizer (so the checkpoint names it), `run_id` the run's (outdir.py)."""
    return {"run_id": run_id, "scaler": scaler.state_dict(), "iter_num": iter_num, "best_val_loss": best_val_loss,
            "model_args": asdict(model.config), "config": config, "world_size": dist.world_size,
            "elapsed_s": elapsed_s,  # the run's wall time so far, so metrics.jsonl's time continues across resumes
            "meta": dataio.tokenizer_meta(meta) if meta is not None else None,
            "rng": {"torch": torch.get_rng_state(),  # rank 0's: a one-process resume continues it (restore_rng)
                    "cuda": torch.cuda.get_rng_state(dist.device) if dist.device.startswith("cuda") else None}}


def restore_rng(ckpt: dict, seed: int, dist: Dist, iter_num: int) -> None:
    """The dropout RNG of a resume: a one-process run's saved state, so the resume is bitwise the uninterrupted run;
    DDP ranks (whose states are not all saved) reseed from (seed, rank, iteration), their masks still distinct."""
    rng = ckpt.get("rng")
    if rng is None or dist.world_size > 1 or ckpt.get("world_size", 1) > 1:
        torch.manual_seed(seed + dist.rank + 1_000_003 * iter_num)
        return
    torch.set_rng_state(rng["torch"].cpu())
    if dist.device.startswith("cuda") and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"].cpu(), dist.device)


# nanoGPT before PyTorch 2.0 saved each layer's causal mask as a buffer named attn.bias: a constant, not a weight
_OLD_MASK_KEY = re.compile(r"transformer\.h\.\d+\.attn\.bias")


def clean_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` without the prefixes of compiled or DDP models and the mask buffers of pre-2.0 nanoGPT's checkpoints."""
    out = {}
    for k, v in sd.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        if not _OLD_MASK_KEY.fullmatch(k):
            out[k] = v
    return out


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", mmap: bool = False,
                    tensors: bool = True) -> dict[str, Any]:
    """Load a checkpoint file without running code from it (weights_only); a missing or damaged file is a UserError.
    mmap=True maps it: tensors are read on first use (a file read for its weights never reads the optimizer's), and
    the ranks of a node share its pages. tensors=False: a sharded folder's train_state.pt, which holds no model."""
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}: train first, or set --out_dir to the run's folder")
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder, not a checkpoint file: give the file, or the run's out_dir")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except torch.OutOfMemoryError:
        raise UserError(f"out of memory loading {path} onto {map_location}: load it on the CPU") from None
    except Exception as e:  # torch raises several types for truncated or foreign files
        if isinstance(e, pickle.UnpicklingError) and "unsupported global" in str(e).lower():  # weights_only's refusal
            raise UserError(f"{path} holds objects that are not plain data (tensors, numbers, strings, lists, dicts) "
                            f"and was not loaded: nothing in it was run (a checkpoint is read with weights_only=True); "
                            f"re-save it with plain types") from None
        raise UserError(f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {first_sentence(e)}): "
                        f"{ANOTHER_CHECKPOINT}") from None
    if not isinstance(ckpt, dict) or tensors and ("model" not in ckpt or "model_args" not in ckpt):
        raise UserError(f"{path} is not a checkpoint of this project (no 'model' and 'model_args' entries)")
    check_train_state(ckpt, path)
    return ckpt


BEST_FILES = (None, CKPT, BEST, SHARDED, SHARDED_BEST)


def check_train_state(ckpt: dict[str, Any], path: str) -> None:
    """A field a run records, edited by hand or damaged, is a UserError naming it, never a traceback where used."""
    def number(v, low=None) -> bool:
        return type(v) in (int, float) and not math.isnan(v) and (low is None or v >= low)

    checks = {
        "iter_num": lambda v: type(v) is int and 0 <= v < 10**12,
        # inf before the first eval; nanoGPT's is a 0-dim tensor
        "best_val_loss": lambda v: number(v) or isinstance(v, torch.Tensor) and v.numel() == 1
        and not v.is_complex() and not torch.isnan(v).item(),
        "model_args": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v) and all(
            type(v.get(k)) is int and v[k] >= 1 for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")),
        "model": lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                                       for k, t in v.items()),
        "config": lambda v: v is None or isinstance(v, dict) and all(isinstance(k, str) and _plain(x)
                                                                     for k, x in v.items()),
        "world_size": lambda v: type(v) is int and v >= 1,
        "elapsed_s": lambda v: number(v, 0) and math.isfinite(v),
        "run_id": lambda v: v is None or isinstance(v, str) and 0 < len(v) <= 64,
        "best_file": lambda v: v in BEST_FILES,
        "meta": lambda v: v is None or isinstance(v, dict),
        "rng": lambda v: v is None or isinstance(v, dict) and _rng_state(v.get("torch"), torch.get_rng_state())
        and (v.get("cuda") is None or isinstance(v["cuda"], torch.Tensor) and v["cuda"].dtype == torch.uint8),
        "scaler": lambda v: v is None or isinstance(v, dict),
        "optimizer": lambda v: _torch_optimizer_state(v) or isinstance(v, dict) and bool(v)
        and all(_torch_optimizer_state(s) for s in v.values()),  # AdamW's, or Muon + AdamW's by name
        "optimizer_saved": lambda v: isinstance(v, bool),
    }
    wrong = [key for key, fits in checks.items() if key in ckpt and not fits(ckpt[key])]
    if wrong:
        fields = "; ".join(f"{k}={shown(ckpt[k])}" for k in wrong)
        raise UserError(f"checkpoint {path} is damaged: {fields} is not what a run records: {ANOTHER_CHECKPOINT}")
    if isinstance(ckpt.get("model"), dict):
        check_model_shape(ckpt["model_args"], ckpt["model"], path)
        # weights no forward can use (a run saved past a diverged step, or damage): one line here, before a reader
        # samples from them (torch.multinomial's traceback), scores them, or trains them into a non-finite loss
        bad = [(k, n) for k, t in ckpt["model"].items() if (n := int(t.numel() - torch.isfinite(t).sum()))]
        if bad:
            raise UserError(f"checkpoint {path} has {bad[0][1]} non-finite weights in {bad[0][0]}"
                            + (f" and in {plural(len(bad) - 1, 'more tensor')}" if len(bad) > 1 else "")
                            + f": {ANOTHER_CHECKPOINT}")


def _plain(value, depth: int = 0) -> bool:
    """A setting's value as a run records one: None, a bool, number or string, or a short list of them."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    return type(value) in (list, tuple) and depth < 2 and all(_plain(x, depth + 1) for x in value)


def _rng_state(state, like: torch.Tensor) -> bool:
    """A torch generator's state: bytes, as many as this torch's CPU generator has (set_rng_state's own check)."""
    return isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.shape == like.shape


def check_model_shape(model_args: dict[str, Any], state: dict[str, torch.Tensor], path: str) -> None:
    """model_args that do not match the weights beside them (edited to 10**9 layers: hours of allocation) are a
    UserError before any model is built."""
    keys = clean_state_dict(state)
    wte, wpe = keys.get("transformer.wte.weight"), keys.get("transformer.wpe.weight")
    if wte is None or wpe is None or wte.dim() != 2 or wpe.dim() != 2:
        return  # not a GPT's weights: loading them says which are missing
    layers = {int(m[1]) for k in keys if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    found = {"n_layer": len(layers), "n_embd": wte.shape[1], "block_size": wpe.shape[0]}
    wrong = [f"{k}={model_args[k]} (its weights have {v})" for k, v in found.items() if model_args[k] != v]
    padding = model_args.get("vocab_padding_multiple")
    padding = padding if type(padding) is int and padding >= 1 else 1  # nanoGPT's: none, its vocab_size is its rows
    if not model_args["vocab_size"] <= wte.shape[0] < model_args["vocab_size"] + padding:
        wrong.append(f"vocab_size={model_args['vocab_size']} (its weights have {wte.shape[0]} rows)")
    if wrong:
        raise UserError(f"checkpoint {path} is damaged: its model_args do not match its weights: {'; '.join(wrong)}: "
                        f"{ANOTHER_CHECKPOINT}")


def _torch_optimizer_state(state) -> bool:
    """A torch optimizer's state_dict: its per-parameter state and its groups."""
    return isinstance(state, dict) and isinstance(state.get("state"), dict) and \
        isinstance(state.get("param_groups"), list)


def checkpoint_model_config(model_args: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The GPTConfig of a checkpoint's model_args. Those from before the gelu setting: this repo's used GPT-2's tanh
    form, nanoGPT's (no vocab_padding_multiple) the exact one, and their vocab_size is final (no padding added).
    fused_loss (how older runs computed the loss, no GPTConfig key now) is dropped."""
    args = dict(model_args)
    args.pop("fused_loss", None)
    if "gelu" not in args:
        args["gelu"] = "tanh" if "vocab_padding_multiple" in args else "erf"
    args.setdefault("vocab_padding_multiple", 1)
    try:
        return GPTConfig(**{**args, **overrides})
    except (ValueError, TypeError) as e:  # model.py's check of an override or of model_args; an unknown key or type
        if isinstance(e, ValueError) and _makes_a_model(args):
            raise UserError(str(e)) from None
        raise UserError(f"a checkpoint's model_args do not make a model ({e}): restore it from a backup") from None


def _makes_a_model(model_args: dict[str, Any]) -> bool:
    try:
        GPTConfig(**model_args)
    except (ValueError, TypeError):
        return False
    return True


def model_from_checkpoint(ckpt: dict[str, Any], **overrides: Any) -> GPT:
    """Rebuild the model from the checkpoint alone; `overrides`: settings that do not touch the weights (attention)."""
    model = GPT.uninitialized(checkpoint_model_config(ckpt["model_args"], **overrides))
    load_model_state(model, ckpt["model"], source="checkpoint")  # every weight, or a UserError
    return model


def load_model_state(model: nn.Module, state: dict[str, Any], source: str) -> None:
    """load_state_dict with an error that names the keys and shapes that differ."""
    state = clean_state_dict(state)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in sorted(set(own) & set(state))
             if tuple(state[k].shape) != tuple(own[k].shape)]
    parts = [f"{what}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}" for what, keys in
             ((f"shapes differ ({source} vs model)", wrong), ("missing keys", missing), ("unexpected keys", unexpected))
             if keys]
    if parts:
        raise UserError(f"{source} does not fit the model: {'; '.join(parts)}")
    model.load_state_dict(state)

