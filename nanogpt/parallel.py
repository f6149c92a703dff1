"""Training beyond one GPU's memory: FSDP2 sharding (fully_shard: each rank keeps 1/N of the parameters, gradients
and AdamW state, a block's full parameters all-gathered just for its forward and backward), activation checkpointing,
and what the step needs under them. A sharded run saves DCP folders (checkpoint_sharded.py), which sample.py,
export.py, hellaswag.py and init_from read as they read a ckpt.pt; convert_sharded.py writes one as a ckpt.pt.
"""
from __future__ import annotations

import contextlib
import warnings
from functools import partial

import torch
import torch.nn as nn
import torch.utils.checkpoint

from nanogpt.errors import UserError
from nanogpt.distributed import Dist, is_dtensor
from model import GPT


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
    """Recompute the insides (~90% of the activations) of the first N blocks in the backward instead of keeping them,
    for about one more forward of them (True: all, False: none); returns N. Wrapping the block's own forward keeps
    the parameter names, so checkpoints do not change."""
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
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def shard_model(model: GPT, dist: Dist, dtype: str, compile: bool, compile_mode: str = "default") -> GPT:
    """FSDP2: each block, then the root, a unit sharded over all ranks; under bfloat16 the gathered parameters are
    bf16, gradients reduced and state kept in float32. Blocks are compiled before sharding (as torchtitan does), so
    the all-gathers stay outside the graphs. The model may be on the CPU: no GPU ever holds all of it."""
    device_type = dist.device.split(":")[0]
    from torch.distributed.device_mesh import init_device_mesh  # FSDP's modules: imported where used (below)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.world_size,))
    if dtype == "float16":  # resolved from dtype="auto" on a GPU without bf16
        raise UserError("parallelism='fsdp' needs bfloat16 or float32 (no sharded grad scaler here): set --dtype")
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = MixedPrecisionPolicy(**(bf16 if dtype == "bfloat16" else {}))
    for block in model.transformer.h:
        if compile:  # in place: the parameter names stay those of the plain model
            block.compile(mode=None if compile_mode == "default" else compile_mode)
        # The last block's parameters are all-gathered again first thing in the backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=block is not model.transformer.h[-1])
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # The root returns the logits cropped to the real vocabulary (a view); nothing modifies them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPT\) returned a view tensor")
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, dist: Dist, sync: bool):
    """No gradient communication in the micro-steps before the last: DDP's no_sync, or FSDP2's
    set_requires_gradient_sync (gradients then accumulate unsharded until the last one's reduce-scatter)."""
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
    """clip_grad_norm_ that works on FSDP's sharded gradients too: each rank's partial norm is reduced into the total
    (full_tensor) before any gradient is scaled. Returns the total norm as a plain tensor."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if is_dtensor(norm):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def eval_batch_indices(eval_iters: int, dist: Dist, sharded: bool) -> list[tuple[int, bool]]:
    """This rank's share of the eval batches as (index, counted). Under FSDP every forward is collective, so each
    rank runs as many, one short repeating a batch it does not count."""
    ks = list(range(dist.rank, eval_iters, dist.world_size))
    if not sharded:
        return [(k, True) for k in ks]
    rounds = -(-eval_iters // dist.world_size)
    return [(k, True) for k in ks] + [(0, False)] * (rounds - len(ks))


def memory_per_rank(model: nn.Module, micro_steps: int = 1, one_moment: list = ()) -> dict[str, int | bool]:
    """Bytes this rank holds at its peak for parameters, gradients and optimizer state (AdamW: two float32 moments;
    the parameters in `one_moment`, Muon's, one), from the local shards. Under FSDP with micro_steps > 1 the
    micro-steps before the last skip the reduce-scatter, so each rank accumulates the whole model's gradients
    unsharded in float32 (measured on 2 ranks: 2 x the sharded bytes); the last one replaces them unit by unit, so
    those are the gradients counted ("unsharded_grads": True)."""
    local = [p.to_local() if is_dtensor(p) else p for p in model.parameters()]
    params = sum(t.numel() * t.element_size() for t in local)
    numel = sum(t.numel() for t in local)
    unsharded_grads = micro_steps > 1 and any(is_dtensor(p) for p in model.parameters())
    # a DTensor's numel() is the whole tensor's
    grads = sum(p.numel() * p.element_size() for p in model.parameters()) if unsharded_grads else params
    states = 8 * numel - 4 * sum(p.numel() for p in one_moment)
    return {"params": params, "grads": grads, "optimizer": states, "numel": numel,
            "unsharded_grads": unsharded_grads}


def memory_text(mem: dict[str, int | bool], world_size: int) -> str:
    gib = 1 << 30
    total = mem["params"] + mem["grads"] + mem["optimizer"]
    grads = " (whole model, unsharded: accumulated over the no-sync micro-steps)" if mem["unsharded_grads"] else ""
    return (f"memory per rank: params {mem['params'] / gib:.3f} GiB + grads {mem['grads'] / gib:.3f} GiB{grads} + "
            f"optimizer {mem['optimizer'] / gib:.3f} GiB = {total / gib:.3f} GiB ({mem['numel']:,} elements on this "
            f"rank of {world_size}; {total} bytes)")
