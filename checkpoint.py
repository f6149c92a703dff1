"""
Checkpoints, in one place: writing them (atomically), finding a run's newest, reading them to resume or for
inference, and converting between the two formats. train.py, sample.py, export.py, hellaswag.py and parallel.py
all go through this module.

A run's folder (out_dir) holds:
  ckpt.pt              the latest save of a one-process or DDP run: model, optimizer and train state (torch.save)
  ckpt_best.pt         always_save_checkpoint=False: the best val loss's weights, once a stop saved later ones
  ckpt_<iter>.pt       keep_last=K: the last K saves (hard links to ckpt.pt as it was)
  ckpt_sharded         an FSDP run's latest save: a link to a folder ckpt_sharded_<iter>_<n> that
                       torch.distributed.checkpoint (DCP) wrote, each rank its shards, plus train_state.pt
  ckpt_sharded_best    always_save_checkpoint=False under FSDP: a link to the best val loss's folder
A resume reads the newest of ckpt.pt and ckpt_sharded by the iteration each records (not by its format): any run
resumes from either, with any number of ranks. Everything that reads weights (sample.py, export.py, hellaswag.py,
init_from=PATH) takes a file or a sharded folder alike, maps a file instead of reading it, and never touches the
optimizer state. nanoGPT's ckpt.pt files are read too (model_args, model, optimizer, iter_num, best_val_loss).

Its functions, by what they do:
  write        RunSaver (a run's saves in its format, in the background too), train_state, save_checkpoint,
               save_run_checkpoint, save_sharded, start_sharded_save (-> ShardedSave), keep_as, fsync_folder
  find         find_checkpoint (-> Found: .read() is what a resume continues from), checkpoint_path
  resume       load_training_state (model, optimizer), restore_rng
  weights      load_for_inference (sample.py, hellaswag.py), read_weights, model_from_checkpoint,
               checkpoint_model_config, load_model_state, weights_tokenizer, load_checkpoint, load_sharded,
               load_sharded_as_full, read_train_state, clean_state_dict
  convert      convert_to_single_file (parallel.py's script)
What a resume takes of the run's settings is run_dir.py's; a checkpoint's tokenizer is dataio.py's.

Never imports a script (train, sample, export, hellaswag, parallel, bench).
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

import dataio
import run_dir
from common import autocast_context, resolve_dtype
from errors import UserError
from hardware import check_attention_kernel
from distributed import Dist, is_dtensor
from model import GPT, GPTConfig

CKPT_NAME, BEST_NAME = "ckpt.pt", "ckpt_best.pt"
SHARDED_NAME, SHARDED_BEST_NAME = "ckpt_sharded", "ckpt_sharded_best"
STATE_FILE = "train_state.pt"  # in a sharded folder: everything but the tensors (iteration, config, RNG), written last
_KEEP_LAST = re.compile(r"ckpt_(\d{7,})\.pt")  # the names keep_last writes, and the only ones it removes
_SHARDED_FOLDER = re.compile(rf"{SHARDED_NAME}_\d{{7,}}_\d+")  # the folders save_sharded writes, and removes


# ----------------------------------------------------------------------------------------------- writing


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """
    Write atomically: a temporary file in the same folder, flushed and fsynced, then renamed over `path`.
    A crash at any moment leaves either the old checkpoint or the new one, never a torn file. A failed write
    (a full disk, no permission) is a UserError, and the old checkpoint stays as it was.
    """
    folder, name = os.path.split(os.path.abspath(path))
    if os.path.isdir(folder):
        for entry in os.listdir(folder):  # left by a process killed mid-write: only the names _replace writes
            if entry.startswith(name + ".tmp.") and entry[len(name) + 5:].isdigit():
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(folder, entry))

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    _replace_atomically(path, write)


def keep_as(path: str, other: str) -> None:
    """Make `other` name the same file as `path` (a hard link, so no copy), atomically: a crash leaves either the
    old `other` or the new one. Where the file system has no hard links, a copy."""

    def link(tmp: str) -> None:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)

    _replace_atomically(other, link)


def _replace_atomically(path: str, write: Callable[[str], None]) -> None:
    """Make a temporary file beside `path` with `write(tmp)`, then rename it over `path` (and make the rename
    durable). An OSError (a full disk, no permission) is a UserError that says the old file is intact."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(folder, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        kept = "the previous checkpoint is intact" if os.path.exists(path) else "no checkpoint was written"
        raise UserError(
            f"could not write checkpoint {path} ({e.strerror or e}); {kept}: free disk space or choose another out_dir"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    fsync_folder(folder)


def fsync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):  # make a rename durable (not possible on every OS)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def save_run_checkpoint(state: dict, out_dir: str, improved: bool, best_file: str | None,
                        always_save_checkpoint: bool, keep_last: int = 0) -> str | None:
    """
    Save `state` to out_dir/ckpt.pt, the latest save, where a resume continues. Returns the file that now holds
    the run's best weights (None: not kept), which the state records too (`best_file`).

    With always_save_checkpoint=False, ckpt.pt is written at an eval only when the val loss improves, so it holds
    the best weights. A stop between evals (SIGTERM, Ctrl-C) must save the latest state there too: the best one is
    first kept as ckpt_best.pt (a hard link). An eval that improves again writes ckpt_best.pt first, then links
    ckpt.pt to it and removes ckpt_best.pt, so at every moment of a crash the best weights have a name.
    keep_last > 0 also keeps the newest checkpoints as ckpt_<iter>.pt.
    """
    path, best_path = os.path.join(out_dir, CKPT_NAME), os.path.join(out_dir, BEST_NAME)
    if improved:
        best_file = CKPT_NAME
    elif best_file == CKPT_NAME:  # ckpt.pt holds the best, and this save overwrites it
        keep = not always_save_checkpoint and os.path.exists(path)
        if keep:
            keep_as(path, best_path)
        best_file = BEST_NAME if keep else None
    state = {**state, "best_file": best_file}
    if improved and os.path.exists(best_path):
        save_checkpoint(best_path, state)
        keep_as(best_path, path)
        os.remove(best_path)
    else:
        save_checkpoint(path, state)
    if keep_last > 0:
        keep_as(path, os.path.join(out_dir, f"ckpt_{state['iter_num']:07d}.pt"))
        kept = sorted((int(m.group(1)), f) for f in os.listdir(out_dir) if (m := _KEEP_LAST.fullmatch(f)))
        for _, f in kept[:-keep_last]:
            os.remove(os.path.join(out_dir, f))
    return best_file


