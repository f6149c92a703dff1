"""Tests for engine.py: the KV cache (cached = uncached = window recompute), generate's phases, compiled decoding,
and sampling's filters. Tiny configs on the CPU, fixed seeds."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from nanogpt import engine
from nanogpt.engine import KVCache, sample_next_token, top_k_filter, top_p_filter
from nanogpt.errors import UserError
from model import GPT, GPTConfig
from model_helpers import VOCAB, first_divergence, make_model


def greedy_reference(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding the slow, obvious way: model.py's own generate, a full forward over the last block_size tokens
    each step (the model in eval mode: make_model's)."""
    assert not model.training
    return model.generate(idx, n, temperature=0.0)


def test_the_engine_draws_what_the_models_own_loop_draws_within_and_past_block_size() -> None:
    """engine.generate (cache, window past block_size) against model.generate, nanoGPT's plain loop: the same tokens,
    greedy and sampled from the same random stream, for a prompt that fills the block and slides past it."""
    model = make_model(seed=60)  # block_size 16
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(61))
    for temperature, top_k in ((0.0, None), (0.9, 20), (1.0, None)):
        ours = engine.generate(model, prompt, 30, temperature, top_k, generator=torch.Generator().manual_seed(62))
        reference = model.generate(prompt, 30, temperature, top_k, generator=torch.Generator().manual_seed(62))
        assert torch.equal(ours, reference), (temperature, top_k)


PATHS = [("math", "auto"), ("sdpa", "auto"), ("sdpa", "math"), ("sdpa", "flash")]


PATH_IDS = [f"{a}-{b}" if a == "sdpa" else a for a, b in PATHS]


@pytest.mark.parametrize("attention,backend", PATHS, ids=PATH_IDS)
def test_cached_greedy_generation_matches_uncached_past_block_size(attention: str, backend: str) -> None:
    model = make_model(seed=8, attention=attention, sdpa_backend=backend)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    expected = greedy_reference(model, prompt, 40)
    cached = engine.generate(model, prompt, 40, temperature=0.0, use_cache=True)
    uncached = engine.generate(model, prompt, 40, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 45)
    assert torch.equal(uncached, expected)
    assert torch.equal(cached, expected)
    assert torch.equal(cached[:, :5], prompt)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_seeded_sampling_is_identical_with_and_without_cache(attention: str) -> None:
    model = make_model(seed=10, attention=attention)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(11))

    def sample(seed: int, use_cache: bool) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return engine.generate(model, prompt, 30, temperature=0.9, top_k=40, top_p=0.95, generator=g, use_cache=use_cache)

    a, b = sample(123, True), sample(123, False)
    assert torch.equal(a, b)
    assert not torch.equal(sample(124, True), a), "a different seed should give different tokens"


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_kv_cache_forward_matches_full_forward(attention: str) -> None:
    model = make_model(seed=12, attention=attention)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(model.config, batch_size=2)
        # prefill 6, then a chunk of 3 (cached past, several queries), then one token at a time
        steps = [(0, 6), (6, 9)] + [(t, t + 1) for t in range(9, 16)]
        pieces = [model(idx[:, a:b], kv_cache=cache)[0] for a, b in steps]
    assert (cache.pos, cache.length) == (16, 16)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="longer than block_size=16"):
        model(idx[:, :1], kv_cache=cache)


def test_prompt_is_prefilled_in_one_pass_then_one_position_per_token() -> None:
    model = make_model(seed=30, block_size=32)
    widths = []
    model.transformer.h[0].register_forward_hook(lambda mod, args, out: widths.append(args[0].size(1)))
    prompt = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(31))
    engine.generate(model, prompt, 10, temperature=0.0)
    assert widths == [7] + [1] * 9  # the 10th token's logits come from the 9th step; nothing runs after it


def test_batch_rows_generate_as_they_would_alone() -> None:
    model = make_model(seed=32)
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(33))
    together = engine.generate(model, prompt, 25, temperature=0.0)  # past block_size 16 too
    for row in range(3):
        alone = greedy_reference(model, prompt[row : row + 1], 25)
        assert torch.equal(together[row : row + 1], alone), f"row {row}"


