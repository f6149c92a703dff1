"""CUDA: KV-cache generation (static cache, compiled one-token step) against a float64 forward pass over its own
tokens. GPU kernels round differently from the CPU's and between the cached and uncached shapes, so tokens are
checked with model_helpers.first_divergence's tolerance (a near-tie may flip), not for exact equality."""
from __future__ import annotations

import copy

import torch

from cuda_helpers import requires_cuda
from nanogpt.engine import KVCache
from nanogpt import engine
from model import GPT, GPTConfig
from model_helpers import TOLERANCE, first_divergence

pytestmark = requires_cuda


def tiny(n_layer: int = 2, **changes) -> tuple[GPT, GPT]:
    """A tiny model on the GPU and its float64 copy on the CPU (the reference)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=101, n_layer=n_layer, n_head=2, n_embd=32, **changes)).eval()
    reference = copy.deepcopy(model).double()  # first: .cuda() moves the model itself
    return model.cuda(), reference


def check(reference: GPT, out: torch.Tensor, prompt_len: int, dtype: torch.dtype) -> None:
    why = first_divergence(reference, out.cpu(), prompt_len, TOLERANCE[dtype])
    assert why is None, why


def test_cached_and_uncached_greedy_past_block_size_agree_with_float64():
    model, reference = tiny()
    prompt = torch.randint(0, 101, (3, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for use_cache in (True, False):
        out = engine.generate(model, prompt, 30, temperature=0.0, use_cache=use_cache)  # block_size 16: slides
        assert out.shape == (3, 35) and out.device.type == "cuda"
        check(reference, out, 5, torch.float32)


def test_compiled_step_compiles_once_per_generation_for_a_deep_model_on_cuda():
    """The cache is sized to each generation (prompt + new tokens - 1, at most block_size), and the step's shapes
    are the cache's: each cache size compiles the step once, a cache of the same size compiles nothing new; past
    block_size the sliding window compiles once too."""
    from torch._dynamo.utils import counters

    model, reference = tiny(n_layer=10)
    prompt = torch.randint(0, 101, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    compiles = []

    def counted(p: torch.Tensor, n: int) -> torch.Tensor:
        before = counters["stats"]["unique_graphs"]
        out = engine.generate(model, p, n, temperature=0.0, compile=True)
        compiles.append(counters["stats"]["unique_graphs"] - before)
        return out

    torch._dynamo.reset()
    out = counted(prompt, 30)  # block_size 16 positions (the step), then the window slides (the window)
    again = counted(prompt[:, :3], 12)  # a new cache of 14 positions, another prompt length
    same_size = counted(prompt[:, :4], 11)  # 14 positions again
    assert compiles == [2, 1, 0]
    check(reference, out, 5, torch.float32)
    check(reference, again, 3, torch.float32)
    check(reference, same_size, 4, torch.float32)


def test_a_compiled_window_follows_the_window_dtype():
    """The window phase runs under autocast to window_dtype: the same model's compiled window in float32, then in
    bf16, then in float32 again, each as its eager window chooses (a compiled variant of the other dtype reused
    would round float32 activations to bf16, or keep bf16 ones in float32)."""
    model, reference = tiny()
    prompt = torch.randint(0, 101, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    for window_dtype in (None, torch.bfloat16, None):
        out = engine.generate(model, prompt, 30, temperature=0.0, compile=True, window_dtype=window_dtype)
        check(reference, out, 5, window_dtype or torch.float32)


def test_bf16_autocast_cache_is_bf16_and_tokens_stay_within_tolerance():
    model, reference = tiny()
    prompt = torch.randint(0, 101, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    with torch.autocast("cuda", torch.bfloat16):
        out = engine.generate(model, prompt, 10, temperature=0.0)
        cache = KVCache(model.config, 2, torch.bfloat16, "cuda")
        model(prompt, kv_cache=cache)
    assert cache.k[0].dtype == torch.bfloat16 and cache.pos == 5
    check(reference, out, 5, torch.bfloat16)


def test_seeded_sampling_on_cuda_repeats_and_stays_on_the_real_vocabulary():
    model, _ = tiny(vocab_padding_multiple=64)
    prompt = torch.zeros(4, 1, dtype=torch.long, device="cuda")

    def sample(seed: int) -> torch.Tensor:
        g = torch.Generator("cuda").manual_seed(seed)
        return engine.generate(model, prompt, 40, temperature=1.0, top_k=50, top_p=0.9, generator=g)

    a = sample(5)
    assert torch.equal(a, sample(5))
    assert a.max().item() < 101
