"""What the model's tests share: a tiny GPT config and model, and the tolerances of their comparisons."""
from __future__ import annotations

import dataclasses

import torch

from model import GPT, GPTConfig

VOCAB = 101  # not a multiple of 64: padding adds 27 rows
SDPA_BACKENDS_ON_CPU = ("auto", "math", "flash")

# float32 tolerances (absolute), against each other or against a float64 reference of the same weights
LOGITS_ATOL = 1e-5
LOSS_ATOL = 1e-6
GRAD_ATOL = 1e-6
# SDPA may be less exact than the explicit math path, but not by more than this: err_sdpa <= 2 * err_math + slack.
# The measured errors are ~1e-7 (a float32 ulp near 1 is 1.2e-7), so the slack is two ulps, not 1e-6, which
# would let SDPA be ten times worse.
ERR_RATIO, ERR_SLACK = 2.0, 2.5e-7


def tiny_config(**changes) -> GPTConfig:
    # the plain loss path, which returns the logits these tests compare (tests/test_fused_loss.py: the fused one)
    base = dict(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, dropout=0.0, fused_loss=False)
    base.update(changes)
    return GPTConfig(**base)


def make_model(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    return GPT(tiny_config(**changes)).eval()


def rebuild(model: GPT, **changes) -> GPT:
    """The same weights under another config (attention path, backend, dropout); same training mode."""
    other = GPT(dataclasses.replace(model.config, **changes))
    other.load_state_dict(model.state_dict())
    return other.train(model.training)


def padded_batch(seed: int = 1, T: int = 12, lengths: tuple[int, ...] = (12, 7)):
    """Random ids (B, T) with right padding: attention_mask 1 on the first `length` positions of each row,
    targets -1 on the padding."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (len(lengths), T), generator=g)
    targets = torch.randint(0, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    targets[mask == 0] = -1
    return idx, targets, mask


def run(model: GPT, idx, targets, mask=None):
    """logits, loss and {name: grad} of one forward and backward."""
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, targets, attention_mask=mask)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()