class RunSaver:
    """
    A training run's saves in its format, the one place that chooses between them: ckpt.pt (rank 0 writes model,
    optimizer and train state; save_run_checkpoint) or, under FSDP, ckpt_sharded (every rank its shards;
    save_sharded), written in the background when `background` (start_sharded_save; one save in flight at a time).
    save() and finish() return the line to print.
    """

    def __init__(self, out_dir: str, dist: Dist, sharded: bool, always_save_checkpoint: bool, keep_last: int,
                 best_file: str | None, background_group=None):
        self.out_dir, self.dist, self.sharded = out_dir, dist, sharded
        self.always_save, self.keep_last, self.best_file = always_save_checkpoint, keep_last, best_file
        self.group = background_group  # distributed.checkpoint_group(): background saves only
        self.in_flight: tuple[ShardedSave, str] | None = None

    def save(self, model: nn.Module, optimizer, state: dict, improved: bool, background: bool = False) -> list[str]:
        """Save the model, the optimizer (optim.Optimizers) and the train state `state`, once a save still written
        in the background is linked (one in flight at a time). Returns the lines to print."""
        lines = [line] if (line := self.finish()) is not None else []
        t0 = time.time()
        best_note = "" if improved or self.always_save else (
            f" (the best val loss's weights stay in {SHARDED_BEST_NAME if self.sharded else BEST_NAME})")
        if self.sharded and background and self.group is not None:
            pending = start_sharded_save(self.out_dir, model, optimizer.as_torch(), state, self.dist, self.group,
                                         improved, keep_best=not self.always_save)
            self.in_flight = pending, f"iter {state['iter_num']} to {self.out_dir}/{SHARDED_NAME}{best_note}"
            return lines + [f"saving sharded checkpoint at iter {state['iter_num']} in the background (staged in "
                            f"{time.time() - t0:.1f} s)"]
        if self.sharded:
            save_sharded(self.out_dir, model, optimizer.as_torch(), state, self.dist, improved,
                         keep_best=not self.always_save)
            return lines + [f"saved sharded checkpoint at iter {state['iter_num']} to {self.out_dir}/{SHARDED_NAME} "
                            f"in {time.time() - t0:.1f} s{best_note}"]
        if not self.dist.master:
            return lines
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state}
        self.best_file = save_run_checkpoint(state, self.out_dir, improved, self.best_file, self.always_save,
                                             self.keep_last)
        return lines + [f"saved checkpoint at iter {state['iter_num']} to {self.out_dir} in {time.time() - t0:.1f} s"
                        + (best_note if self.best_file == BEST_NAME else "")]

    def finish(self, if_done: bool = False) -> str | None:
        """Link the save written in the background once its shards are on disk (if_done: only if they already
        are, a check between steps; else wait for them)."""
        if self.in_flight is None or (if_done and not self.in_flight[0].done()):
            return None
        (pending, where), self.in_flight = self.in_flight, None
        pending.finish()
        return f"saved sharded checkpoint at {where}, written in {time.time() - pending.started:.1f} s beside training"


