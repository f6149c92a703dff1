"""Running on several processes: joining and leaving the process group (torchrun's DDP and FSDP ranks, or one
process), DDP's wrapper settings, and the checks that every rank has rank 0's settings and sees its out_dir."""
from __future__ import annotations

import contextlib
import gc
import inspect
import os
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nanogpt import files
from nanogpt.device import resolve_device
from nanogpt.errors import Interrupted, Stopped, UserError

T = TypeVar("T")


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    enabled: bool = False  # in a torch.distributed process group (set by setup_distributed only)

    @property
    def master(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Every rank waits here for the others (nothing to wait for without a process group)."""
        if self.enabled:
            torch_dist.barrier()


def setup_distributed(device: str, backend: str = "auto", group_of_one: bool = False) -> Dist:
    """Under torchrun (RANK in the environment) join the process group: nccl on CUDA (one GPU per local rank), gloo on
    the CPU. Otherwise one process, in a group of one with group_of_one (FSDP needs a group)."""
    device = resolve_device(device)
    if "RANK" not in os.environ and not group_of_one:
        return Dist(device=device)
    # torch.distributed.nn and FSDP bind the default group as default arguments when first imported, and a run
    # imports them after this point (torch._dynamo does, on the first optimizer): the group would then never be
    # freed, and gloo's threads would outlive it (see cleanup_distributed). Imported now, they bind None.
    from torch.distributed import fsdp, nn as distributed_nn  # noqa: F401

    env = os.environ if "RANK" in os.environ else {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    rank, local_rank, world_size = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device_type = device.split(":")[0]
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise UserError(f"backend={backend!r} is not one of auto, nccl, gloo")
    if backend == "nccl" and device_type != "cuda":
        raise UserError(f"backend='nccl' needs CUDA but device={device!r}: use --backend=gloo (or auto)")
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"local rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}; "
                            f"use torchrun --nproc_per_node={torch.cuda.device_count()} or fewer")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if "RANK" in os.environ and restart > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # A torchrun restart reuses its agent's store, which still holds the failed attempt's keys (each rank's
        # gloo address among them): a rank that read its peer's old address waited forever to connect. The
        # attempt's own prefix keeps the attempts apart.
        store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False)
        torch_dist.init_process_group(backend=backend, store=torch_dist.PrefixStore(f"/attempt_{restart}", store),
                                      rank=rank, world_size=world_size)
    elif "RANK" in os.environ:
        torch_dist.init_process_group(backend=backend)
    else:  # no torchrun: an in-memory store instead of its rendezvous
        torch_dist.init_process_group(backend=backend, store=torch_dist.HashStore(), rank=0, world_size=1)
    return Dist(rank=rank, local_rank=local_rank, world_size=world_size, device=device, enabled=True)


JOB_KEY = "nanogpt/job"  # in torchrun's store: torchrun_job's id


def torchrun_job() -> str | None:
    """An id of this torchrun job, the same in every worker of every restart and in no other job: the first worker
    writes it into the agent's store, which lives as long as the job (TORCHELASTIC_RUN_ID is "none" for every static
    rendezvous). None outside torchrun, or where workers do not share the agent's store: restarts follow init_from."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return store.compare_set(JOB_KEY, "", uuid.uuid4().hex[:12]).decode()  # the first asker's, kept


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (an FSDP shard), without importing torch.distributed.tensor, which made every sample.py
    start slower: no DTensor exists before something imported it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def checkpoint_group(d: Dist) -> torch_dist.ProcessGroup | None:
    """A gloo group for saves written in the background: their collectives, in another thread, would interleave with
    the training's in an order that differs between ranks (a hang). None without a group."""
    return torch_dist.new_group(backend="gloo") if d.enabled else None


def cleanup_distributed(d: Dist, barrier: bool = False) -> None:
    """The end of a process group: with `barrier` (only where every rank is known to get here) every rank waits for
    the others, so none exits while another still writes; then the group is destroyed and freed, since only its
    destructor stops gloo's worker threads, and one left running into interpreter exit aborts the process ("terminate
    called without an active exception"). Whatever holds the group (a DDP wrapper, an FSDP model) is released before
    this call; the collection here frees what only reference cycles kept."""
    if not d.enabled or not torch_dist.is_initialized():
        return
    if barrier:
        torch_dist.barrier()
    _forget_device_mesh_groups()
    gc.collect()
    torch_dist.destroy_process_group()