# (prompt 5, new tokens, cache positions) for block_size 16: the last new token is returned, never fed to the model
CACHE_SIZES = {"within": (6, 10), "reaching": (11, 15), "full": (12, 16), "past": (30, 16)}


@pytest.mark.parametrize("case", CACHE_SIZES)
def test_the_cache_holds_the_positions_generation_feeds_and_tokens_do_not_change(monkeypatch, case: str) -> None:
    """Within the block (10 of 16 positions), the output exactly reaching block_size (15), one more (every slot
    used, no slide), and past it (the window slides, the cache refilled): every layer's buffers have the
    positions written and no more (measured from the positions stored), and greedy and seeded tokens equal
    those of generation without the cache."""
    n, size = CACHE_SIZES[case]
    caches = []

    class Recorded(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.written = set()
            caches.append(self)

        def update(self, layer, k, v, pos):
            self.written.update(pos.tolist())
            return super().update(layer, k, v, pos)

    monkeypatch.setattr(engine, "KVCache", Recorded)
    model = make_model(seed=40)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(41))

    def sample(use_cache: bool) -> torch.Tensor:
        g = torch.Generator().manual_seed(42)
        return engine.generate(model, prompt, n, temperature=0.9, top_k=40, top_p=0.95, generator=g, use_cache=use_cache)

    greedy, sampled = engine.generate(model, prompt, n, temperature=0.0), sample(True)
    assert len(caches) == 2
    for cache in caches:
        assert {tuple(t.shape) for t in cache.k + cache.v} == {(2, 2, size, 16)}
        assert len(cache.k) == len(cache.v) == 2  # a buffer of each per layer
        assert cache.written == set(range(size))
    assert torch.equal(greedy, greedy_reference(model, prompt, n))
    assert torch.equal(sampled, sample(False))


def test_a_cache_smaller_than_the_block_refuses_positions_past_its_size() -> None:
    model = make_model(seed=43)
    idx = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(44))
    cache = KVCache(model.config, 1, size=5)
    with torch.no_grad():
        model(idx[:, :5], kv_cache=cache)
        with pytest.raises(ValueError, match="6 positions do not fit the KV cache, which holds 5"):
            model(idx[:, 5:], kv_cache=cache)
    with pytest.raises(UserError, match="must hold 1 to block_size=16"):
        KVCache(model.config, 1, size=17)


def test_bf16_model_cache_follows_the_weights_dtype_and_tracks_float32() -> None:
    model = make_model(seed=34)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(35))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    cache = KVCache(bf16.config, 2, torch.bfloat16)
    with torch.no_grad():
        pieces = [bf16(prompt[:, :3], kv_cache=cache)[0], bf16(prompt[:, 3:4], kv_cache=cache)[0],
                  bf16(prompt[:, 4:5], kv_cache=cache)[0]]
        reference, _ = model.double()(prompt)
    assert cache.k[0].dtype == torch.bfloat16
    # bf16 keeps 8 mantissa bits: logits of this size (|x| < 1) agree with float64 to a few 1e-3
    torch.testing.assert_close(torch.cat(pieces, 1).double(), reference, atol=2e-2, rtol=0)


