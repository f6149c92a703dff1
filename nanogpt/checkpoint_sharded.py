"""FSDP's sharded checkpoints: a folder that torch.distributed.checkpoint (DCP) writes, each rank its shards, plus
train_state.pt (everything but the tensors), written last as the folder's completion mark; the link
out_dir/ckpt_sharded names the latest complete folder (ckpt_sharded_best the best val loss's). Any number of ranks
reads any folder, and one process gathers it whole (sample.py) or writes it as one ckpt.pt (convert_sharded.py).
torch.distributed.checkpoint is imported where it is used: its import is slow, and most runs never need it."""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from nanogpt import files, outdir
from nanogpt.checkpoint_file import checkpoint_model_config, is_ours, load_checkpoint, save_checkpoint
from nanogpt.errors import UserError, WriteError
from nanogpt.files import fsync_folder
from nanogpt.distributed import Dist
from nanogpt.outdir import CKPT, SHARDED, SHARDED_BEST, SHARDED_FOLDER, sharded_folder
from model import GPT

STATE_FILE = "train_state.pt"  # in a sharded folder: everything but the tensors (iteration, config, RNG), written last
METADATA_FILE = ".metadata"  # DCP's index of the tensors: which shard file holds each one's bytes, and where


def is_sharded(path: str) -> bool:
    """A sharded checkpoint: a folder (or the link ckpt_sharded to one) that holds train_state.pt."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE_FILE))


def read_train_state(folder: str) -> dict[str, Any]:
    """A sharded folder's load_checkpoint dict, without the tensors DCP loads into the model; "sharded" names it."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        raise UserError(f"{folder} is not a complete sharded checkpoint (no {STATE_FILE}): resume from another one "
                        f"or start again with --init_from=scratch")
    return {**load_checkpoint(path, tensors=False), "sharded": folder}


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{model, optimizer} keyed by parameter names (the same on any number of ranks); DTensor shards under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if optimizer is None:
        return {"model": get_state_dict(model, [])[0]}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def _damaged(folder: str, what: str) -> UserError:
    shown = f"{folder} (-> {os.readlink(folder)})" if os.path.islink(folder) else folder
    return UserError(f"sharded checkpoint {shown} is damaged: {what}: restore it from a backup, or use another "
                     f"checkpoint (a run: start again with --init_from=scratch); nothing was changed")


def check_sharded(folder: str) -> None:
    """Before DCP reads a folder: its .metadata loads, and each shard file it indexes is there, whole. A missing or
    cut-short file is a UserError naming it, on every rank before any collective, so no rank waits for the others."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(folder, METADATA_FILE)):
        raise _damaged(folder, f"it has no {METADATA_FILE} (DCP's index of its shards)")
    try:
        metadata = FileSystemReader(folder).read_metadata()
        ends: dict[str, int] = {}  # each shard file: where its last indexed bytes end
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as e:  # pickle's errors for a file cut short, anything for one that is not DCP's
        raise _damaged(folder, f"its {METADATA_FILE} is cut short or not DCP's ({_first_line(e)})") from None
    for name, end in sorted(ends.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise _damaged(folder, f"its shard file {name} is missing")
        if (size := os.path.getsize(path)) < end:
            raise _damaged(folder, f"its shard file {name} is cut short ({size} of {end} bytes)")


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_READ_ERRORS = (OSError, EOFError, pickle.UnpicklingError)  # a shard's bytes that do not read as what DCP wrote


def load_sharded(folder: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a DCP folder into a model (FSDP-sharded or whole) and, if given, its optimizer, whatever the number of
    ranks that wrote it; a damaged folder is a UserError on every rank."""
    import torch.distributed as torch_dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    check_sharded(folder)
    state = _state_dicts(model, optimizer)
    try:
        with warnings.catch_warnings():  # one process without a process group (sample.py, conversion) is intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=folder, no_dist=not torch_dist.is_initialized())
    except (*_READ_ERRORS, CheckpointException) as e:  # DCP gathers each rank's error into a CheckpointException
        errors = _errors_of(e)
        if not errors or not all(isinstance(exc, _READ_ERRORS) for exc in errors):
            raise
        exc = errors[0]  # torch.load's text for bytes that are not its own (weights_only's advice) would mislead
        why = _first_line(exc) if isinstance(exc, OSError) else type(exc).__name__
        raise _damaged(folder, f"a shard file does not read as DCP wrote it ({why})") from None
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))