def run_in_group(dist: Dist, work: Callable[[], T]) -> T:
    """work(), then the end of the process group: after its end or a stop all ranks agreed on (Stopped) with a
    barrier, after any other error without. What holds the group must be work()'s locals, gone when it returns; a
    stop's exception is raised anew, since the one caught holds work()'s frames."""
    stopped = None
    try:
        result = work()
    except Interrupted:
        cleanup_distributed(dist)
        raise
    except Stopped as e:
        stopped = Stopped(e.message, e.code)
    except BaseException:
        cleanup_distributed(dist)
        raise
    cleanup_distributed(dist, barrier=True)  # every rank gets here, the last save done: the end, or the same stop
    if stopped is not None:
        raise stopped
    return result


def _forget_device_mesh_groups() -> None:
    """FSDP's DeviceMesh holds its process groups, and torch's DTensor caches keep the mesh alive past the run (torch
    2.13, no public way to release it): at the end, when no mesh is used any more, the meshes let go of them."""
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    if device_mesh is None:
        return
    for obj in gc.get_objects():
        # type(), not isinstance(): the heap holds weak proxies, and isinstance() on a dead one raises ReferenceError
        if issubclass(type(obj), device_mesh.DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()


# The model has no buffers (causal masks are built per forward): DDP need not sync them before every forward.
# PyTorch 2.13 renamed the switch (broadcast_buffers is deprecated there); older releases only have broadcast_buffers.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                  else {"broadcast_buffers": False})
# gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets instead of a second copy, one
# gradient's size less memory (tests/cuda/test_cuda_ddp.py measures it).
DDP_SETTINGS = {**NO_BUFFER_SYNC, "gradient_as_bucket_view": True}


def check_same_settings(settings: dict, dist: Dist) -> None:
    """Every rank's resolved settings are rank 0's, else a UserError on every rank naming each key that differs: a rank
    with other settings would wait forever in a collective the others never make."""
    if not dist.enabled:
        return
    everyone: list = [None] * dist.world_size
    torch_dist.all_gather_object(everyone, settings)
    differ = {k: sorted({repr(s.get(k)) for s in everyone}) for k in settings
              if any(s.get(k) != settings[k] for s in everyone)}
    if differ:
        keys = "; ".join(f"{k}: {' vs '.join(values)}" for k, values in differ.items())
        raise UserError(f"the ranks' settings differ ({keys}): give every rank the same config files and --key=value "
                        f"overrides")


def check_shared_out_dir(out_dir: str, dist: Dist) -> None:
    """Every rank sees rank 0's out_dir (it alone writes checkpoints, every rank reads them to resume), else a
    UserError at the start naming the nodes that do not: rank 0 writes a marker file, every rank looks for it."""
    if not dist.enabled:
        return
    token = [os.urandom(8).hex() if dist.master else None]
    torch_dist.broadcast_object_list(token, src=0)
    marker = os.path.join(out_dir, f".shared_check.{token[0]}")
    try:
        if dist.master:
            files.write_text(marker, token[0], "the shared-folder check's marker")
        torch_dist.barrier()
        seen = os.path.exists(marker)
        node = f"{socket.gethostname()} (node rank {os.environ.get('GROUP_RANK', '?')})"
        views: list = [None] * dist.world_size
        torch_dist.all_gather_object(views, (node, dist.rank, seen))
    finally:  # however the check ends (a signal during the start too), the marker goes
        if dist.master:
            with contextlib.suppress(OSError):
                os.remove(marker)
    blind = {}
    for node_name, rank, ok in views:
        if not ok:
            blind.setdefault(node_name, []).append(rank)
    if blind:
        where = "; ".join(f"{n}: ranks {', '.join(map(str, r))}" for n, r in blind.items())
        raise UserError(f"out_dir={out_dir!r} is not shared: {where} cannot see the files rank 0 writes there (only "
                        f"rank 0 writes checkpoints, every rank reads them to resume): put out_dir on a file system "
                        f"that every node mounts")