@pytest.mark.slow
def test_compiled_decode_compiles_once_per_generation_for_a_deep_model_and_matches_eager() -> None:
    """10 layers (more than dynamo's recompile limit of 8, which per-layer compiles hit). The step's shapes are
    fixed by the cache's size, so a generation compiles at most once however many positions it steps through (and
    the window once however many steps slide it, at any batch size, 1 included); a
    later one with a cache of the same size compiles nothing, one with another size (within block_size) its own
    variant, once. Compiles are counted by dynamo's graph counter. Greedy tokens equal the uncached ones, and
    seeded sampling gives the same tokens as eager (the sampler runs eagerly on the same logits up to rounding,
    which no near-tie meets in this model)."""
    from torch._dynamo.utils import counters

    model = make_model(seed=36, n_layer=10, n_embd=16)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(37))

    def sample(compile: bool, p: torch.Tensor, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(38)
        return engine.generate(model, p, n, temperature=0.9, top_k=40, top_p=0.95, generator=g, compile=compile)

    compiles = []

    def counted(generate) -> torch.Tensor:
        before = counters["stats"]["unique_graphs"]
        out = generate()
        compiles.append(counters["stats"]["unique_graphs"] - before)
        return out

    torch.compiler.reset()
    # 16 positions, then 19 steps of the sliding window: the step and the window compile once each
    past = counted(lambda: engine.generate(model, prompt, 30, temperature=0.0, compile=True))
    reaching = counted(lambda: sample(True, prompt[:, :3], 14))  # 3 + 14 = block_size + 1: 16 positions, no slide
    within = counted(lambda: engine.generate(model, prompt, 6, temperature=0.0, compile=True))  # 10 positions
    within_sampled = counted(lambda: sample(True, prompt[:, :3], 8))  # another prompt length, 10 positions again
    longer = counted(lambda: engine.generate(model, prompt, 40, temperature=0.0, compile=True))  # more window steps: none
    # one sample: a batch of 1 compiles its own variants, once each, though a slice of one row is "contiguous"
    # with the stride of the whole sequence (which grows every step)
    single = counted(lambda: engine.generate(model, prompt[:1], 30, temperature=0.0, compile=True))
    assert compiles == [2, 0, 1, 0, 0, 2]
    assert torch.equal(single, past[:1])
    assert torch.equal(past, greedy_reference(model, prompt, 30))
    assert torch.equal(longer, greedy_reference(model, prompt, 40))
    assert torch.equal(within, greedy_reference(model, prompt, 6))
    assert torch.equal(reaching, sample(False, prompt[:, :3], 14))
    assert torch.equal(within_sampled, sample(False, prompt[:, :3], 8))


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_eager_cache_reads_only_the_slots_written_and_equals_the_static_one(attention: str) -> None:
    """Eager decoding attends over the positions stored so far; the static cache (the compiled step's) over all
    block_size slots, masked. Both give the full forward's logits; the eager one never reads past its length."""
    model = make_model(seed=36, attention=attention)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(37))
    with torch.no_grad():
        full, _ = model(idx)
        out, widths = {}, {}
        for static in (False, True):
            cache = KVCache(model.config, batch_size=2, static=static)
            widths[static] = []

            def update(*args, _update=cache.update, _widths=widths[static]):
                k, v = _update(*args)
                _widths.append(k.size(2))  # the slots this layer's attention reads
                return k, v

            cache.update = update
            pieces = [model(idx[:, :5], kv_cache=cache)[0]] + [model(idx[:, t : t + 1], kv_cache=cache)[0]
                                                              for t in range(5, 12)]
            out[static] = torch.cat(pieces, dim=1)
    for static in (False, True):
        torch.testing.assert_close(out[static], full, atol=1e-5, rtol=0)
    layers = model.config.n_layer
    assert widths[False] == [n for n in [5, *range(6, 13)] for _ in range(layers)]
    assert set(widths[True]) == {model.config.block_size}