def _errors_of(e: BaseException) -> list[BaseException]:
    """The ranks' errors that DCP gathered into a CheckpointException, or [e] itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    return [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else [e]


def _fault_point(stage: str) -> None:
    """Does nothing; tests replace it to kill the process at a chosen stage of a sharded save."""


@contextlib.contextmanager
def _write_errors(path: str):
    """A sharded save that fails on an OSError (behind DCP's own errors, gathered from every rank) is a WriteError
    naming the folder; the link still names the last complete save."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        yield
    except (Exception, CheckpointException) as e:
        failed = next((exc for exc in _errors_of(e) if files.caused_by_os_error(exc)), None)
        if failed is None:
            raise
        shutil.rmtree(path, ignore_errors=True)  # this save's part-written folder: no link names it, and it holds space
        earlier = os.path.islink(os.path.join(os.path.dirname(path), SHARDED))
        raise files.write_failed(path, failed, "the previous sharded checkpoint is intact" if earlier else
                                  "its part-written folder removed", "sharded checkpoint") from None


def _target(out_dir: str, name: str) -> str | None:
    link = os.path.join(out_dir, name)
    return os.readlink(link) if os.path.islink(link) else None


class ShardedSave:
    """A save begun by start_sharded_save: DCP writes the shards in a background thread, then `finish` makes rank 0
    write train_state.pt and move the links; until then they name the previous save, which a kill leaves whole."""

    def __init__(self, future, link: Callable[[], None], started: float, folder: str):
        self._future, self._link, self.started, self.folder = future, link, started, folder

    def done(self) -> bool:
        return self._future.done()

    def finish(self) -> None:
        """Wait for this rank's shards (and, on rank 0, for every rank's: DCP's metadata is written last), link."""
        with _write_errors(self.folder):
            self._future.result()  # the writer's error, if it failed
        self._link()


def save_sharded(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, dist: Dist,
                 improved: bool = False, keep_best: bool = False) -> str:
    """Every rank writes its shards with DCP into a new folder ckpt_sharded_<iter>_<n>; rank 0 then writes
    train_state.pt (the completion mark), points ckpt_sharded at it with one rename, and removes the folders no link
    names. keep_best: ckpt_sharded_best names the best val loss's folder, moved first when this save `improved`, so at
    every moment both links name complete folders. An optimizer with no state yet is not saved: DCP would fill it with
    a zero-gradient step (step=1), and a resume would differ from the uninterrupted run. Returns the new folder."""
    import torch.distributed as torch_dist
    import torch.distributed.checkpoint as dcp

    folder, state_dicts, link = _begin_sharded(out_dir, model, optimizer, state, dist, improved, keep_best)
    with _write_errors(folder):
        dcp.save(state_dicts, checkpoint_id=folder)  # collective
    link()
    if dist.enabled:
        torch_dist.barrier()
    return folder


def start_sharded_save(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, dist: Dist,
                       process_group, improved: bool = False, keep_best: bool = False) -> ShardedSave:
    """save_sharded without waiting for the writes: DCP copies this rank's shards to CPU memory, then writes them in a
    background thread over `process_group`, a group of its own (the training's collectives keep their order on the
    default one). Call finish() before the next save and before the process ends."""
    import torch.distributed.checkpoint as dcp

    started = time.time()
    folder, state_dicts, link = _begin_sharded(out_dir, model, optimizer, state, dist, improved, keep_best)
    future = dcp.async_save(state_dicts, checkpoint_id=folder, process_group=process_group)
    return ShardedSave(future, link, started, folder)


def _begin_sharded(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, dist: Dist,
                   improved: bool, keep_best: bool) -> tuple[str, dict[str, Any], Callable[[], None]]:
    """A new folder's name (agreed by the ranks), the state dicts DCP writes, and rank 0's work once all are written."""
    import torch.distributed as torch_dist

    name = [None]
    if dist.master:
        n = 0
        while os.path.exists(os.path.join(out_dir, sharded_folder(state['iter_num'], n))):
            n += 1
        name = [sharded_folder(state['iter_num'], n)]
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
    best = _target(out_dir, SHARDED_BEST) if keep_best else None
    if keep_best and (improved or best is None and state.get("best_file") == SHARDED):
        best = name
    best_file = SHARDED if best == name else SHARDED_BEST if best else None
    try:
        save_checkpoint(os.path.join(folder, STATE_FILE), {**state, "best_file": best_file})
        fsync_folder(folder)
    except WriteError:
        shutil.rmtree(folder, ignore_errors=True)  # never complete: no link names it, and it holds the disk's space
        raise
    _fault_point("before_link")
    if best is not None and best != _target(out_dir, SHARDED_BEST):
        files.replace_link(os.path.join(out_dir, SHARDED_BEST), best)
    files.replace_link(os.path.join(out_dir, SHARDED), name)
    fsync_folder(out_dir)
    _fault_point("after_link")
    if not keep_best:
        files.remove_file(os.path.join(out_dir, SHARDED_BEST), "the best save's link")
    kept = {name, best}  # the previous save, and folders of killed saves, go: never a user's file
    outdir.remove_saves(out_dir, [e for e in os.listdir(out_dir) if SHARDED_FOLDER.fullmatch(e) and e not in kept])


def load_sharded_as_full(folder: str, device: str = "cpu", **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """The whole model of a sharded checkpoint in one process, and its train state (`overrides`: the model's)."""
    state = read_train_state(folder)
    model = GPT.uninitialized(checkpoint_model_config(state["model_args"], **overrides))
    load_sharded(folder, model, None)  # every weight, or an error
    return model.to(device), state


def convert_to_single_file(folder: str, path: str | None = None) -> str:
    """Write a sharded checkpoint as one ckpt.pt (default: beside the folder), as a run without FSDP writes it."""
    if not os.path.exists(folder):
        raise UserError(f"{folder} does not exist: give an FSDP run's out_dir/{SHARDED}")
    if not is_sharded(folder):
        raise UserError(f"{folder} is not a sharded checkpoint folder (no {STATE_FILE}): give out_dir/{SHARDED}")
    path = path or os.path.join(os.path.dirname(os.path.abspath(folder)), CKPT)
    run_id = read_train_state(folder).get("run_id")
    if (why := files.target_problem(path)) is not None:
        raise UserError(f"cannot write {path}: {why}")
    if os.path.isfile(path) and not is_ours(path, run_id):  # only a conversion of the same run is replaced
        raise UserError(f"{path} exists and is not a checkpoint of this run ({run_id}): it is not written over; give "
                        f"another file name (python convert_sharded.py FOLDER OUT_FILE), or move it away first")
    model, state = load_sharded_as_full(folder)
    cfg = state["config"]
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                           "cpu", fused=False, verbose=False)
    if state.get("optimizer_saved", True):  # else: saved before the first step, an empty state as torch saves it
        load_sharded(folder, model, optimizer)
    state = {k: v for k, v in state.items() if k not in ("sharded", "optimizer_saved")}
    if state.get("best_file") in (SHARDED, SHARDED_BEST):  # the folder held the best weights: now this file does,
        # where it is one a run reads (ckpt.pt); the other folder's (SHARDED_BEST) this file does not copy
        state["best_file"] = CKPT if state["best_file"] == SHARDED and os.path.basename(path) == CKPT else None
    save_checkpoint(path, {**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return path

