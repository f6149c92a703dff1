"""
Decoding, in one place: the KV cache, the generation loop GPT.generate runs (the prompt in one forward pass, then
one cached position per token, and past block_size a sliding window recomputed whole), and the turning of the next
token's logits into a token (temperature, the top-k and top-p filters, a draw, or the most likely token at
temperature 0). sample.py and report.py decode through generate() here.

The model is an argument, never imported: its attention fills the KVCache it is given (GPT.forward's kv_cache), and
GPT.generate is the plain loop this engine is tested against.
"""
from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanogpt.errors import UserError


class KVCache:
    """
    Keys and values of the positions seen so far, for every layer of a model of `config` (its GPTConfig), so that generating one more token costs one
    position of compute instead of the whole context. Every buffer is allocated up front at (B, nh, size, hs) and
    written in place at the positions given as a tensor. size: the positions the caller will store, at most
    block_size (the default). generate() asks for what it needs, not the whole block: GPT-2 XL's 48 layers hold
    2 x 48 x 1600 x 4 B = 600 KiB per position and sample, 2.9 GiB for 5 samples of block_size 1024 in float32.
    static=True (the compiled decoding step): attention reads the whole buffers, the slots not yet written masked
    out, so a step has the same shapes at every position and compiles once per size. static=False (eager):
    attention reads only the slots written so far (`length`), which is less memory to read per token early on.
    dtype: what the attention produces (bfloat16 under bf16 autocast or for a bf16 model).
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
    depth: a later call with another T + max_new_tokens (below block_size) compiles a variant of its own. Each
    loop's calls after its first skip dynamo's guard checks, process-wide (_unchecked_guards): not for a program
    whose other threads run compiled code meanwhile.
    The context is the last block_size tokens, exactly as without the cache: past block_size the window
    slides, so every new position changes every position embedding, and each step recomputes the whole window
    (no cache; the last block and the head at the last position only). That is matrix-matrix work, unlike the
    one-token steps: window_dtype (e.g. torch.bfloat16 on a CPU with bf16 matmuls) runs it with the weights in that
    dtype for the phase (restored after) and, uncompiled, packed once for oneDNN's bf16 matmuls where those run it;
    with compile=True it is compiled instead (one shape: (B, block_size)).
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

        def cached_steps(idx: torch.Tensor, new: int, limit: int) -> tuple[torch.Tensor, int]:
            while new < limit and idx.size(1) <= model.config.block_size:  # within the block: the cache
                idx, new = append_next(idx, _next_token_logits(model, idx, cache, step)), new + 1
            return idx, new

        def window_steps(idx: torch.Tensor, new: int, limit: int) -> tuple[torch.Tensor, int]:
            while new < limit:
                # a copy, so that the strides are the same at every step and the compiled window compiles once
                # (.contiguous() would keep a single row's slice as it is: its stride, the whole length, grows)
                last_block = idx[:, -model.config.block_size:].clone(memory_format=torch.contiguous_format)
                idx, new = append_next(idx, window(model, last_block)), new + 1
            return idx, new

        # each loop's first compiled call checks dynamo's guards (picks its variant, or compiles one); the later
        # calls have its shapes, dtypes and model, so they skip the check (_unchecked_guards). Without the cache the
        # steps run eagerly, on a context one longer each time: a caller's own compiled modules must check theirs
        idx, new = cached_steps(idx, 0, min(max_new_tokens, 2))  # the prompt, then the first one-token step
        with _unchecked_guards(compile and use_cache):
            idx, new = cached_steps(idx, new, max_new_tokens)
        # past block_size the window slides: each step recomputes it whole, in window_dtype if given (weights of a
        # higher precision converted once for the whole phase), else under the caller's autocast, if any
        sliding = new < max_new_tokens
        with window_phase(model, idx, window_dtype if sliding else None, pack=sliding and not compile), \
                _tensor_guards_kept(compile):
            idx, new = window_steps(idx, new, min(max_new_tokens, new + 1))
            with _unchecked_guards(compile):
                idx, new = window_steps(idx, new, max_new_tokens)
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


@contextlib.contextmanager
def window_phase(model: nn.Module, idx: torch.Tensor, dtype: torch.dtype | None, pack: bool = True) -> Iterator[None]:
    """The weights as the window steps past block_size run them, for windows of idx's batch: in `dtype`
    (_window_precision) and, if pack, packed for oneDNN where it runs them (_prepacked_linears)."""
    rows = idx.size(0) * model.config.block_size  # of a window step's matmuls
    with _window_precision(model, idx.device.type, dtype), _prepacked_linears(model, rows, enabled=pack):
        yield


@contextlib.contextmanager
def _window_precision(model: nn.Module, device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """
    The window phase's precision. None: the caller's autocast, if any. The weights' own dtype: autocast off (so a
    caller's bf16 autocast does not apply). A lower one (bf16 for float32 weights): the weights themselves in that
    dtype for the phase, converted once and restored after, with autocast off, so that no step casts a weight or an
    activation and the elementwise work (softmax, GELU, norms, residuals) reads half the bytes; the float32
    originals are kept, not rounded: the cached steps before and every later call see them unchanged.
    """
    if dtype is None:
        yield
        return
    params = [p for p in model.parameters() if p.dtype.is_floating_point and p.dtype != dtype]
    originals = [p.data for p in params]
    try:
        for p in params:
            p.data = p.data.to(dtype)
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        for p, original in zip(params, originals):
            p.data = original


@contextlib.contextmanager
def _prepacked_linears(model: nn.Module, rows: int, enabled: bool = True) -> Iterator[None]:
    """
    The window phase's Linears run from weights packed once for the phase, where that is oneDNN's bf16 matmul on a
    CPU (bf16 weights, autocast off: the window in bf16 as _window_precision sets it): each weight laid out in
    oneDNN's blocked format for matmuls of `rows` rows (torch.ops.mkldnn._reorder_linear_weight) and each Linear run
    from it (mkldnn._linear_pointwise, the kernel inductor's weight freezing uses), which reads it faster than
    F.linear's matmul reads the plain (out, in) weight; the same products, the same logits. A weight no other
    module reads (all but the head, tied to the token embedding) gives its dense copy up for the phase and gets it
    back, bit for bit, from the packed one after: the phase holds one bf16 copy of each weight but the head's.
    Elsewhere (another device or dtype, autocast, compiled): nothing.
    """
    # plain Linears only: a subclass (torchao's Float8Linear) computes its own way
    linears = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in vars(m)]
    if not (enabled and linears and torch.backends.mkldnn.is_available()
            and all(m.weight.device.type == "cpu" and m.weight.dtype == torch.bfloat16 for m in linears)
            and not torch.is_autocast_enabled("cpu") and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        yield
        return
    holders = collections.Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    freed = {}  # id(Linear) -> its packed weight, for the Linears whose dense copy was given up
    try:
        for m in linears:
            packed = torch.ops.mkldnn._reorder_linear_weight(m.weight, rows)
            m.forward = functools.partial(_packed_linear, packed, m.bias)
            if holders[id(m.weight)] == 1:  # no other module reads it
                freed[id(m)] = packed
                m.weight.data = m.weight.data.new_empty(0)
        del packed
        yield
    finally:
        for m in linears:  # one at a time: each packed copy goes as its dense one comes back
            vars(m).pop("forward", None)
            packed = freed.pop(id(m), None)
            if packed is not None:
                m.weight.data = packed.to_dense()
            del packed


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ weight.T + bias, the weight packed by _prepacked_linears: (..., out)."""
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.size(-1)), weight, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.size(-1))