# ----------------------------------------------------------------------------------------------- the train state


def train_state(model: GPT, scaler, iter_num: int, best_val_loss: float, cfg, dist: Dist, elapsed_s: float,
                meta: dict | None, run_id: str | None = None) -> dict:
    """A checkpoint's entries other than the model and optimizer tensors. `cfg` is the run's TrainConfig; `meta`
    the dataset's tokenizer description (dataio), so the checkpoint names the tokenizer it was trained with;
    `run_id` the run's (run_dir.py), so that a checkpoint of another run is never taken for this one's."""
    return {
        "run_id": run_id,
        "scaler": scaler.state_dict(),
        "iter_num": iter_num,
        "best_val_loss": best_val_loss,
        "model_args": asdict(model.config),
        "config": asdict(cfg),
        "world_size": dist.world_size,
        "elapsed_s": elapsed_s,  # the run's wall time so far, so metrics.jsonl's time continues across resumes
        "meta": dataio.tokenizer_meta(meta) if meta is not None else None,
        "rng": {  # rank 0's: a one-process resume continues it exactly (DDP ranks reseed, see restore_rng)
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(dist.device) if dist.device.startswith("cuda") else None,
        },
    }


def restore_rng(ckpt: dict, seed: int, dist: Dist, iter_num: int) -> None:
    """The dropout RNG of a resumed run. One process resuming a one-process run continues the saved state, so the
    resumed run is bitwise the uninterrupted one; DDP ranks (whose states differ and are not all saved) reseed
    from (seed, rank, iteration), which keeps their dropout masks different from each other's."""
    rng = ckpt.get("rng")
    if rng is None or dist.world_size > 1 or ckpt.get("world_size", 1) > 1:
        torch.manual_seed(seed + dist.rank + 1_000_003 * iter_num)
        return
    torch.set_rng_state(rng["torch"].cpu())
    if dist.device.startswith("cuda") and rng.get("cuda") is not None:
        torch.cuda.set_rng_state(rng["cuda"].cpu(), dist.device)


# ----------------------------------------------------------------------------------------------- reading a file


# nanoGPT before PyTorch 2.0 saved each layer's causal mask as a buffer named attn.bias: a constant, not a weight
_OLD_MASK_KEY = re.compile(r"transformer\.h\.\d+\.attn\.bias")