def test_past_block_size_the_window_runs_in_the_window_dtype_and_the_steps_do_not() -> None:
    """sample.py's dtype=auto on a CPU with bf16 matmuls: the one-token steps stay float32 (matrix-vector work,
    where bf16 casts cost more than they save), the window recomputed past block_size runs in bf16 autocast
    (matrix work). The tokens stay those of the float64 model up to near-ties (greedy, a model with clear
    preferences: each chosen token is the float64 argmax or within bf16's rounding of it)."""
    model = make_model(seed=40)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(41))
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append((o.size(1), o.dtype)))
    out = engine.generate(model, prompt, 20, temperature=0.0, window_dtype=torch.bfloat16)
    steps = {dtype for length, dtype in seen if length < 16}  # prefill (5) and the one-token steps
    windows = [dtype for length, dtype in seen if length == 16]
    assert steps == {torch.float32} and len(windows) == 5 + 20 - 1 - 16 and set(windows) == {torch.bfloat16}
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        for t in range(5, out.size(1)):
            logits = reference(out[:, max(0, t - 16):t])[0][:, -1]  # (B, V)
            gap = logits.max(dim=1).values - logits.gather(1, out[:, t:t + 1]).squeeze(1)
            assert (gap < 0.1).all(), (t, gap)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_the_window_runs_its_last_block_for_the_last_position_alone_and_gives_the_forward_passs_logits(attention):
    """Past block_size each new token's logits come from the whole window; the last block needs every position's
    keys and values but only the last position's query, attention row and MLP row. The trimmed window gives the
    full forward pass's last logits (float64: to the last bits), and its last block's MLP sees one row."""
    model = make_model(seed=50, attention=attention, n_layer=3).double()
    idx = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(51))
    rows = []
    for block in model.transformer.h:
        block.mlp.c_fc.register_forward_hook(lambda m, i, o: rows.append(o.size(1)))
    with torch.no_grad():
        window = engine.window_logits(model, idx)  # (B, vocab_size)
        assert rows == [16, 16, 1]
        full = model(idx)[0][:, -1]  # (B, vocab_size), float64
    torch.testing.assert_close(window, full.float(), atol=1e-7, rtol=0)  # _window_logits returns float32