def _unchecked_guards(enabled: bool):
    """
    Calls of compiled functions that skip dynamo's guard checks (torch.compiler.set_stance's
    skip_guard_eval_unsafe: only the guards that tell the compiled variants apart run), for a loop whose every call
    has the shapes, dtypes, model and settings of one already made with its guards checked. At batch 1 the check is
    ~10% of a small model's compiled step (20 of ~220 us for 4 x 128). Entering it costs ~50 us: once per loop, not
    per step. Nothing where compile is off, or where the caller set a stance of its own. The setting is PyTorch's,
    for the whole process: another thread's compiled calls made meanwhile skip their checks too (generate with
    compile=True is not for threads that run compiled code beside it).
    """
    if not enabled:
        return contextlib.nullcontext()
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)  # the current stance (PyTorch has no getter)
    if stance is None or stance.stance != "default" or stance.skip_guard_eval_unsafe:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True, force_backend=stance.backend)


def _tensor_guards_kept(enabled: bool):
    """The compiled window's guards check every weight: the window phase changes the weights' dtype in place (each
    parameter's data), and dynamo's shortcut that skips a module's tensor guards while its attributes are the same
    objects would run another dtype's compiled window on them (PyTorch 2.11 on CUDA did: float32 activations against
    bf16 weights). A compiled window's guards are built at its first call, under this setting."""
    if not enabled:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(skip_tensor_guards_with_matching_dict_tags=False)


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