def clean_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """Strip wrapper prefixes that old (nanoGPT) checkpoints of compiled or DDP models carry, and drop the causal
    mask buffers of pre-2.0 nanoGPT checkpoints."""
    out = {}
    for k, v in sd.items():
        for prefix in ("_orig_mod.", "module."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        if not _OLD_MASK_KEY.fullmatch(k):
            out[k] = v
    return out


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint file without running code from it (weights_only); a missing or damaged file is a
    UserError. mmap=True maps the file instead of reading it: tensors are read on first use (the optimizer state
    of a file read for its weights never is), and processes that map the same file share its pages (DDP ranks on
    one node)."""
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}: train first, or set --out_dir to the run's folder")
    if os.path.isdir(path):
        raise UserError(f"{path} is a folder, not a checkpoint file (a sharded checkpoint is read with read_weights)")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except torch.OutOfMemoryError:
        raise UserError(f"out of memory loading {path} onto {map_location}: load it on the CPU") from None
    except pickle.UnpicklingError as e:
        if "unsupported global" not in str(e).lower():  # weights_only's refusal of a class; else it is damage
            raise UserError(f"checkpoint {path} is truncated or corrupt (UnpicklingError: {str(e)[:200]}): "
                            f"restore it from a backup or start again with --init_from=scratch") from None
        raise UserError(f"{path} holds objects that are not plain data (tensors, numbers, strings, lists, dicts) "
                        f"and was not loaded: nothing in it was run (a checkpoint is read with weights_only=True); "
                        f"re-save it with plain types") from None
    except Exception as e:  # torch raises several types for truncated or foreign files
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {first_line[:200]}): "
            f"restore it from a backup or start again with --init_from=scratch"
        ) from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_args" not in ckpt:
        raise UserError(f"{path} is not a checkpoint of this project (no 'model' and 'model_args' entries)")
    return ckpt


def checkpoint_model_config(model_args: dict[str, Any], **overrides: Any) -> GPTConfig:
    """The GPTConfig of a checkpoint's model_args. Checkpoints from before the gelu setting have none: this repo's
    used GPT-2's tanh form, nanoGPT's (which have no vocab_padding_multiple) the exact one, nn.GELU(). nanoGPT's
    vocab_size is its number of rows, already final (65 for characters, 50304 for its padded GPT-2 runs): no padding
    is added to it."""
    args = dict(model_args)
    if "gelu" not in args:
        args["gelu"] = "tanh" if "vocab_padding_multiple" in args else "erf"
    args.setdefault("vocab_padding_multiple", 1)
    args.update(overrides)
    return GPTConfig(**args)


def model_from_checkpoint(ckpt: dict[str, Any], **overrides: Any) -> GPT:
    """Rebuild the model from the checkpoint alone (model_args + state). `overrides` may change settings that do
    not touch the weights (dropout, attention, sdpa_backend)."""
    model = GPT.uninitialized(checkpoint_model_config(ckpt["model_args"], **overrides))
    load_model_state(model, ckpt["model"], source="checkpoint")  # every weight, or a UserError
    return model


def load_model_state(model: nn.Module, state: dict[str, Any], source: str) -> None:
    """load_state_dict with an error that names the keys and shapes that differ."""
    state = clean_state_dict(state)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append(f"shapes differ ({source} vs model): {', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}")
        if missing:
            parts.append(f"missing keys: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(unexpected[:4])}{' ...' if len(unexpected) > 4 else ''}")
        raise UserError(f"{source} does not fit the model: {'; '.join(parts)}")
    model.load_state_dict(state)


# ----------------------------------------------------------------------------------------------- finding


def _is_sharded(path: str) -> bool:
    """A sharded checkpoint: a folder (or the link ckpt_sharded to one) that holds train_state.pt."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE_FILE))


def read_train_state(folder: str) -> dict[str, Any]:
    """The non-tensor part of a sharded checkpoint (iteration, config, model_args, RNG), as load_checkpoint's dict
    without the model and optimizer (which DCP loads into the built model); "sharded" names the folder."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        raise UserError(f"{folder} is not a complete sharded checkpoint (no {STATE_FILE}): resume from another one "
                        f"or start again with --init_from=scratch")
    return {**torch.load(path, map_location="cpu", weights_only=True), "sharded": folder}


def _read_state(path: str) -> dict[str, Any]:
    """A checkpoint file's or sharded folder's contents without reading any tensor: a file is mapped (its tensors
    are read on first use), a folder gives its train state."""
    return read_train_state(path) if _is_sharded(path) else load_checkpoint(path, mmap=True)


@dataclass
class Found:
    path: str
    iter_num: int
    note: str  # what else was there, and why this one: "" when it was the only choice
    state: dict = field(default_factory=dict, repr=False)  # read_state's: a file mapped, or a folder's train state

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def read(self) -> dict[str, Any]:
        """What a resume continues from: ckpt.pt's contents (mapped: the ranks of a node share one copy of its
        pages), or a sharded folder's train state (its tensors are loaded by load_training_state once the model is
        built and sharded)."""
        return self.state or _read_state(self.path)

    def describe(self, verb: str) -> str:
        """One line, e.g. 'resuming from ckpt_sharded at iter 15 (ckpt.pt is at iter 10, older)'."""
        return f"{verb} {self.path} at iter {self.iter_num}" + (f" ({self.note})" if self.note else "")


def _listing(out_dir: str) -> str:
    entries = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else None
    if entries is None:
        return f"{out_dir} does not exist"
    return f"{out_dir} holds {', '.join(entries[:8])}{' ...' if len(entries) > 8 else ''}" if entries else \
        f"{out_dir} is empty"


def find_checkpoint(out_dir: str, name: str | None = None, prefer_sharded: bool = False) -> Found:
    """
    The checkpoint of a run: out_dir/name if given, else the newest of the latest saves (ckpt.pt, ckpt_sharded) by
    the iteration each records. At the same iteration (a sharded folder converted to ckpt.pt, say) both hold the
    same weights: the sharded folder for an FSDP run (prefer_sharded), else the file, and the note says so. No
    checkpoint is a UserError naming what out_dir holds.
    """
    if name is not None:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            hint = {BEST_NAME: f"{BEST_NAME} exists only after a run with always_save_checkpoint=False was stopped "
                               f"between evals; otherwise {CKPT_NAME} holds the best weights",
                    SHARDED_BEST_NAME: f"{SHARDED_BEST_NAME} exists only after an FSDP run with "
                                       f"always_save_checkpoint=False saved weights later than its best"}.get(name)
            raise UserError(f"no checkpoint {path} ({_listing(out_dir)}): "
                            + (hint + ": drop --ckpt" if hint else "give --ckpt a checkpoint file or sharded folder "
                               "in out_dir, or leave it out for the newest"))
        return _found(path)
    found, foreign = [], []
    run_id = run_dir.run_id_of(out_dir)
    for candidate in (SHARDED_NAME, CKPT_NAME) if prefer_sharded else (CKPT_NAME, SHARDED_NAME):
        path = os.path.join(out_dir, candidate)
        if os.path.exists(path):
            f = _found(path)
            # a checkpoint of another run (copied in, or left by a version without run ids beside a new run's)
            (foreign if run_id and f.state.get("run_id") not in (None, run_id) else found).append(f)
    if not found and foreign:
        raise UserError(
            f"{' and '.join(f.path for f in foreign)} {'is a checkpoint' if len(foreign) == 1 else 'are checkpoints'} "
            f"of another run (id {foreign[0].state.get('run_id')}) than the one {os.path.join(out_dir, run_dir.RUN_FILE)} "
            f"names ({run_id}), and a resume continues only its own run: move it out of {out_dir} (to resume it, into "
            f"a folder of its own), or start a new run from its weights with --init_from=PATH")
    if not found:
        raise UserError(f"no checkpoint in {out_dir} (neither {CKPT_NAME} nor {SHARDED_NAME}; {_listing(out_dir)}): "
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


def _found(path: str) -> Found:
    state = _read_state(path)
    return Found(path, int(state.get("iter_num", 0)), "", state)


# ----------------------------------------------------------------------------------------------- reading weights


def read_weights(path: str, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """
    The weights of a checkpoint file or sharded folder, for inference and export: {"model": state dict,
    "model_args", "config", "iter_num", "meta"}. A file is mapped, not read, and its optimizer state is never
    touched (a 45M model's ckpt.pt: 615 instead of 1,031 MB max RSS); a sharded folder is gathered into this one
    process on the CPU. `state`: _read_state(path), when the caller has it already.
    """
    if _is_sharded(path):
        model, state = load_sharded_as_full(path)
        weights = model.state_dict()
    else:
        state = state if state is not None else load_checkpoint(path, mmap=True)
        weights = state["model"]
    keep = ("model_args", "config", "meta")
    return {"model": weights, "iter_num": int(state.get("iter_num", 0)), **{k: state.get(k) for k in keep}}


def checkpoint_path(path: str) -> str | None:
    """The checkpoint that `path` names: a checkpoint file, a sharded folder, or a run's folder (its newest
    checkpoint); None for anything else (a GPT-2 name, a HF folder)."""
    if os.path.isfile(path) or _is_sharded(path):
        return path
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")) and any(
            os.path.exists(os.path.join(path, name)) for name in (CKPT_NAME, SHARDED_NAME)):
        return find_checkpoint(path).path
    return None


GPT2_META = {"tokenizer": "gpt2", "vocab_size": 50257}  # GPT-2's weights, and HF GPT-2 folders of that vocabulary


def weights_tokenizer(init_from: str, ckpt: dict | None = None) -> tuple[int, dict | None]:
    """The vocabulary size and tokenizer (None: unknown) of the weights init_from names, read before the weights
    are: `ckpt` is the resumed checkpoint's state (init_from="resume")."""
    if ckpt is None and (path := checkpoint_path(init_from)) is not None:
        ckpt = _read_state(path)
    if ckpt is not None:
        return int(ckpt["model_args"]["vocab_size"]), dataio.recorded_meta(ckpt)[0]
    config = os.path.join(init_from, "config.json")
    if os.path.isfile(config):  # a HF folder
        with open(config) as f:
            vocab = int(json.load(f).get("vocab_size", 0))
        return vocab, GPT2_META if vocab == GPT2_META["vocab_size"] else None
    return GPT2_META["vocab_size"], GPT2_META  # gpt2, gpt2-medium, ... (train.check_config refused anything else)


