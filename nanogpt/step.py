"""
One training step and what it needs, for train.py's loop and bench.py's timing alike: the model a step's settings
(config.StepConfig) make, the process's setup, the micro-batches of a step, train_step itself (queued without waiting
for the device), the guard that skips a non-finite step on the device, and the figures read one step late.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as torch_dist

from model import GPT, GPTConfig
from nanogpt import dataio, parallel
from nanogpt.config import Machine, StepConfig
from nanogpt.device import DeviceClock, keep_freed_memory, set_deterministic
from nanogpt.distributed import Dist
from nanogpt.errors import RunError
from nanogpt.fused_loss import fused_linear_cross_entropy
from nanogpt.optim import step_unless


# From scratch nothing needs GPT-2's tanh approximation: train with nanoGPT's exact GELU, whose CPU kernel is faster.
SCRATCH_GELU = "erf"
# The config keys that shape the weights (with the dataset's vocab_size): model_config assembles them with
# model_settings', the one place a config becomes a GPTConfig.
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "vocab_padding_multiple")


def model_settings(cfg: StepConfig, machine: Machine) -> dict:
    """The settings that do not touch the weights, "auto" as `machine` decided it: they apply to a checkpoint's or
    GPT-2's model too."""
    return dict(dropout=cfg.dropout, attention=machine.attention, sdpa_backend=cfg.sdpa_backend)


def set_head_loss(model: GPT, machine: Machine) -> GPT:
    """`model`, whose loss-only forwards (the step, evaluation) use the loss machine.fused_loss chose: the head and
    cross-entropy chunk by chunk (fused_loss.py: no (tokens x vocab) logits), or the plain loss of the logits."""
    model.head_loss = fused_linear_cross_entropy if machine.fused_loss else None
    return model


def model_config(cfg: StepConfig, vocab_size: int, machine: Machine) -> GPTConfig:
    """The GPTConfig of a new model: the config's model keys, the dataset's vocabulary, and SCRATCH_GELU unless a
    GELU is set."""
    args = {k: getattr(cfg, k) for k in MODEL_KEYS if k != "vocab_size"}
    return GPTConfig(**args, **model_settings(cfg, machine), vocab_size=vocab_size, gelu=cfg.gelu or SCRATCH_GELU)


def setup_process(cfg: StepConfig, device: str, rank: int = 0) -> bool:
    """What a process of training steps sets once, for train.py and bench.py alike: torch's seed (seed + rank:
    dropout differs between DDP ranks; the batches have their own generators), deterministic algorithms, and on the
    CPU glibc's malloc keeping freed memory. Returns whether malloc now keeps it."""
    torch.manual_seed(cfg.seed + rank)
    set_deterministic(cfg.deterministic)
    return keep_freed_memory(cfg.keep_freed_memory, device)


# ----------------------------------------------------------------------------------------------- data


STREAMS = {"train": 0, "eval_train": 1, "eval_val": 2}  # training batches, and the fixed batches of each eval


