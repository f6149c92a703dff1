"""
Decoding, in one place: the KV cache, the generation loop GPT.generate runs (the prompt in one forward pass, then
one cached position per token, and past block_size a sliding window recomputed whole), and the turning of the next
token's logits into a token (temperature, the top-k and top-p filters, a draw, or the most likely token at
temperature 0). sample.py and report.py decode through generate() here.

The model is an argument, never imported: its attention fills the KVCache it is given (GPT.forward's kv_cache), and
GPT.generate is the plain loop this engine is tested against.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogpt.errors import UserError


class KVCache:
    """
    Keys and values of the positions seen so far, for every layer of a model of `config` (its GPTConfig), so that
    generating one more token costs one position of compute instead of the whole context. Every buffer is allocated
    up front at (B, nh, size, hs) and written in place at the positions given as a tensor. size: the positions the
    caller will store, at most block_size (the default). generate() asks for what it needs, not the whole block:
    GPT-2 XL's 48 layers hold 2 x 48 x 1600 x 4 B = 600 KiB per position and sample, 2.9 GiB for 5 samples of
    block_size 1024 in float32. static=True (the compiled decoding step): attention reads the whole buffers, the
    slots not yet written masked out, so a step has the same shapes at every position and compiles once per size.
    static=False (eager): attention reads only the slots written so far (`length`), which is less memory to read per
    token early on. dtype: what the attention produces (bfloat16 under bf16 autocast or for a bf16 model).
    """

    def __init__(
        self, config, batch_size: int, dtype: torch.dtype = torch.float32, device="cpu", static=False,
        size: int | None = None,
    ):
        self.size = config.block_size if size is None else size
        if not 1 <= self.size <= config.block_size:
            raise UserError(f"a KV cache of {self.size} positions: it must hold 1 to block_size={config.block_size}")
        shape = (batch_size, config.n_head, self.size, config.n_embd // config.n_head)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)]
        self.static = static
        self.pos = 0  # number of positions stored (host-side bookkeeping; the compiled step never reads it)
        self.length = 0  # slots written once the running forward has stored its positions (eager reads these)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's k, v (B, nh, T, hs) at positions pos (T,); return its buffers (B, nh, S, hs): all
        `size` slots if static (the caller's mask keeps those written so far), else the first `length`."""
        ck, cv = self.k[layer], self.v[layer]
        ck.index_copy_(2, pos, k.to(ck.dtype))
        cv.index_copy_(2, pos, v.to(cv.dtype))
        if self.static:
            return ck, cv
        return ck[:, :, : self.length], cv[:, :, : self.length]

    def reset(self) -> None:
        self.pos = self.length = 0


