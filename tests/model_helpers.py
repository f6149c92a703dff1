"""What the model's tests share: a tiny GPT config and model, the tolerances of their comparisons, and the check of
greedy tokens against a float64 forward pass (first_divergence)."""
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
    base = dict(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
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


# A greedy token's float64 logit may be this far below the best one: float32 steps differ from float64 by ~1e-5
# here, bf16 weights (8 mantissa bits) by ~1e-2 on logits of size ~0.4.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}


@torch.no_grad()
def first_divergence(reference: GPT, out: torch.Tensor, prompt_len: int, tol: float) -> str | None:
    """Where a chosen token's float64 logit falls more than tol below the best one, as text; None if nowhere (a
    closer call is a near-tie that rounding may flip, not an error). reference: the float64 model."""
    bs = reference.config.block_size
    L = out.size(1)
    # logits predicting token t come from the window of the block_size tokens before it
    head, _ = reference(out[:, : min(bs, L - 1)])  # (B, min(bs, L-1), V): predictions for tokens 1 .. bs
    for t in range(prompt_len, L):
        logits = head[:, t - 1] if t <= bs else reference(out[:, t - bs : t])[0][:, -1]  # (B, V)
        chosen = logits.gather(1, out[:, t : t + 1]).squeeze(1)  # (B,)
        gap = logits.max(dim=1).values - chosen  # (B,)
        if (gap > tol).any():
            row = int((gap > tol).nonzero()[0])
            return f"new token {t - prompt_len} of sample {row}: its logit is {gap[row]:.3g} below the best (> {tol})"
    return None
