"""
Turning the next token's logits into a token: temperature, the top-k and top-p (nucleus) filters, then a draw
(or the most likely token at temperature 0). GPT.generate (model.py) calls sample_next_token once per new token.

It must not import model.py (model.py imports it) nor any script.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from errors import GPTError


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (ties at the k-th value are kept), set the rest to -inf."""
    k = min(k, logits.size(-1))
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least p (always at least one)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = F.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    remove_sorted = mass_before >= p  # the first token has mass_before == 0 and always stays
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1)."""
    if temperature < 0:
        raise GPTError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise GPTError(f"top_p={top_p} must be in (0, 1]")
    if top_k is not None and top_k < 1:
        raise GPTError(f"top_k={top_k} must be at least 1")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)
