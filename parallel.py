"""
Training beyond one GPU's memory: FSDP2 sharding, activation checkpointing, sharded checkpoints.

With parallelism="fsdp" every rank keeps only its 1/N shard of the parameters, gradients and AdamW state
(PyTorch's own `torch.distributed.fsdp.fully_shard`, FSDP2): each transformer block and then the whole model is
a unit whose full parameters are all-gathered just before its forward (and backward) and freed after; gradients
are reduce-scattered. Checkpoints are written with `torch.distributed.checkpoint` (DCP): each rank writes its own
shards into a folder, so no rank ever holds the whole model; any number of ranks can load the folder.

Convert a sharded checkpoint into the single ckpt.pt that sample.py and fine-tuning read (written beside it):
$ python parallel.py out/ckpt_sharded
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import warnings
from functools import partial
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from common import Dist, UserError, _fsync_folder, exit_on_user_error, load_checkpoint, save_checkpoint
from model import GPT

PARALLELISMS = ("ddp", "fsdp")
SHARDED_NAME = "ckpt_sharded"  # out_dir/ckpt_sharded: a link to the folder of the latest complete checkpoint
STATE_FILE = "train_state.pt"  # in that folder: everything but the tensors (iteration, config, RNG), written last


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (an FSDP shard), without importing torch.distributed.tensor: importing it and FSDP
    made every sample.py start 1.2 s slower on 2 cores (3.9 -> 2.7 s for a tiny checkpoint). train.py and bench.py
    import them anyway (a torch.optim optimizer imports torch._dynamo, which imports FSDP). No DTensor exists until
    FSDP (or the DCP reader) has imported that module."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def config_problems(cfg) -> list[str]:
    """What parallelism="fsdp" cannot do, for train.check_config's one error."""
    problems = []
    if cfg.parallelism not in PARALLELISMS:
        problems.append(f"parallelism={cfg.parallelism!r} is not one of {', '.join(PARALLELISMS)}")
    if cfg.parallelism != "fsdp":
        return problems
    if cfg.dtype == "float16":
        problems.append("dtype='float16' is not supported with parallelism='fsdp' (no sharded grad scaler here): "
                        "use bfloat16 or float32")
    if cfg.hellaswag:  # its ranks score different numbers of batches, while FSDP's forwards are collective
        problems.append("hellaswag=True is not supported with parallelism='fsdp' yet: score the checkpoint with "
                        "python hellaswag.py instead")
    if cfg.keep_last:
        problems.append(f"keep_last={cfg.keep_last} is not supported with sharded checkpoints: set keep_last=0")
    if not cfg.always_save_checkpoint:
        problems.append("always_save_checkpoint=False is not supported with sharded checkpoints (the folder holds "
                        "the latest save): set always_save_checkpoint=True")
    return problems


# ----------------------------------------------------------------------------------------------- the model


