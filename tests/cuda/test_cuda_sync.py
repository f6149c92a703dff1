"""
The training step never waits for the host: train_step, its non-finite guard and the figures read one step late
(step.OneStepLate) run under torch.cuda.set_sync_debug_mode("error"), which raises at any call that would make the
host wait for the GPU's queue (.item(), .tolist(), a blocking copy, a synchronize). OneStepLate waits on the event of
the step before the one just queued, which the mode allows: the GPU has the new step to run meanwhile. Plain, float16 with the grad scaler, Muon,
and DDP over NCCL in a world of one; a NaN step among them is skipped on the device and leaves the weights alone.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nanogpt.device import autocast_context
from cuda_helpers import requires_cuda
from nanogpt.distributed import DDP_SETTINGS, cleanup_distributed, setup_distributed
from model import GPT, GPTConfig
from nanogpt.optim import build_optimizer
from nanogpt.config import StepConfig
from nanogpt.step import NonFiniteGuard, OneStepLate, train_step

pytestmark = requires_cuda


class ScaledLoss(torch.nn.Module):
    """The model with its loss multiplied by a device scalar the test sets (NaN makes a non-finite step)."""

    def __init__(self, model: torch.nn.Module, scale: torch.Tensor):
        super().__init__()
        self.model, self.scale = model, scale

    def forward(self, idx, targets, **kw):
        logits, loss = self.model(idx, targets, **kw)
        return logits, loss * self.scale


@pytest.mark.parametrize("case", ["bfloat16", "float16", "muon", "ddp"])
def test_training_steps_never_wait_for_the_host(case):
    dist = setup_distributed("cuda", group_of_one=True) if case == "ddp" else None
    try:
        _steps_under_sync_errors(case, dist)
    finally:
        if dist is not None:
            cleanup_distributed(dist)


def _steps_under_sync_errors(case: str, dist) -> None:
    from nanogpt.distributed import Dist

    dist = dist or Dist(device="cuda")
    dtype = "float16" if case == "float16" else "bfloat16"
    cfg = StepConfig(optimizer="muon" if case == "muon" else "adamw", learning_rate=1e-3, grad_clip=1.0)
    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=2, n_head=2, n_embd=64, attention="sdpa")).cuda()
    optimizer = build_optimizer(raw, cfg, "cuda", verbose=False)
    # float16: a scale whose gradients do not overflow (2^16 overflows this model's in its first steps)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, enabled=dtype == "float16")
    scale = torch.ones((), device="cuda")
    model = torch.compile(ScaledLoss(raw, scale))
    if case == "ddp":
        model = DDP(model, device_ids=[dist.local_rank], **DDP_SETTINGS)
    ctx = autocast_context("cuda", dtype)
    guard, late = NonFiniteGuard("cuda"), OneStepLate("cuda")
    batches = [(torch.randint(0, 96, (4, 32)), torch.randint(0, 96, (4, 32))) for _ in range(2)]  # 2 micro-steps

    def step() -> None:
        late.push(None, train_step(model, optimizer, scaler, batches, ctx, cfg, dist, guard=guard))

    for _ in range(3):  # compile, the optimizer's state, the scaler's scale, DDP's buckets: made once, before
        step()
    late.flush()
    nan = torch.tensor(float("nan"), device="cuda")
    one = torch.ones((), device="cuda")
    figures, weights = [], []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in (one, nan, one):
            scale.copy_(s)  # device to device: no wait
            weights.append([p.detach().clone() for p in raw.parameters()])
            late.push(None, train_step(model, optimizer, scaler, batches, ctx, cfg, dist, guard=guard))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    weights.append([p.detach().clone() for p in raw.parameters()])
    _, last, ms = late.flush()
    assert last.applied and last.nonfinite_skips == 1 and ms > 0  # the last step's figures, read after the loop
    # the NaN step (the second) was skipped on the device: the weights before and after it are equal
    unchanged = [all(torch.equal(a, b) for a, b in zip(w0, w1)) for w0, w1 in zip(weights, weights[1:])]
    assert unchanged == [False, True, False]
    assert guard.skips.item() == 1


def test_a_blocking_read_in_the_step_is_caught():
    """The check above catches what it claims to: a .item() while the mode is on raises."""
    x = torch.ones((), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
            x.item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