def batch_generator(seed: int, stream: str, step: int, index: int) -> torch.Generator:
    """
    The generator for one micro-batch, derived from (seed, stream, step, micro-batch index over all ranks).
    So the data stream is a function of the step alone: a resumed run continues it instead of replaying it,
    each rank reads different windows, and 2 ranks x 1 micro-step read exactly what 1 rank x 2 micro-steps reads.
    """
    state = np.random.SeedSequence([seed, STREAMS[stream], step, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def get_batch(
    source: str | dataio.TokenSplit, batch_size: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of block_size tokens from a token file or a dataset split (dataio.open_split, sharded or
    not): x (B, T) and the next tokens y (B, T), int64 on the CPU."""
    split = source if isinstance(source, dataio.TokenSplit) else dataio.TokenSplit([source], str(source))
    return split.get_batch(batch_size, block_size, generator)


def train_batches(
    split: dataio.TokenSplit, cfg: StepConfig, iter_num: int, rank: int, accum_steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of step iter_num: its micro-step i is micro-step rank * accum_steps + i of the step
    over all ranks, so 2 ranks x 1 micro-step read exactly what 1 rank x 2 micro-steps read."""
    return [
        get_batch(split, cfg.batch_size, cfg.block_size, batch_generator(cfg.seed, "train", iter_num, index))
        for index in range(rank * accum_steps, (rank + 1) * accum_steps)
    ]


def to_device(t: torch.Tensor, device: str) -> torch.Tensor:
    if device.startswith("cuda"):  # pinned memory lets the copy run asynchronously with compute
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ----------------------------------------------------------------------------------------------- the step


class StepInterrupted(Exception):
    """A stop was requested between two micro-steps: the step was abandoned (its gradients dropped), not applied."""


@dataclass(frozen=True)
class StepFigures:
    """One step's figures on the host: the mean loss over all micro-batches and ranks, the gradient norm, whether the
    step was applied, and the non-finite steps counted so far (NonFiniteGuard)."""
    loss: float
    grad_norm: float
    applied: bool
    nonfinite_skips: int


class StepResult:
    """What train_step returns: its figures still on the device, so that returning waits for nothing. read() copies
    them to the host, which waits for the step to finish; OneStepLate reads them without holding the device back."""

    def __init__(self, stats: torch.Tensor):
        self.stats = stats  # (4,) float32 on the device: loss, grad norm, applied (1 or 0), non-finite skips so far

    def read(self) -> StepFigures:
        return figures(self.stats.tolist())


def figures(stats: list[float]) -> StepFigures:
    loss, norm, applied, skips = stats
    return StepFigures(loss, norm, applied > 0, int(skips))


class NonFiniteError(RunError):
    """More steps had a non-finite loss or gradient norm than max_nonfinite_skips allows: the run stops, the last
    one not applied (exit status 1, a failure of the run)."""


class NonFiniteGuard:
    """
    Decides on the device whether a step is applied, so the host never waits to decide: a non-finite loss or gradient
    norm skips the step (the optimizer reads the flag: optim.step_unless) and is counted, except a finite loss whose
    float16 gradients overflowed, which is the grad scaler's to skip (it lowers its scale) and is not counted. Once
    more than `limit` steps are counted, every later step is skipped too: the steps the host queued before it read
    the count then change nothing, and the run stops with the state the last good step left.
    """

    def __init__(self, device: str, limit: float = math.inf):
        self.skips = torch.zeros((), device=device)  # counted so far, float32 (it travels with the step's figures)
        self.limit = limit

    def skip(self, loss: torch.Tensor, grad_norm: torch.Tensor, scaler_enabled: bool) -> torch.Tensor:
        """1.0 where the step must be skipped, else 0.0: a float32 scalar on the device."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        counted = ~torch.isfinite(loss) if scaler_enabled else ~finite
        self.skips += counted
        return (~finite | (self.skips > self.limit)).float()


def train_step(
    model, optimizer, scaler, batches, ctx, cfg: StepConfig, dist: Dist, stop: Callable[[], bool] | None = None,
    guard: NonFiniteGuard | None = None,
) -> StepResult:
    """
    One optimizer step over the micro-batches of this rank, queued without waiting for the device: nothing in it
    reads a value back, so on a GPU the host runs ahead and queues the next step while this one computes. Returns
    the step's figures on the device (StepResult: the mean loss over all micro-batches and ranks, the gradient norm,
    whether the step was applied). `guard` decides on the device whether the step applies (NonFiniteGuard; by
    default one of its own, without a limit). `stop` is asked between micro-steps (the ranks agree on its answer):
    True drops the gradients so far and raises StepInterrupted, so a stop waits for one micro-step, not a whole step
    of gradient accumulation.

    The gradient equals that of one big batch of the same tokens: each micro-batch's mean loss is weighted by
    its share of all target tokens (those not -1) over every micro-step and rank, so the weighting stays right
    when some targets are ignored. DDP averages gradients over ranks, hence the factor world_size.
    """
    guard = guard if guard is not None else NonFiniteGuard(dist.device)
    # The step's host-to-device copies are queued up front (pinned, non-blocking): they overlap the first
    # micro-steps' compute instead of each waiting for the one before it. A no-op on the CPU.
    batches = [(to_device(x, dist.device), to_device(y, dist.device)) for x, y in batches]
    counts = [(y != -1).sum() for _, y in batches]  # target tokens per micro-batch, counted on the device
    n_tokens = torch.stack(counts).sum().float()
    if dist.enabled:
        torch_dist.all_reduce(n_tokens)
    loss_sum = torch.zeros((), device=dist.device)
    for i, ((x, y), n) in enumerate(zip(batches, counts)):
        last = i == len(batches) - 1
        if i > 0 and stop is not None and stop():
            optimizer.zero_grad(set_to_none=True)
            raise StepInterrupted
        # DDP all-reduces (FSDP reduce-scatters) gradients in backward; only the last micro-step needs it.
        with parallel.gradient_sync(model, dist, sync=last):
            with ctx:  # the loss only: with fused_loss the (tokens x vocab) logits are never formed
                _, loss = model(x, y, return_logits=False)
            weight = n * dist.world_size / n_tokens
            scaler.scale(loss * weight).backward()
        loss_sum += loss.detach().float() * n
    if dist.enabled:
        torch_dist.all_reduce(loss_sum)
    scaler.unscale_(optimizer)
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = parallel.clip_grad_norm_(model.parameters(), max_norm).float()  # the total norm over all ranks' shards
    mean_loss = loss_sum / n_tokens
    skip = guard.skip(mean_loss, grad_norm, scaler.is_enabled())
    step_unless(optimizer, skip)
    # Also after a skipped step: update() is what clears unscale_'s record for this optimizer (without it the next
    # step's unscale_ raises "already been called"); it lowers the scale when the gradients were not finite.
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(torch.stack([mean_loss, grad_norm, 1 - skip, guard.skips]))


class OneStepLate:
    """
    The figures of each step, read one step late: push(step) starts copying the step's figures to the host without
    waiting and returns those of the step pushed before, which by then has finished or is about to (while the step
    just pushed keeps the device busy). So reading every step's figures never leaves a GPU idle, and the loop
    waits for the device only where it must (flush: before an eval, a save, a stop, the end). Each figure comes back
    with the tag it was pushed with (the iteration, its learning rate) and the step's time in ms on the device's
    timeline (device.DeviceClock: from the end of the step before, or of what restart() marked, to its own end).
    """

    def __init__(self, device: str):
        self.clock = DeviceClock(device)
        self.pending: tuple | None = None  # (tag, host copy, the step's end mark, the mark its time counts from)
        self.restart()

    def restart(self) -> None:
        """The next step's time counts from here (after an eval or a save, which are not part of it)."""
        self.last_mark = self.clock.mark()

    def push(self, tag, result: StepResult) -> tuple | None:
        """Start reading `result`; return (tag, StepFigures, ms) of the step pushed before, or None."""
        host = torch.empty(result.stats.shape, dtype=result.stats.dtype, pin_memory=self.clock.cuda)
        host.copy_(result.stats, non_blocking=self.clock.cuda)  # waited for by the event; other devices: now
        mark = self.clock.mark()  # on a GPU an event after the step's work: waiting on it waits for this step only
        previous, self.pending = self.pending, (tag, host, mark, self.last_mark)
        self.last_mark = mark
        return self._read(previous)

    def flush(self) -> tuple | None:
        """The last pushed step's (tag, StepFigures, ms), waiting for it; None if there is none."""
        previous, self.pending = self.pending, None
        return self._read(previous)

    def _read(self, pending: tuple | None) -> tuple | None:
        if pending is None:
            return None
        tag, host, mark, since = pending
        if self.clock.cuda:
            mark.synchronize()  # that step only: the steps queued after it keep running
        return tag, figures(host.tolist()), self.clock.ms(since, mark)