# ----------------------------------------------------------------------------------------------- generation


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    use_cache: bool = True,
    vocab_size: int | None = None,
    compile: bool = False,
    window_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """
    Extend idx (B, T) by max_new_tokens tokens, sampled from softmax(logits / temperature) after the optional
    top-k and top-p (nucleus) filters; temperature=0 takes the most likely token (greedy). The B rows are
    generated together: each step reads the weights once for all of them. generator: one for every row, or a list
    of B, one per row (a row's draws then come from its own stream alone, whatever else is in the batch).
    vocab_size: sample only ids below it, for a tokenizer with fewer tokens than the model has rows (nanoGPT's
    GPT-2-sized runs have 50304 rows for GPT-2's 50257 tokens); None: the model's vocab_size.
    With the cache, the prompt is prefilled in one forward pass, then each new token costs one position.
    The cache holds the positions this call feeds the model, T + max_new_tokens - 1 (the last new token is
    returned, never fed), at most block_size.
    compile=True runs that one-token step through torch.compile: its shapes are the same at every position
    (static cache, positions as a tensor), so it compiles once per batch size, dtype and cache size, for any
    depth: a later call with another T + max_new_tokens (below block_size) compiles a variant of its own.
    The context is the last block_size tokens, exactly as without the cache: past block_size the window
    slides, so every new position changes every position embedding, and each step recomputes the whole window
    (no cache; the last block and the head at the last position only). That is matrix-matrix work, unlike the
    one-token steps: window_dtype (e.g. torch.bfloat16 on a CPU with bf16 matmuls) runs it under autocast to that
    dtype (float32: autocast off), else under the caller's autocast, if any; with compile=True it is compiled too
    (one shape: (B, block_size)).
    The model runs in eval mode (no dropout) during generation and returns to its previous mode after.
    """
    was_training = model.training
    model.eval()
    try:
        cache = None
        if use_cache and max_new_tokens > 0:
            device_type = idx.device.type
            autocast = torch.is_autocast_enabled(device_type)
            dtype = torch.get_autocast_dtype(device_type) if autocast else model.lm_head.weight.dtype
            # the prompt's positions and every new token's but the last: for GPT-2 XL, 5 samples of 10 + 100
            # tokens, 109 positions (319 MiB in float32) instead of block_size's 1024 (2.9 GiB)
            size = min(idx.size(1) + max_new_tokens - 1, model.config.block_size)
            cache = KVCache(model.config, idx.size(0), dtype, idx.device, static=compile, size=size)
        step = _compiled("step", idx.device.type) if compile and use_cache else decode_step
        window = _compiled("window", idx.device.type) if compile else window_logits

        def append_next(idx: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            logits = logits[:, :vocab_size]  # (B, vocab_size)
            return torch.cat((idx, sample_next_token(logits, temperature, top_k, top_p, generator)), dim=1)

        new = 0
        while new < max_new_tokens and idx.size(1) <= model.config.block_size:  # within the block: the cache
            idx, new = append_next(idx, _next_token_logits(model, idx, cache, step)), new + 1
        # past block_size the window slides: each step recomputes it whole, in window_dtype if given
        with window_precision(idx.device.type, window_dtype):
            while new < max_new_tokens:
                # a copy, so that the strides are the same at every step and the compiled window compiles once
                # (.contiguous() would keep a single row's slice as it is: its stride, the whole length, grows)
                last_block = idx[:, -model.config.block_size:].clone(memory_format=torch.contiguous_format)
                idx, new = append_next(idx, window(model, last_block)), new + 1
    finally:
        model.train(was_training)
    return idx


def _next_token_logits(model, idx: torch.Tensor, cache: KVCache | None, step) -> torch.Tensor:
    block_size = model.config.block_size
    if cache is None:
        x = model._hidden(idx[:, -block_size:])
    elif cache.pos == idx.size(1) - 1 and cache.pos < cache.size:  # one new position
        pos = torch.full((1,), cache.pos, dtype=torch.long, device=idx.device)  # (1,)
        cache.pos += 1
        cache.length = cache.pos
        last = idx[:, -1:].clone(memory_format=torch.contiguous_format)  # (B, 1): the same strides every step
        return step(model, last, pos, cache)
    else:  # the prompt (prefill): in one forward pass
        cache.reset()
        x = model._hidden(idx[:, -block_size:], kv_cache=cache)
    return last_logits(model, x)


def window_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """Logits (B, vocab_size) of the next token after the window idx (B, block_size), no cache: the last block
    for the last position only (every position's keys and values, one query, one MLP row)."""
    pos = torch.arange(idx.size(1), device=idx.device)  # (T,)
    return last_logits(model, model._blocks(idx, pos, last_only=True))


def decode_step(model, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, vocab_size) of the next token after ids idx (B, 1) at position pos (1,), stored in cache."""
    return last_logits(model, model._blocks(idx, pos, kv_cache=cache))


def last_logits(model, x: torch.Tensor) -> torch.Tensor:
    """float32 logits (B, vocab_size) over the real vocabulary at the last position of x (B, T, C)."""
    return model.lm_head(x[:, -1, :])[:, : model.config.vocab_size].float()


def window_precision(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The window phase's precision: None, the caller's autocast, if any; float32, autocast off; a lower dtype
    (bf16), autocast to it. One context for the whole phase: autocast casts each weight once in it (it keeps the
    casts of the leaf tensors that require grad until it exits), not once a step."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)


_COMPILED: dict = {}


def _compiled(name: str, device_type: str):
    """decode_step ("step") or window_logits ("window") through torch.compile, made once per process and device
    type: fullgraph (one graph for every layer, no per-layer variants) and static shapes (a new batch size or dtype
    compiles a new variant, not a dynamic one). On a CPU the one-token step is called from C++ (inductor's
    cpp_wrapper): at batch 1 its Python wrapper would be a large share of a step whose matmuls take microseconds."""
    if (name, device_type) not in _COMPILED:
        function = {"step": decode_step, "window": window_logits}[name]
        options = {"cpp_wrapper": True} if name == "step" and device_type == "cpu" else None
        _COMPILED[name, device_type] = torch.compile(function, fullgraph=True, dynamic=False, options=options)
    return _COMPILED[name, device_type]


# ----------------------------------------------------------------------------------------------- sampling


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
    remove_sorted = mass_before >= p  # compared in the logits' dtype: a p below float32's range is 0 there
    remove_sorted[..., 0] = False  # so the most likely token is kept explicitly, whatever p
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def cooled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature; in a row where that is not finite (a temperature so small that the quotient
    overflows, or rounds to 0 in float32), its limit as the temperature goes to 0: 0 at the row's largest logits,
    -inf elsewhere (an even draw among the tied maxima; greedy where there is one). Other rows: the plain quotient,
    bit for bit. No host sync: a where, not a branch."""
    scaled = logits / temperature
    overflowed = (torch.isfinite(logits) & ~torch.isfinite(scaled)).any(dim=-1, keepdim=True)  # (B, 1)
    limit = torch.zeros_like(logits).masked_fill(logits < logits.amax(dim=-1, keepdim=True), float("-inf"))
    return torch.where(overflowed, limit, scaled)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next token ids (B, 1). generator: one for the batch, or a list with one per row."""
    if temperature < 0:
        raise UserError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p={top_p} must be in (0, 1]")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k={top_k} must be at least 1")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = cooled(logits, temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = F.softmax(logits, dim=-1)
    if isinstance(generator, list):  # each row draws from its own stream
        return torch.stack([torch.multinomial(row, num_samples=1, generator=g) for row, g in zip(probs, generator)])
    return torch.multinomial(probs, num_samples=1, generator=generator)