@pytest.mark.slow
def test_the_sliding_phase_casts_each_weight_to_the_window_dtype_once_not_once_a_step() -> None:
    """The window past block_size runs in one autocast context for the whole phase: 9 window steps cast the
    (128, 32) weights (each block's c_fc, the head) to bf16 as often as 2 steps do (autocast in a context per step
    would cast them once a step); after it the model holds its float32 weights, bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    model = make_model(seed=52)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(53))

    def weight_casts(window_steps: int) -> int:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = engine.generate(model, prompt, 8 + window_steps, temperature=0.0, window_dtype=torch.bfloat16)
        assert out.size(1) == 16 + window_steps
        return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                   and tuple(e.input_shapes[0]) == (128, 32))

    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert weight_casts(9) == weight_casts(2) > 0
    after = model.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v) for k, v in before.items())


def test_a_float32_window_dtype_runs_the_window_in_float32_without_warnings() -> None:
    """window_dtype=torch.float32 (sample.py --window_dtype=float32) turns the caller's autocast off for the
    window, with no autocast warning (autocast to float32 is not supported: it warns and turns itself off)."""
    model = make_model(seed=55)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(56))
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append((o.size(1), o.dtype)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.generate(model, prompt, 3, window_dtype=torch.float32)  # within the block
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.generate(model, prompt, 20, temperature=0.0, window_dtype=torch.float32)
    assert {dtype for length, dtype in seen if length == 16} == {torch.float32}
    assert {dtype for length, dtype in seen if length < 16} == {torch.bfloat16}  # the caller's autocast


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_top_k_filter_keeps_the_k_largest_and_ties() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 0.0])
    assert kept(top_k_filter(logits, 1)) == {1, 2}  # a tie at the k-th value is kept
    assert kept(top_k_filter(logits, 2)) == {1, 2}
    assert kept(top_k_filter(logits, 3)) == {1, 2, 3}
    assert kept(top_k_filter(logits, 99)) == {0, 1, 2, 3, 4}  # k larger than the vocabulary: all
    out = top_k_filter(logits, 3)
    assert torch.equal(out[[1, 2, 3]], logits[[1, 2, 3]])  # kept logits are unchanged
    rows = top_k_filter(torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]]), 1)  # per row
    assert kept(rows[0]) == {2} and kept(rows[1]) == {0}


def test_top_p_filter_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(top_p_filter(logits, 0.8)) == {0, 1}  # 0.5 + 0.3 reaches 0.8 exactly
    assert kept(top_p_filter(logits, 0.81)) == {0, 1, 2}
    assert kept(top_p_filter(logits, 0.5)) == {0}
    assert kept(top_p_filter(logits, 0.1)) == {0}  # the most likely token always stays
    assert kept(top_p_filter(logits, 1e-50)) == {0}  # even where p is 0 in float32
    assert kept(top_p_filter(logits, 1.0)) == {0, 1, 2, 3}
    shuffled = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()  # the kept set follows the tokens, not the positions
    assert kept(top_p_filter(shuffled, 0.8)) == {1, 3}
    out = top_p_filter(shuffled, 0.81)
    assert kept(out) == {0, 1, 3} and torch.equal(out[[0, 1, 3]], shuffled[[0, 1, 3]])
    rows = top_p_filter(torch.stack([logits, logits.flip(0)]), 0.81)
    assert kept(rows[0]) == {0, 1, 2} and kept(rows[1]) == {1, 2, 3}


def test_sample_next_token_greedy_seeded_and_temperature() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(16))
    assert torch.equal(sample_next_token(logits, temperature=0.0), logits.argmax(-1, keepdim=True))

    def draws(seed: int, **kw) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.cat([sample_next_token(logits, generator=g, **kw) for _ in range(50)], dim=1)  # (6, 50)

    a = draws(17, temperature=1.0)
    assert torch.equal(a, draws(17, temperature=1.0))
    assert not torch.equal(a, draws(18, temperature=1.0))
    assert set(draws(17, top_k=3).flatten().tolist()) <= set(torch.topk(logits, 3).indices.flatten().tolist())

    # Temperature reshapes the distribution: p(token 0) for logits [0, 1] is 1/(1+e) ≈ 0.269 at temperature 1,
    # and 1/(1+e^100) ≈ 0 at 0.01. 4,000 draws: standard error 0.007, tolerance 0.03 (> 4 sigma).
    two = torch.tensor([[0.0, 1.0]]).expand(4000, 2)
    g = torch.Generator().manual_seed(19)
    share_t1 = (sample_next_token(two, 1.0, generator=g) == 0).float().mean().item()
    share_cold = (sample_next_token(two, 0.01, generator=g) == 0).float().mean().item()
    assert abs(share_t1 - 1 / (1 + math.e)) < 0.03
    assert share_cold == 0.0


@pytest.mark.parametrize("kwargs", [dict(temperature=1e-40), dict(temperature=1e-45), dict(temperature=1e-300),
                                    dict(top_p=1e-50), dict(top_p=1e-300), dict(temperature=1e-300, top_p=1e-300),
                                    dict(temperature=1e-40, top_k=3)])
def test_temperatures_and_top_p_too_small_for_float32_take_the_most_likely_token(kwargs: dict) -> None:
    """temperature > 0 and top_p > 0 pass the checks, however small: logits / 1e-40 overflows float32 and top_p=1e-50
    is 0 in it, which once masked every token (multinomial: 'probability tensor contains inf, nan'). Their limit is
    the most likely token, greedy's choice: the draws, and a whole generation, equal temperature 0's."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(20)) * 10  # no ties at the maximum
    g = torch.Generator().manual_seed(21)
    for _ in range(20):
        assert torch.equal(sample_next_token(logits, generator=g, **kwargs), logits.argmax(-1, keepdim=True))
    model = make_model(seed=22)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(23))
    out = engine.generate(model, prompt, 20, generator=torch.Generator().manual_seed(24), **kwargs)
    assert torch.equal(out, engine.generate(model, prompt, 20, temperature=0.0))


