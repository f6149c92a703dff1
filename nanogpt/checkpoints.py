"""A run's checkpoints in either format (ckpt.pt, or FSDP's sharded folder): saving, finding the newest, and reading
one to resume or for inference. A resume reads the newest of ckpt.pt and ckpt_sharded by the iteration each records,
not by format, with any number of ranks. What reads weights takes a file or a sharded folder alike, maps a file
instead of reading it, and never touches the optimizer state."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from model import GPT, GPTConfig
from nanogpt import checkpoint_file, checkpoint_sharded, dataio, outdir, tokenizers
from nanogpt.checkpoint_file import load_checkpoint, model_from_checkpoint
from nanogpt.checkpoint_sharded import is_sharded, load_sharded, load_sharded_as_full, read_train_state
from nanogpt.dataio import GPT2_META
from nanogpt.device import autocast_context, resolve_dtype
from nanogpt.distributed import Dist, is_dtensor
from nanogpt.errors import UserError
from nanogpt.hardware import check_attention_kernel
from nanogpt.hf_gpt2 import pretrained_gpt2
from nanogpt.outdir import BEST, CKPT, SHARDED, SHARDED_BEST
from nanogpt.text import first_sentence


class CheckpointWriter:
    """A run's saves, the one place that chooses their format: ckpt.pt (rank 0 writes it) or, under FSDP, ckpt_sharded
    (every rank its shards), in the background when asked (one save in flight at a time)."""

    def __init__(self, out_dir: str, dist: Dist, fsdp: bool, always_save_checkpoint: bool, keep_last: int,
                 best_file: str | None, background_group=None):
        self.out_dir, self.dist, self.sharded = out_dir, dist, fsdp
        self.always_save, self.keep_last, self.best_file = always_save_checkpoint, keep_last, best_file
        self.group = background_group  # distributed.checkpoint_group(): background saves only
        self.in_flight: tuple[checkpoint_sharded.ShardedSave, str] | None = None

    def save(self, model: nn.Module, optimizer, state: dict, improved: bool, background: bool = False) -> list[str]:
        """Save the model, the optimizer (optim.Optimizers) and the train state `state`, once a save still in flight
        is linked. Returns the lines to print."""
        lines = [line] if (line := self.finish()) is not None else []
        t0 = time.time()
        best_note = "" if improved or self.always_save else (
            f" (the best val loss's weights stay in {SHARDED_BEST if self.sharded else BEST})")
        if self.sharded and background and self.group is not None:
            pending = checkpoint_sharded.start_sharded_save(self.out_dir, model, optimizer.as_torch(), state, self.dist,
                                                            self.group, improved, keep_best=not self.always_save)
            self.in_flight = pending, f"iter {state['iter_num']} to {self.out_dir}/{SHARDED}{best_note}"
            return lines + [f"saving sharded checkpoint at iter {state['iter_num']} in the background (staged in "
                            f"{time.time() - t0:.1f} s)"]
        if self.sharded:
            checkpoint_sharded.save_sharded(self.out_dir, model, optimizer.as_torch(), state, self.dist, improved,
                                            keep_best=not self.always_save)
            return lines + [f"saved sharded checkpoint at iter {state['iter_num']} to {self.out_dir}/{SHARDED} "
                            f"in {time.time() - t0:.1f} s{best_note}"]
        if not self.dist.master:
            return lines
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state}
        self.best_file = checkpoint_file.save_run_checkpoint(state, self.out_dir, improved, self.best_file,
                                                             self.always_save, self.keep_last)
        return lines + [f"saved checkpoint at iter {state['iter_num']} to {self.out_dir} in {time.time() - t0:.1f} s"
                        + (best_note if self.best_file == BEST else "")]

    def finish(self, if_done: bool = False) -> str | None:
        """Link the save written in the background once its shards are written (if_done: only if they already are)."""
        if self.in_flight is None or (if_done and not self.in_flight[0].done()):
            return None
        (pending, where), self.in_flight = self.in_flight, None
        pending.finish()
        return f"saved sharded checkpoint at {where}, written in {time.time() - pending.started:.1f} s beside training"


def _read_state(path: str) -> dict[str, Any]:
    """A checkpoint's contents without reading any tensor: a file mapped, or a sharded folder's train state."""
    return read_train_state(path) if is_sharded(path) else load_checkpoint(path, mmap=True)


@dataclass
class FoundCheckpoint:
    path: str
    iter_num: int
    note: str  # what else was there, and why this one: "" when it was the only choice
    state: dict = field(default_factory=dict, repr=False)  # _read_state's: a file mapped, or a folder's train state

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def read(self) -> dict[str, Any]:
        """What a resume continues from: ckpt.pt's contents (mapped), or a sharded folder's train state."""
        return self.state or _read_state(self.path)

    def describe(self, verb: str) -> str:
        """One line, e.g. 'resuming from ckpt_sharded at iter 15 (ckpt.pt is at iter 10, older)'."""
        return f"{verb} {self.path} at iter {self.iter_num}" + (f" ({self.note})" if self.note else "")


def _listing(out_dir: str) -> str:
    """What out_dir holds, for a message (run.lock, a live start's own lock, left out)."""
    entries = sorted(set(os.listdir(out_dir)) - {outdir.LOCK_FILE}) if os.path.isdir(out_dir) else None
    if entries is None:
        return f"{out_dir} does not exist"
    return f"{out_dir} holds {', '.join(entries[:8])}{' ...' if len(entries) > 8 else ''}" if entries else \
        f"{out_dir} is empty"


def find_checkpoint(out_dir: str, name: str | None = None, prefer_sharded: bool = False) -> FoundCheckpoint:
    """The checkpoint of a run: out_dir/name if given, else the newest of ckpt.pt and ckpt_sharded by the iteration
    each records; at the same iteration the sharded folder for an FSDP run (prefer_sharded), else the file. Another
    run's checkpoint is never chosen; none is a UserError naming what out_dir holds."""
    if name is not None:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            hint = {BEST: f"{BEST} exists only after a run with always_save_checkpoint=False was stopped "
                               f"between evals; otherwise {CKPT} holds the best weights",
                    SHARDED_BEST: f"{SHARDED_BEST} exists only after an FSDP run with "
                                       f"always_save_checkpoint=False saved weights later than its best"}.get(name)
            fix = hint + ": drop --ckpt" if hint else "give --ckpt a checkpoint file or sharded folder in out_dir, " \
                "or leave it out for the newest"
            m = re.fullmatch(r"ckpt_(\d+)\.pt", name)
            if m and os.path.exists(os.path.join(out_dir, padded := f"ckpt_{int(m[1]):07d}.pt")):
                fix = f"keep_last's files carry the iteration in 7 digits: give --ckpt={padded}"
            raise UserError(f"no checkpoint {path} ({_listing(out_dir)}): {fix}")
        return _found(path)
    found, foreign = [], []
    run_id = outdir.run_id_of(out_dir)
    for candidate in (SHARDED, CKPT) if prefer_sharded else (CKPT, SHARDED):
        path = os.path.join(out_dir, candidate)
        if os.path.exists(path):
            f = _found(path)
            # a checkpoint of another run (copied in, or left by a version without run ids beside a new run's)
            (foreign if run_id and f.state.get("run_id") not in (None, run_id) else found).append(f)
    if not found and foreign:
        raise UserError(
            f"{' and '.join(f.path for f in foreign)} {'is a checkpoint' if len(foreign) == 1 else 'are checkpoints'} "
            f"of another run (id {foreign[0].state.get('run_id')}) than the one "
            f"{os.path.join(out_dir, outdir.RUN_FILE)} names ({run_id}), and a resume continues only its own run: move "
            f"it out of {out_dir} (to resume it, into a folder of its own), or start a new run from its weights with "
            f"--init_from=PATH")
    if not found:
        raise UserError(f"no checkpoint in {out_dir} (neither {CKPT} nor {SHARDED}; {_listing(out_dir)}): "
                        f"train first, or set --out_dir to the run's folder")
    for f in found:
        if foreign:
            f.note = f"{', '.join(g.name for g in foreign)} belongs to another run: not read"
    if len(found) == 1:
        return found[0]
    newest = max(found, key=lambda f: f.iter_num)  # max keeps the first (preferred) one of a tie
    other = found[1] if newest is found[0] else found[0]
    if other.iter_num == newest.iter_num:
        why = "an FSDP run reads the sharded one" if prefer_sharded else "the file is read first"
        newest.note = f"{other.name} is at the same iteration: {why}"
    else:
        newest.note = f"{other.name} is at iter {other.iter_num}, older"
    return newest


def _found(path: str) -> FoundCheckpoint:
    state = _read_state(path)
    return FoundCheckpoint(path, int(state.get("iter_num", 0)), "", state)


def read_weights(path: str, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The weights of a checkpoint file or sharded folder: {"model", "model_args", "config", "iter_num", "meta"}. A file
    is mapped and its optimizer state never read (a 45M model: 615 instead of 1,031 MB max RSS); a folder is gathered
    into this process on the CPU. `state`: _read_state(path), where the caller has it."""
    if is_sharded(path):
        model, state = load_sharded_as_full(path)
        weights = model.state_dict()
    else:
        state = state if state is not None else load_checkpoint(path, mmap=True)
        weights = state["model"]
    keep = ("model_args", "config", "meta")
    return {"model": weights, "iter_num": int(state.get("iter_num", 0)), **{k: state.get(k) for k in keep}}


def checkpoint_path(path: str) -> str | None:
    """The checkpoint `path` names (a file, a sharded folder, a run folder's newest); None for GPT-2 or a HF folder."""
    if os.path.isfile(path) or is_sharded(path):
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")) and any(
            os.path.exists(os.path.join(path, name)) for name in (CKPT, SHARDED)):
        return find_checkpoint(path).path
    return None


def weights_tokenizer(init_from: str, ckpt: dict | None = None) -> tuple[int, dict | None]:
    """The vocabulary size and tokenizer (None: unknown) of the weights init_from names, read before the weights
    are: `ckpt` is the resumed checkpoint's state (init_from="resume")."""
    if ckpt is None and (path := checkpoint_path(init_from)) is not None:
        ckpt = _read_state(path)
    if ckpt is not None:
        return int(ckpt["model_args"]["vocab_size"]), tokenizers.recorded_meta(ckpt)[0]
    config = os.path.join(init_from, "config.json")
    if os.path.isfile(config):  # a HF folder: the meta.json export.py writes (a char-level run's), else GPT-2 BPE's
        with open(config) as f:
            vocab = int(json.load(f).get("vocab_size", 0))
        if (meta := dataio.find_meta(init_from)) is not None:
            return vocab, dataio.tokenizer_meta(meta)
        bpe = vocab == GPT2_META["vocab_size"] or all(os.path.isfile(os.path.join(init_from, n))
                                                       for n in ("vocab.json", "merges.txt"))
        return vocab, GPT2_META if bpe else None
    if os.path.isdir(init_from):
        files = sorted(n for n in os.listdir(init_from) if n.startswith("ckpt") and n.endswith(".pt"))
        hint = (f": give one of its checkpoint files, e.g. --init_from={os.path.join(init_from, files[0])}"
                if files else "")
        raise UserError(f"init_from={init_from!r} is a folder without a run's checkpoint (ckpt.pt, ckpt_sharded) or a "
                        f"HF GPT-2 model (config.json){hint}")
    return GPT2_META["vocab_size"], GPT2_META  # gpt2, gpt2-medium, ... (the settings' check refused anything else)


def load_for_inference(init_from: str, out_dir: str, name: str | None, device: str, dtype: str,
                       overrides: dict[str, Any], compile: bool = False, log: Callable[[str], None] = print,
                       attention_for: Callable[[GPTConfig], str] | None = None) -> tuple[GPT, tokenizers.Tokenizer]:
    """The model to sample or score with, in eval mode on `device`, and the tokenizer it was trained with. init_from:
    "resume" (out_dir's checkpoint `name`, None: the newest), a checkpoint file, sharded or run folder, GPT-2's name
    or a HF folder. `attention_for`: the attention for the model's config (sample.py's attention=auto). The attention
    kernel is checked for `dtype` here, so a refusal is one line before any generation."""
    found = find_checkpoint(out_dir, name) if init_from == "resume" else None
    path = found.path if found is not None else checkpoint_path(init_from)
    if path is not None:
        weights = read_weights(path, found.state if found is not None else None)
        log(f"checkpoint: {path} at iter {weights['iter_num']}")
        model = model_from_checkpoint(weights, **overrides)
        tokenizer = tokenizers.checkpoint_tokenizer(weights, log)
        source = f"the tokenizer of {path}"
        del weights
    else:
        vocab, meta = weights_tokenizer(init_from)
        if meta is None:
            raise UserError(f"init_from={init_from!r} names no tokenizer for its {vocab} tokens (no meta.json, no "
                            f"GPT-2 tokenizer files): export its run again (export.py writes the run's meta.json), or "
                            f"give the run's checkpoint: --init_from=OUT_DIR")
        model = pretrained_gpt2(init_from, overrides)
        bpe = meta["tokenizer"] == "gpt2"
        log(f"tokenizer: GPT-2 BPE (init_from={init_from})" if bpe else
            f"tokenizer: {meta['tokenizer']} ({meta['vocab_size']} tokens, {init_from}/meta.json)")
        tokenizer, source = tokenizers.get_tokenizer(meta), "GPT-2 BPE" if bpe else f"{init_from}/meta.json"
    # nanoGPT's GPT-2 checkpoints say vocab_size=50304 (padded): more rows than the BPE has tokens is fine there,
    # sampling never draws the ids past the tokenizer's
    padded_bpe = isinstance(tokenizer, tokenizers.GPT2Tokenizer) and model.config.vocab_size > tokenizer.vocab_size
    if tokenizer.vocab_size != model.config.vocab_size and not padded_bpe:
        fix = ("the model was trained on other data: put that data's meta.json in the folder its run config names"
               if path else "export its run again, or give the run's checkpoint: --init_from=OUT_DIR")
        raise UserError(f"{source} ({tokenizer.vocab_size} tokens, logged above) does not fit the model's vocab_size "
                        f"{model.config.vocab_size}: {fix}")
    if attention_for is not None:
        model.set_attention(attention_for(model.config))
    model.eval().to(device)
    check_attention_kernel(model, autocast_context(device, resolve_dtype(dtype, device, training=False)), compile)
    log(f"model: {model.get_num_params() / 1e6:.2f}M parameters, {model.config}")
    return model, tokenizer


def load_training_state(model: nn.Module, optimizer, ckpt: dict) -> None:
    """The optimizer state of a resume, whatever the checkpoint's format and the model's sharding (a sharded
    checkpoint's weights too). This run's optimizer settings (weight decay, betas, ...) apply over the checkpoint's;
    its moments and step counts are restored. A state saved before the first step is empty: a fresh optimizer is it."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    torch_optimizer = optimizer.as_torch()
    if "sharded" in ckpt:
        load_sharded(ckpt["sharded"], model, torch_optimizer if ckpt.get("optimizer_saved", True) else None)
    elif not _optimizer_stepped(ckpt["optimizer"]):
        pass
    elif any(is_dtensor(p) for p in model.parameters()):
        _load_full_optimizer_state(model, torch_optimizer, ckpt["optimizer"])
    else:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
            _check_state_shapes(optimizer)
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:  # its groups or tensors differ
            raise UserError(f"the checkpoint's optimizer state does not fit this run's optimizer ({type(e).__name__}: "
                            f"{first_sentence(e)}): restore the checkpoint from a backup, or start from its weights "
                            f"with --init_from=PATH") from None
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


def _check_state_shapes(optimizer) -> None:
    """A ValueError where a loaded moment is not its parameter's shape: torch's load_state_dict takes any tensor, and
    the fused AdamW kernel would read past a short one."""
    for opt in optimizer.optimizers.values():
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                for key, value in opt.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape != p.shape:
                        raise ValueError(f"{key} of parameter {i} has shape {tuple(value.shape)}, the parameter "
                                         f"{tuple(p.shape)}")


def _optimizer_stepped(optim_sd: dict) -> bool:
    """Whether a saved optimizer state (torch's, or Optimizers' {name: state}) holds any step's state."""
    if "state" in optim_sd:
        return bool(optim_sd["state"])
    return any(_optimizer_stepped(sd) for sd in optim_sd.values())


def _load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict) -> None:
    """A ckpt.pt's optimizer state (torch's format: whole tensors keyed by position) into a sharded model's
    optimizer: the positions become parameter names, and each rank keeps its shard of every tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = {"state": {order[i]: s for i, s in optim_sd["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_sd["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