def load_for_inference(init_from: str, out_dir: str, name: str | None, device: str, dtype: str,
                       overrides: dict[str, Any], compile: bool = False,
                       log: Callable[[str], None] = print,
                       attention_for: Callable[[GPTConfig], str] | None = None) -> tuple[GPT, dataio.Tokenizer]:
    """
    The model to sample or score with (sample.py, hellaswag.py), in eval mode on `device`, and the tokenizer it was
    trained with. init_from: "resume" (out_dir's checkpoint `name`, None: the newest), a checkpoint file, sharded
    folder or run folder, GPT-2's name or a HF folder. `overrides`: attention, sdpa_backend. `attention_for`: the
    attention for the model's config, where it depends on the model's shape (sample.py's attention=auto). The
    attention kernel is checked for `dtype` here, so a refusal is one line before any generation.
    """
    found = find_checkpoint(out_dir, name) if init_from == "resume" else None
    path = found.path if found is not None else checkpoint_path(init_from)
    if path is not None:
        weights = read_weights(path, found.state if found is not None else None)
        log(f"checkpoint: {path} at iter {weights['iter_num']}")
        model = model_from_checkpoint(weights, **overrides)
        tokenizer = dataio.checkpoint_tokenizer(weights, log)
        source = f"the tokenizer of {path}"
        del weights
    else:
        model = GPT.from_pretrained(init_from, overrides)
        log(f"tokenizer: GPT-2 BPE (init_from={init_from})")
        tokenizer, source = dataio.gpt2_tokenizer(), "GPT-2 BPE"
    # nanoGPT's GPT-2 checkpoints say vocab_size=50304 (padded): more rows than the BPE has tokens is fine there,
    # sampling never draws the ids past the tokenizer's
    padded_bpe = isinstance(tokenizer, dataio.GPT2Tokenizer) and model.config.vocab_size > tokenizer.vocab_size
    if tokenizer.vocab_size != model.config.vocab_size and not padded_bpe:
        raise UserError(
            f"{source} ({tokenizer.vocab_size} tokens, logged above) does not fit the model's vocab_size "
            f"{model.config.vocab_size}: the model was trained on another dataset; point its run config's dataset "
            f"(or data_dir) at the data it was trained on"
        )
    if attention_for is not None:
        model.set_attention(attention_for(model.config))
    model.eval().to(device)
    check_attention_kernel(model, autocast_context(device, resolve_dtype(dtype, device, training=False)), compile)
    log(f"model: {model.get_num_params() / 1e6:.2f}M parameters, {model.config}")
    return model, tokenizer