def test_a_temperature_whose_quotient_overflows_draws_evenly_among_tied_maxima() -> None:
    """The limit of softmax(logits / t) as t -> 0 is even over the tokens tied at the maximum: a row with two such
    tokens draws both, never another; a row beside it whose quotient stays finite is divided as ever."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0], [0.0, 0.0, 0.0, 0.0]]).repeat(500, 1)  # (1000, 4)
    drawn = sample_next_token(logits, 1e-300, generator=torch.Generator().manual_seed(25)).flatten()
    tied, flat = drawn[0::2], drawn[1::2]
    assert set(tied.tolist()) == {1, 3} and abs((tied == 1).float().mean().item() - 0.5) < 0.1  # 500 draws: 5 sigma
    assert set(flat.tolist()) == {0, 1, 2, 3}  # 0 / 1e-300 is 0: the row's own even distribution


@pytest.mark.parametrize("temperature", [0.01, 0.5, 0.8, 1.0, 2.0])
def test_an_ordinary_temperature_draws_exactly_what_softmax_of_the_quotient_draws(temperature: float) -> None:
    """The overflow's limit changes nothing elsewhere: from the same generator, the tokens of nanoGPT's formula,
    multinomial(softmax(logits / temperature)), bit for bit."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(26)) * 5
    ours = sample_next_token(logits, temperature, generator=torch.Generator().manual_seed(27))
    reference = torch.multinomial(F.softmax(logits / temperature, dim=-1), 1, generator=torch.Generator().manual_seed(27))
    assert torch.equal(ours, reference)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), r"temperature=-0.5 must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_k=0), r"top_k=0 must be at least 1"),
    ],
)
def test_bad_sampling_arguments_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        sample_next_token(torch.zeros(1, 5), **kwargs)
    with pytest.raises(UserError, match=message):
        engine.generate(make_model(), torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)


@pytest.mark.parametrize("use_cache", [True, False])
def test_padded_ids_are_never_sampled_even_when_their_logits_dominate(use_cache: bool) -> None:
    model = make_model(seed=4, vocab_padding_multiple=64, block_size=32)
    C = model.config.n_embd
    with torch.no_grad():
        # ln_f with zero gain outputs its bias b at every position; padded head rows 5·b then score 5·|b|² ≈ 160,
        # far above any real row (≈ 0.02·|b|² scale), so unmasked they would take all the probability.
        b = torch.randn(C, generator=torch.Generator().manual_seed(5))
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(b)
        model.lm_head.weight[VOCAB:] = 5.0 * b
    prompt = torch.randint(0, VOCAB, (8, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model.lm_head(model._hidden(prompt))  # (B, T, 128): what the head computes before masking
    gap = full[..., VOCAB:].max(-1).values - full[..., :VOCAB].max(-1).values
    assert gap.min() > 50, "the test needs padded logits that would dominate if unmasked"
    assert F.softmax(full, -1)[..., VOCAB:].sum(-1).min() > 0.999

    g = torch.Generator().manual_seed(7)
    out = engine.generate(model, prompt, 125, temperature=1.0, generator=g, use_cache=use_cache)  # 8 x 125 = 1,000 tokens
    new = out[:, 4:]
    assert new.numel() == 1000
    assert new.max().item() < VOCAB, f"sampled padded id {new.max().item()}"
    assert new.unique().numel() > 50, "temperature-1 sampling should spread over many real ids"


def test_the_float64_check_passes_near_ties_and_names_a_clearly_worse_token() -> None:
    """model_helpers.first_divergence, the CUDA suite's check of generated tokens: a near-tie that rounding may flip
    passes, a clearly worse token is named. The runner-up comes from a brute-force float64 forward pass here."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).double().eval()
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(1))
    out = engine.generate(model, prompt, 9, temperature=0.0)  # (2, 12): past block_size 8, so windows slide
    assert first_divergence(model, out, 3, tol=0.0) is None  # greedy tokens are the float64 argmax

    # at new token 6 (position 9, predicted from the window of positions 1..8) take the runner-up of sample 1
    with torch.no_grad():
        logits = model(out[1:2, 1:9])[0][0, -1]  # (V,)
    top2 = logits.topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    flipped = out[:, :10].clone()
    flipped[1, 9] = top2.indices[1]
    assert first_divergence(model, flipped, 3, tol=gap * 1.01) is None, "a flip within the tolerance is a near-tie"
    why = first_divergence(model, flipped, 3, tol=gap * 0.99)
    assert why is not None and why.startswith("new token 6 of sample 1:"), why