@contextlib.contextmanager
def same_random_init(seed: int, enabled: bool):
    """Under FSDP each rank keeps its shard of the weights it built (nothing is broadcast, unlike DDP), so every
    rank builds them from the same seed; the ranks' own RNG streams (dropout) continue unchanged after."""
    if not enabled:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def checkpoint_activations(model: GPT, setting: bool | int) -> int:
    """
    Recompute the activations of the first N blocks in the backward instead of keeping them (True: all blocks,
    False: none); returns N. Each block's output is kept, its insides (attention, MLP: ~90% of a block's
    activations) are recomputed, which costs about one more forward of those blocks. The blocks keep their
    parameter names (the block's own forward is wrapped), so checkpoints do not change.
    """
    n_layer = len(model.transformer.h)
    n = n_layer if setting is True else 0 if setting is False else setting
    if not 0 <= n <= n_layer:
        raise UserError(f"activation_checkpointing={setting} must be True, False or a number of blocks 0..{n_layer}")
    for block in model.transformer.h[:n]:
        block.forward = partial(_checkpointed, block.forward)
    return n


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation, generation: nothing to save memory for
        return forward(*args, **kwargs)
    # use_reentrant=False: the variant PyTorch recommends, which works with FSDP2, torch.compile and kwargs
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def shard_model(model: GPT, dist: Dist, dtype: str, compile: bool) -> GPT:
    """
    FSDP2: each block, then the root (embeddings, final norm, head), becomes a unit sharded over all ranks. With
    dtype bfloat16 the all-gathered parameters are bf16 for compute while gradients are reduced, and the
    sharded parameters and AdamW state kept, in float32. torch.compile goes on each block before sharding, as
    PyTorch's FSDP2 guidance and torchtitan do: the per-block all-gathers stay outside the compiled graphs. The
    model may be on the CPU: fully_shard moves each rank's shard to the mesh's device, so no GPU ever holds
    the whole model.
    """
    device_type = dist.device.split(":")[0]
    from torch.distributed.device_mesh import init_device_mesh  # FSDP's modules: imported where used (below)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.world_size,))
    if dtype == "float16":  # resolved from dtype="auto" on a GPU without bf16
        raise UserError("parallelism='fsdp' needs bfloat16 or float32 (no sharded grad scaler here): set --dtype")
    if dtype == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for block in model.transformer.h:
        if compile:
            block.compile()  # in place: the parameter names stay those of the plain model
        # The last block's parameters are all-gathered again first thing in the backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block is not model.transformer.h[-1])
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # The root returns the logits cropped to the real vocabulary (a view); nothing modifies them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPT\) returned a view tensor")
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, dist: Dist, sync: bool):
    """Accumulation micro-steps before the last need no gradient communication: DDP's no_sync, or FSDP2's
    set_requires_gradient_sync (gradients then accumulate unsharded on each rank until the last micro-step's
    reduce-scatter)."""
    if sync or not dist.enabled:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ that also works on FSDP's sharded gradients: the norm of each rank's shards
    is a partial result, reduced over all ranks (full_tensor) into the total norm before any gradient is scaled.
    Returns the total norm as a plain tensor."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def eval_batch_indices(eval_iters: int, dist: Dist, sharded: bool) -> list[tuple[int, bool]]:
    """This rank's evaluation batches as (batch index, counted). Ranks split the batches; under FSDP every forward
    is collective (the all-gathers), so each rank runs the same number, a rank short of batches repeating
    one without counting it."""
    ks = list(range(dist.rank, eval_iters, dist.world_size))
    if not sharded:
        return [(k, True) for k in ks]
    rounds = -(-eval_iters // dist.world_size)
    return [(k, True) for k in ks] + [(0, False)] * (rounds - len(ks))


def memory_per_rank(model: nn.Module, optimizer: str = "adamw") -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, from the local shards of the parameters
    (the whole tensors without FSDP). Gradients have the parameters' local shape and dtype; AdamW keeps two float32
    moments per element."""
    params = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
    numel = sum(_local(p).numel() for p in model.parameters())
    states = {"adamw": 2 * 4}[optimizer]
    return {"params": params, "grads": params, "optimizer": numel * states, "numel": numel}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def memory_text(mem: dict[str, int], world_size: int) -> str:
    gib = 1 << 30
    total = mem["params"] + mem["grads"] + mem["optimizer"]
    return (f"memory per rank: params {mem['params'] / gib:.3f} GiB + grads {mem['grads'] / gib:.3f} GiB + optimizer "
            f"{mem['optimizer'] / gib:.3f} GiB = {total / gib:.3f} GiB ({mem['numel']:,} elements on this rank "
            f"of {world_size}; {total} bytes)")


# ----------------------------------------------------------------------------------------------- checkpoints


def find_resume_checkpoint(out_dir: str, parallelism: str) -> str:
    """The checkpoint a resume reads: the sharded folder for FSDP runs, ckpt.pt otherwise; the other format when
    the preferred one is missing (so any run resumes from any checkpoint, with any number of ranks)."""
    sharded, single = os.path.join(out_dir, SHARDED_NAME), os.path.join(out_dir, "ckpt.pt")
    order = (sharded, single) if parallelism == "fsdp" else (single, sharded)
    for path in order:
        if os.path.exists(path):
            return path
    return single  # load_checkpoint's error says what is missing


def is_sharded(path: str) -> bool:
    return os.path.isdir(path)


def read_resume_checkpoint(out_dir: str, parallelism: str) -> dict[str, Any]:
    """The checkpoint a resume continues, as a dict: ckpt.pt's whole contents, or a sharded folder's train state
    (its tensors are loaded by load_optimizer_and_sharded_weights once the model is built and sharded)."""
    path = find_resume_checkpoint(out_dir, parallelism)
    # mmap: the ranks of a node share one copy of ckpt.pt's pages instead of each reading all of it into memory
    return read_train_state(path) if is_sharded(path) else load_checkpoint(path, map_location="cpu", mmap=True)


def load_optimizer_and_sharded_weights(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt: dict) -> None:
    """The optimizer state of a resume, whichever the checkpoint's format and the model's sharding; for a sharded
    checkpoint the weights too (ckpt.pt's are loaded before sharding)."""
    if "sharded" in ckpt:
        load_sharded(ckpt["sharded"], model, optimizer)
    elif any(is_dtensor(p) for p in model.parameters()):
        load_full_optimizer_state(model, optimizer, ckpt["optimizer"])
    else:
        optimizer.load_state_dict(ckpt["optimizer"])


def read_train_state(folder: str) -> dict[str, Any]:
    """The non-tensor part of a sharded checkpoint (iteration, config, model_args, RNG), as load_checkpoint's dict
    without the model and optimizer (which DCP loads into the built model)."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        raise UserError(f"{folder} is not a complete sharded checkpoint (no {STATE_FILE}): resume from another one "
                        f"or start again with --init_from=scratch")
    return {**torch.load(path, map_location="cpu", weights_only=True), "sharded": folder}


# torch.distributed.checkpoint is imported where it is used: importing it takes ~0.5 s, which runs without sharded
# checkpoints (and sample.py on a ckpt.pt) need not pay.


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


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict) -> None:
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


def _fault_point(stage: str) -> None:
    """Does nothing; tests replace it to kill the process at a chosen stage of a sharded save."""


def save_sharded(out_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict,
                 dist: Dist) -> str:
    """
    Every rank writes its shards with DCP into a new folder out_dir/ckpt_sharded_<iter>_<n>; rank 0 then writes
    train_state.pt (the folder's completion mark) and points the link out_dir/ckpt_sharded at it with one
    rename, and only then removes the previous folder. A kill at any moment leaves the link on a complete
    checkpoint; folders of killed saves are removed by the next save. Returns the new folder.
    """
    import torch.distributed.checkpoint as dcp

    link = os.path.join(out_dir, SHARDED_NAME)
    name = [None]
    if dist.master:
        current = os.readlink(link) if os.path.islink(link) else None
        for entry in os.listdir(out_dir):  # left by a killed save
            if entry.startswith(SHARDED_NAME + "_") and entry != current:
                shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)
        n = 0
        while os.path.exists(os.path.join(out_dir, f"{SHARDED_NAME}_{train_state['iter_num']:07d}_{n}")):
            n += 1
        name = [f"{SHARDED_NAME}_{train_state['iter_num']:07d}_{n}"]
    if dist.enabled:
        torch_dist.broadcast_object_list(name, src=0)
    folder = os.path.join(out_dir, name[0])
    dcp.save(_state_dicts(model, optimizer), checkpoint_id=folder)  # collective: returns when every rank wrote
    if dist.master:
        save_checkpoint(os.path.join(folder, STATE_FILE), train_state)
        _fsync_folder(folder)
        _fault_point("before_link")
        old = os.path.join(out_dir, os.readlink(link)) if os.path.islink(link) else None
        tmp = f"{link}.tmp.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        os.symlink(name[0], tmp)  # relative: the run folder can be moved
        os.replace(tmp, link)
        _fsync_folder(out_dir)
        _fault_point("after_link")
        if old is not None and os.path.abspath(old) != os.path.abspath(folder):
            shutil.rmtree(old, ignore_errors=True)
    if dist.enabled:
        torch_dist.barrier()
    return folder


def load_sharded_as_full(folder: str, device: str = "cpu", **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """The whole model of a sharded checkpoint in one process (sample.py, conversion), and its train state.
    `overrides` as in common.model_from_checkpoint."""
    from common import checkpoint_model_config

    state = read_train_state(folder)
    model = GPT(checkpoint_model_config(state["model_args"], **overrides))
    load_sharded(folder, model, None)
    return model.to(device), state


def convert_to_single_file(folder: str, path: str | None = None) -> str:
    """Write a sharded checkpoint as one ckpt.pt (default: beside the folder) in the format train.py writes
    without FSDP: the model, the optimizer state (torch's format), and the train state. Returns the file."""
    path = path or os.path.join(os.path.dirname(os.path.abspath(folder)), "ckpt.pt")
    model, state = load_sharded_as_full(folder)
    cfg = state["config"]
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]),
                                           "cpu", fused=False, verbose=False)
    load_sharded(folder, model, optimizer)
    state = {k: v for k, v in state.items() if k != "sharded"}
    if state.get("best_file") == SHARDED_NAME:  # the folder held the best weights: now this file does
        state["best_file"] = os.path.basename(path)
    save_checkpoint(path, {**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
    return path


def main(argv: list[str]) -> None:
    from configurator import exit_on_help

    exit_on_help(argv, __doc__)  # --help, -h: the usage, exit 0
    if len(argv) not in (1, 2) or argv[0].startswith("-"):
        raise UserError("usage: python parallel.py OUT_DIR/ckpt_sharded [OUT_FILE] (default OUT_DIR/ckpt.pt)")
    if not is_sharded(argv[0]):
        raise UserError(f"{argv[0]} is not a sharded checkpoint folder: give out_dir/{SHARDED_NAME}")
    path = convert_to_single_file(*argv)
    print(f"wrote {path}")


if __name__ == "__main__":
    exit_on_user_error(lambda: main(sys.argv[1:]))