# ----------------------------------------------------------------------------------------------- sharded (DCP)


# torch.distributed.checkpoint is imported where it is used: its import is slow, and runs without sharded
# checkpoints (and sample.py on a ckpt.pt) need not pay for it.


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{model, optimizer} keyed by parameter names (the same on any number of ranks); DTensor shards under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def load_sharded(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a DCP folder into a model (sharded with FSDP or whole) and, if given, its optimizer: DCP reads each
    rank's part of every tensor, whatever the number of ranks that wrote it."""
    import torch.distributed as torch_dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state_dicts(model, optimizer)
    with warnings.catch_warnings():  # one process without a process group (sample.py, conversion) is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=not torch_dist.is_initialized())
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _fault_point(stage: str) -> None:
    """Does nothing; tests replace it to kill the process at a chosen stage of a sharded save."""


def _link(out_dir: str, name: str, target: str) -> None:
    """Point the link out_dir/name at the folder `target` (relative: the run folder can move) with one rename."""
    tmp = os.path.join(out_dir, f"{name}.tmp.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.remove(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(out_dir, name))


def _target(out_dir: str, name: str) -> str | None:
    link = os.path.join(out_dir, name)
    return os.readlink(link) if os.path.islink(link) else None


class ShardedSave:
    """
    A sharded save begun by start_sharded_save: DCP writes the shards in a background thread while training goes
    on, and `finish` (once they are written) makes rank 0 write train_state.pt and move the links. Until then the
    links name the previous save, so a kill in between loses this save only; its folder is removed by the next one.
    """

    def __init__(self, future, link: Callable[[], None], started: float):
        self._future, self._link, self.started = future, link, started

    def done(self) -> bool:
        return self._future.done()

    def finish(self) -> None:
        """Wait for this rank's shards (and, on rank 0, for every rank's: DCP's metadata is written last), link."""
        self._future.result()  # the writer's error, if it failed
        self._link()


def save_sharded(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, dist: Dist,
                 improved: bool = False, keep_best: bool = False) -> str:
    """
    Every rank writes its shards with DCP into a new folder out_dir/ckpt_sharded_<iter>_<n>; rank 0 then writes
    train_state.pt (the folder's completion mark) and points the link out_dir/ckpt_sharded at it with one rename,
    and only then removes the folders no link points at. keep_best (always_save_checkpoint=False): the link
    ckpt_sharded_best points at the best val loss's folder, moved before ckpt_sharded when this save `improved`,
    so at every moment of a kill both links name complete folders. Only the names this function writes are ever
    removed. An optimizer with no state yet (a stop before the first step) is not saved: DCP would fill it with a
    zero-gradient step (step=1), and a resume would then differ from the uninterrupted run. Returns the new folder.
    """
    import torch.distributed as torch_dist
    import torch.distributed.checkpoint as dcp

    folder, state_dicts, link = _begin_sharded(out_dir, model, optimizer, state, dist, improved, keep_best)
    dcp.save(state_dicts, checkpoint_id=folder)  # collective
    link()
    if dist.enabled:
        torch_dist.barrier()
    return folder


def start_sharded_save(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, dist: Dist,
                       process_group, improved: bool = False, keep_best: bool = False) -> ShardedSave:
    """
    save_sharded without waiting for the writes: DCP copies this rank's shards to CPU memory (the weights of this
    step: training may change the originals as soon as this returns), then writes them in a background thread,
    coordinating the ranks over `process_group`, a group of its own (the training's collectives keep their order
    on the default one). Call finish() before the next save and before the process ends.
    """
    import torch.distributed.checkpoint as dcp

    started = time.time()
    folder, state_dicts, link = _begin_sharded(out_dir, model, optimizer, state, dist, improved, keep_best)
    future = dcp.async_save(state_dicts, checkpoint_id=folder, process_group=process_group)
    return ShardedSave(future, link, started)


def _begin_sharded(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, dist: Dist,
                   improved: bool, keep_best: bool) -> tuple[str, dict[str, Any], Callable[[], None]]:
    """A new folder's name (agreed by the ranks), the state dicts DCP writes into it, and what rank 0 does once
    every shard is written (nothing on the other ranks)."""
    import torch.distributed as torch_dist

    name = [None]
    if dist.master:
        n = 0
        while os.path.exists(os.path.join(out_dir, f"{SHARDED_NAME}_{state['iter_num']:07d}_{n}")):
            n += 1
        name = [f"{SHARDED_NAME}_{state['iter_num']:07d}_{n}"]
    if dist.enabled:
        torch_dist.broadcast_object_list(name, src=0)
    stepped = bool(optimizer.state)
    state_dicts = _state_dicts(model, optimizer if stepped else None)
    if not dist.master:
        return os.path.join(out_dir, name[0]), state_dicts, lambda: None
    return os.path.join(out_dir, name[0]), state_dicts, lambda: _complete_sharded(
        out_dir, name[0], {**state, "optimizer_saved": stepped}, improved, keep_best)


def _complete_sharded(out_dir: str, name: str, state: dict, improved: bool, keep_best: bool) -> None:
    """Rank 0, every shard written: train_state.pt marks the folder complete, the links move, older folders go."""
    folder = os.path.join(out_dir, name)
    best = _target(out_dir, SHARDED_BEST_NAME) if keep_best else None
    if keep_best and (improved or best is None and state.get("best_file") == SHARDED_NAME):
        best = name
    best_file = SHARDED_NAME if best == name else SHARDED_BEST_NAME if best else None
    save_checkpoint(os.path.join(folder, STATE_FILE), {**state, "best_file": best_file})
    fsync_folder(folder)
    _fault_point("before_link")
    if best is not None and best != _target(out_dir, SHARDED_BEST_NAME):
        _link(out_dir, SHARDED_BEST_NAME, best)
    _link(out_dir, SHARDED_NAME, name)
    fsync_folder(out_dir)
    _fault_point("after_link")
    if not keep_best:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out_dir, SHARDED_BEST_NAME))
    kept = {name, best}
    for entry in os.listdir(out_dir):  # the previous save, and folders of killed saves: never a user's file
        if _SHARDED_FOLDER.fullmatch(entry) and entry not in kept:
            shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)


def load_sharded_as_full(folder: str, device: str = "cpu", **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """The whole model of a sharded checkpoint in one process (sample.py, conversion), and its train state.
    `overrides` as in model_from_checkpoint."""
    state = read_train_state(folder)
    model = GPT.uninitialized(checkpoint_model_config(state["model_args"], **overrides))
    load_sharded(folder, model, None)  # every weight, or an error
    return model.to(device), state


def convert_to_single_file(folder: str, path: str | None = None) -> str:
    """Write a sharded checkpoint as one ckpt.pt (default: beside the folder) in the format train.py writes
    without FSDP: the model, the optimizer state (torch's format), and the train state. Returns the file."""
    if not _is_sharded(folder):
        raise UserError(f"{folder} is not a sharded checkpoint folder (no {STATE_FILE}): give out_dir/{SHARDED_NAME}")
    path = path or os.path.join(os.path.dirname(os.path.abspath(folder)), CKPT_NAME)
    model, state = load_sharded_as_full(folder)
    cfg = state["config"]
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                           "cpu", fused=False, verbose=False)
    if state.get("optimizer_saved", True):  # else: saved before the first step, an empty state as torch saves it
        load_sharded(folder, model, optimizer)
    state = {k: v for k, v in state.items() if k not in ("sharded", "optimizer_saved")}
    if state.get("best_file") == SHARDED_NAME:  # the folder held the best weights: now this file does
        state["best_file"] = os.path.basename(path)
    elif state.get("best_file") == SHARDED_BEST_NAME:  # kept in the other folder, which this file does not copy
        state["best_file"] = None
    save_checkpoint(path, {**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return path


# ----------------------------------------------------------------------------------------------- resuming


def load_training_state(model: nn.Module, optimizer, ckpt: dict) -> None:
    """
    The optimizer state of a resume, whichever the checkpoint's format and the model's sharding; for a sharded
    checkpoint the weights too (ckpt.pt's are loaded before sharding). `optimizer` is optim.Optimizers, built
    from this run's config: its settings (weight decay, betas, Muon's momentum and weight decay...) are applied
    over the checkpoint's, whose state (moments, step counts) is restored. An optimizer state saved before the
    first step is empty, and the fresh optimizer is already exactly it.
    """
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    torch_optimizer = optimizer.as_torch()
    if "sharded" in ckpt:
        load_sharded(ckpt["sharded"], model, torch_optimizer if ckpt.get("optimizer_saved", True) else None)
    elif not _optimizer_stepped(ckpt["optimizer"]):
        pass
    elif any(is_dtensor(p) for p in model.parameters()):
        _load_full_optimizer_state(model, torch_optimizer, ckpt["optimizer"])
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)


def _optimizer_stepped(optim_sd: dict) -> bool:
    """Whether a saved optimizer state (torch's format, or Optimizers' {name: state} for Muon + AdamW) holds any
    step's state."""
    if "state" in optim_sd:
        return bool(optim_sd["state"])
    return any(_optimizer_stepped(sd) for sd in optim_sd.values())


def _load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict) -> None:
    """A ckpt.pt's optimizer state (torch's format: whole tensors keyed by position) into a sharded model's
    optimizer: the positions become parameter names, and each rank keeps its shard of every tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = {
        "state": {order[i]: s for i, s in optim_sd["state"].items()},
        "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optim_sd["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
