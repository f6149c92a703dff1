"""
Tests for model.py: attention paths, padded vocabulary, KV-cache generation, GPT-2 weight import, sampling
filters and the training helpers. Tiny configs on the CPU, fixed seeds, and every comparison has its tolerance
next to it. Run with -s to see the measured errors of the attention paths.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import hardware
from errors import UserError
from hardware import check_attention_kernel, device_peak_flops, gpu_peak_flops, sdpa_kernel_compiles
from engine import KVCache
from model import GPT, GPTConfig
from engine import sample_next_token, top_k_filter, top_p_filter

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


# ----------------------------------------------------------------------------------- 1. math vs SDPA attention


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding-mask"])
@pytest.mark.parametrize("backend", SDPA_BACKENDS_ON_CPU)
def test_sdpa_matches_math_and_float64_reference(backend: str, masked: bool) -> None:
    math_model = make_model(attention="math")
    sdpa_model = rebuild(math_model, attention="sdpa", sdpa_backend=backend)
    reference = copy.deepcopy(math_model).double()  # same weights, float64, math attention
    idx, targets, mask = padded_batch(lengths=(12, 7) if masked else (12, 12))
    if not masked:
        mask = None
    real = (mask if mask is not None else torch.ones_like(idx)).bool()  # compare logits at real positions only

    ref_logits, ref_loss, ref_grads = run(reference, idx, targets, mask)
    errors = {}
    results = {}
    for name, model in (("math", math_model), (f"sdpa/{backend}", sdpa_model)):
        logits, loss, grads = run(model, idx, targets, mask)
        results[name] = (logits, loss, grads)
        errors[name] = {
            "logits": max_err(logits[real], ref_logits[real]),
            "loss": max_err(loss, ref_loss),
            "grads": max(max_err(grads[n], ref_grads[n]) for n in ref_grads),
        }
        print(f"\n[{'mask' if masked else 'no mask'}] {name:>12} max |error| vs float64: {errors[name]}")

    math_err, sdpa_err = errors["math"], errors[f"sdpa/{backend}"]
    for what, atol in (("logits", LOGITS_ATOL), ("loss", LOSS_ATOL), ("grads", GRAD_ATOL)):
        assert math_err[what] < atol, f"math {what} off the float64 reference by {math_err[what]:.3g}"
        assert sdpa_err[what] < atol, f"sdpa {what} off the float64 reference by {sdpa_err[what]:.3g}"
        assert sdpa_err[what] <= ERR_RATIO * math_err[what] + ERR_SLACK, (
            f"sdpa/{backend} {what} error {sdpa_err[what]:.3g} exceeds 2x math's {math_err[what]:.3g} + {ERR_SLACK}"
        )
    # and directly against each other, every parameter's gradient
    (ml, mloss, mg), (sl, sloss, sg) = results["math"], results[f"sdpa/{backend}"]
    torch.testing.assert_close(sl[real], ml[real], atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(sloss, mloss, atol=LOSS_ATOL, rtol=0)
    assert set(sg) == set(mg) and len(sg) == len(list(math_model.parameters()))
    for n in mg:
        torch.testing.assert_close(sg[n], mg[n], atol=GRAD_ATOL, rtol=0, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_padded_positions_do_not_contribute_to_the_loss(attention: str) -> None:
    model = make_model(attention=attention)
    lengths = (12, 7, 3)
    idx, targets, mask = padded_batch(seed=2, lengths=lengths)
    logits, loss, grads = run(model, idx, targets, mask)

    # Reference: each row alone, cut to its real length, no mask; the loss is the mean over all real positions.
    model.zero_grad(set_to_none=True)
    total, count, row_logits = 0.0, 0, []
    for row, n in enumerate(lengths):
        lg, _ = model(idx[row : row + 1, :n])
        row_logits.append(lg[0])
        total = total + F.cross_entropy(lg[0], targets[row, :n], reduction="sum")
        count += n
    ref_loss = total / count
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=0)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(logits[row, :n], row_logits[row].detach(), atol=1e-5, rtol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=0, msg=lambda m, n=n: f"{n}: {m}")

    # Other tokens on the padding change nothing at the real positions, nor the loss, nor any gradient.
    idx2 = torch.where(mask.bool(), idx, (idx + 50) % VOCAB)
    logits2, loss2, grads2 = run(model, idx2, targets, mask)
    assert not torch.equal(idx2, idx)
    torch.testing.assert_close(loss2, loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits2[mask.bool()], logits[mask.bool()], atol=1e-5, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads2[n], grads[n], atol=1e-6, rtol=0)


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_an_all_padding_row_stays_finite_and_changes_nothing_else(attention: str) -> None:
    # A padding query with no real key before it would attend to nothing (softmax over no keys is NaN);
    # a NaN there would reach the gradients through the shared weights even though its target is ignored.
    model = make_model(seed=26, attention=attention)
    idx, targets, mask = padded_batch(seed=27, lengths=(12, 0))
    logits, loss, grads = run(model, idx, targets, mask)
    assert torch.isfinite(logits).all() and torch.isfinite(loss)
    assert all(torch.isfinite(g).all() for g in grads.values())
    alone_logits, alone_loss, alone_grads = run(model, idx[:1], targets[:1], mask[:1])
    torch.testing.assert_close(loss, alone_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[0], alone_logits[0], atol=1e-5, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads[n], alone_grads[n], atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------- 2. padded vocabulary


def padded_and_plain(seed: int = 0) -> tuple[GPT, GPT]:
    padded = make_model(seed, vocab_padding_multiple=64)
    plain = GPT(tiny_config(vocab_padding_multiple=1)).eval()
    tied = ("transformer.wte.weight", "lm_head.weight")
    sd = {k: (v[:VOCAB] if k in tied else v) for k, v in padded.state_dict().items()}
    plain.load_state_dict(sd)
    return padded, plain


def test_padded_vocab_gives_the_same_loss_and_gradients() -> None:
    padded, plain = padded_and_plain()
    assert padded.lm_head.weight.shape[0] == 128 and plain.lm_head.weight.shape[0] == VOCAB
    # The padded rows hold random init (not zeros), so if they were not masked the loss would differ.
    assert padded.lm_head.weight[VOCAB:].abs().sum() > 0
    idx, targets, _ = padded_batch(seed=3, lengths=(12, 12))

    p_logits, p_loss, p_grads = run(padded, idx, targets)
    q_logits, q_loss, q_grads = run(plain, idx, targets)
    assert p_logits.shape == q_logits.shape == (2, 12, VOCAB)
    torch.testing.assert_close(p_loss, q_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(p_logits, q_logits, atol=1e-5, rtol=0)
    for n in q_grads:
        if n == "transformer.wte.weight":
            torch.testing.assert_close(p_grads[n][:VOCAB], q_grads[n], atol=1e-6, rtol=0)
            assert torch.count_nonzero(p_grads[n][VOCAB:]) == 0, "padded rows must get exactly zero gradient"
        else:
            torch.testing.assert_close(p_grads[n], q_grads[n], atol=1e-6, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
    # logits without targets (generation's path) are cut to the real vocabulary too
    assert padded(idx)[0].shape == (2, 12, VOCAB)


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
    out = model.generate(prompt, 125, temperature=1.0, generator=g, use_cache=use_cache)  # 8 x 125 = 1,000 tokens
    new = out[:, 4:]
    assert new.numel() == 1000
    assert new.max().item() < VOCAB, f"sampled padded id {new.max().item()}"
    assert new.unique().numel() > 50, "temperature-1 sampling should spread over many real ids"


# ----------------------------------------------------------------------------------- 3. KV cache


def greedy_reference(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding the slow, obvious way: full forward over the last block_size tokens each step."""
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -model.config.block_size :])
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


PATHS = [("math", "auto"), ("sdpa", "auto"), ("sdpa", "math"), ("sdpa", "flash")]
PATH_IDS = [f"{a}-{b}" if a == "sdpa" else a for a, b in PATHS]


@pytest.mark.parametrize("attention,backend", PATHS, ids=PATH_IDS)
def test_cached_greedy_generation_matches_uncached_past_block_size(attention: str, backend: str) -> None:
    model = make_model(seed=8, attention=attention, sdpa_backend=backend)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    expected = greedy_reference(model, prompt, 40)
    cached = model.generate(prompt, 40, temperature=0.0, use_cache=True)
    uncached = model.generate(prompt, 40, temperature=0.0, use_cache=False)
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
        return model.generate(prompt, 30, temperature=0.9, top_k=40, top_p=0.95, generator=g, use_cache=use_cache)

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
    with pytest.raises(UserError, match="longer than block_size=16"):
        model(idx[:, :1], kv_cache=cache)


def test_prompt_is_prefilled_in_one_pass_then_one_position_per_token() -> None:
    model = make_model(seed=30, block_size=32)
    widths = []
    model.transformer.h[0].register_forward_hook(lambda mod, args, out: widths.append(args[0].size(1)))
    prompt = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(31))
    model.generate(prompt, 10, temperature=0.0)
    assert widths == [7] + [1] * 9  # the 10th token's logits come from the 9th step; nothing runs after it


def test_batch_rows_generate_as_they_would_alone() -> None:
    model = make_model(seed=32)
    prompt = torch.randint(0, VOCAB, (3, 4), generator=torch.Generator().manual_seed(33))
    together = model.generate(prompt, 25, temperature=0.0)  # past block_size 16 too
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
        return model.generate(prompt, n, temperature=0.9, top_k=40, top_p=0.95, generator=g, use_cache=use_cache)

    greedy, sampled = model.generate(prompt, n, temperature=0.0), sample(True)
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
        with pytest.raises(UserError, match="6 positions do not fit the KV cache, which holds 5"):
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


def test_compiled_decode_compiles_once_per_generation_for_a_deep_model_and_matches_eager() -> None:
    """10 layers (more than dynamo's recompile limit of 8, which per-layer compiles hit). The step's shapes are
    fixed by the cache's size, so a generation compiles at most once however many positions it steps through; a
    later one with a cache of the same size compiles nothing, one with another size (within block_size) its own
    variant, once. Compiles are counted by dynamo's graph counter. Greedy tokens equal the uncached ones, and
    seeded sampling gives the same tokens as eager (the sampler runs eagerly on the same logits up to rounding,
    which no near-tie meets in this model)."""
    from torch._dynamo.utils import counters

    model = make_model(seed=36, n_layer=10, n_embd=16)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(37))

    def sample(compile: bool, p: torch.Tensor, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(38)
        return model.generate(p, n, temperature=0.9, top_k=40, top_p=0.95, generator=g, compile=compile)

    compiles = []

    def counted(generate) -> torch.Tensor:
        before = counters["stats"]["unique_graphs"]
        out = generate()
        compiles.append(counters["stats"]["unique_graphs"] - before)
        return out

    torch._dynamo.reset()
    # 16 positions, then 19 steps of the sliding window: the step and the window compile once each
    past = counted(lambda: model.generate(prompt, 30, temperature=0.0, compile=True))
    reaching = counted(lambda: sample(True, prompt[:, :3], 14))  # 3 + 14 = block_size + 1: 16 positions, no slide
    within = counted(lambda: model.generate(prompt, 6, temperature=0.0, compile=True))  # 10 positions
    within_sampled = counted(lambda: sample(True, prompt[:, :3], 8))  # another prompt length, 10 positions again
    longer = counted(lambda: model.generate(prompt, 40, temperature=0.0, compile=True))  # more window steps: none
    assert compiles == [2, 0, 1, 0, 0]
    assert torch.equal(past, greedy_reference(model, prompt, 30))
    assert torch.equal(longer, greedy_reference(model, prompt, 40))
    assert torch.equal(within, greedy_reference(model, prompt, 6))
    assert torch.equal(reaching, sample(False, prompt[:, :3], 14))
    assert torch.equal(within_sampled, sample(False, prompt[:, :3], 8))


# ----------------------------------------------------------------------------------- 4. HF GPT-2 parity


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may reach for the network: HF reads HF_HUB_OFFLINE at import, so patch the constant too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def tiny_hf_gpt2(activation: str = "gelu_new"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(14)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=0,
                        activation_function=activation)
    hf = GPT2LMHeadModel(config)
    with torch.no_grad():  # non-trivial biases and LayerNorm gains, so a mis-copied one shows in the logits
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("multiple, activation, gelu", [(64, "gelu_new", "tanh"), (1, "gelu_new", "tanh"), (64, "gelu", "erf")])
def test_from_pretrained_matches_hf_gpt2_logits(tmp_path, multiple: int, activation: str, gelu: str) -> None:
    hf = tiny_hf_gpt2(activation)
    path = tmp_path / "tiny-gpt2"
    hf.save_pretrained(path)
    model = GPT.from_pretrained(str(path), vocab_padding_multiple=multiple).eval()
    assert model.config.vocab_size == 300 and model.config.gelu == gelu
    assert model.lm_head.weight.shape[0] == (320 if multiple == 64 else 300)
    idx = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert ours.shape == theirs.shape == (2, 64, 300)
    print(f"\nHF parity (padding multiple {multiple}, {activation}): max |logit diff| {max_err(ours, theirs):.3g}")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # float32
    if multiple == 64:
        assert torch.count_nonzero(model.lm_head.weight[300:]) == 0


@pytest.mark.usefixtures("offline")
def test_from_pretrained_rejects_bad_overrides_names_and_shapes(tmp_path) -> None:
    allowed = r"only \['attention', 'dropout', 'fused_loss', 'sdpa_backend'\]"
    with pytest.raises(UserError, match=r"cannot override \['n_layer'\] of GPT-2; " + allowed):
        GPT.from_pretrained("gpt2", override_args={"n_layer": 4})
    with pytest.raises(UserError, match=r"unknown GPT-2 model 'gpt3': use gpt2, gpt2-medium"):
        GPT.from_pretrained("gpt3")
    with pytest.raises(UserError, match="unknown GPT-2 model"):
        GPT.from_pretrained(str(tmp_path / "no-such-folder"))

    with pytest.raises(UserError, match=r"unsupported GPT-2 activation 'relu': this model supports gelu_new, gelu_pytorch_tanh, gelu"):
        GPT.from_hf_model(tiny_hf_gpt2("relu"))
    hf = tiny_hf_gpt2()
    hf.transformer.h[1].mlp.c_fc.bias = nn.Parameter(torch.zeros(100))  # expected 4 * 64 = 256
    with pytest.raises(UserError, match=r"key transformer\.h\.1\.mlp\.c_fc\.bias has shape \(100,\), expected \(256,\)"):
        GPT.from_hf_model(hf)


# ----------------------------------------------------------------------------------- 5. bad attention settings


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_cuda_only_sdpa_backends_fail_clearly_on_cpu(backend: str) -> None:
    model = make_model(sdpa_backend=backend)
    idx = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(UserError, match=rf"sdpa_backend='{backend}' cannot run on cpu.*use 'flash', 'math' or 'auto'"):
        model(idx)


def test_unknown_attention_settings_list_the_choices() -> None:
    with pytest.raises(UserError, match=r"attention='flashy' is not one of math, sdpa"):
        tiny_config(attention="flashy")
    with pytest.raises(UserError, match=r"sdpa_backend='fast' is not one of auto, flash, efficient, cudnn, math"):
        tiny_config(sdpa_backend="fast")
    with pytest.raises(UserError, match=r"gelu='exact' is not one of tanh, erf"):
        tiny_config(gelu="exact")
    with pytest.raises(UserError) as info:  # both at once: one error naming both
        tiny_config(attention="flashy", sdpa_backend="fast")
    assert "attention='flashy'" in str(info.value) and "sdpa_backend='fast'" in str(info.value)


def test_gelu_setting_picks_the_tanh_or_the_exact_form() -> None:
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    tanh = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    assert (exact - tanh).abs().max() > 1e-4  # the two forms differ enough for the checks below to tell them apart
    for gelu, want in (("tanh", tanh), ("erf", exact)):
        mlp_gelu = GPT(tiny_config(gelu=gelu)).transformer.h[0].mlp.gelu
        torch.testing.assert_close(mlp_gelu(x), want, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------------- 6. sampling


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
        make_model().generate(torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)


# ----------------------------------------------------------------------------------- 6. init and helpers


def test_init_scales_residual_projections_and_ties_weights() -> None:
    torch.manual_seed(20)
    model = GPT(tiny_config(n_layer=2, n_head=4, n_embd=256))  # 65k and 262k samples per c_proj
    scaled = 0.02 / math.sqrt(2 * 2)
    for i, block in enumerate(model.transformer.h):
        for name, lin, std in (
            ("attn.c_proj", block.attn.c_proj, scaled),
            ("mlp.c_proj", block.mlp.c_proj, scaled),
            ("attn.c_attn", block.attn.c_attn, 0.02),
            ("mlp.c_fc", block.mlp.c_fc, 0.02),
        ):
            # relative standard error of a std estimate is 1/sqrt(2n) < 0.3% here: 3% is > 10 sigma,
            # yet 0.01 vs 0.02 (a missing scale) is a 100% difference
            w = lin.weight
            assert abs(w.std().item() / std - 1) < 0.03, f"h.{i}.{name}: std {w.std().item():.5f}, expected {std:.5f}"
            assert abs(w.mean().item()) < 0.1 * std
            assert torch.count_nonzero(lin.bias) == 0
    assert abs(model.transformer.wte.weight.std().item() / 0.02 - 1) < 0.03
    assert model.transformer.wte.weight is model.lm_head.weight


def test_configure_optimizers_decays_exactly_the_2d_params() -> None:
    model = make_model()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu", verbose=False)
    decay, no_decay = opt.param_groups
    params = list(model.parameters())  # the tied weight once
    assert {id(p) for p in decay["params"]} == {id(p) for p in params if p.dim() == 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in params if p.dim() < 2}
    assert len(decay["params"]) + len(no_decay["params"]) == len(params)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    # every 2-D param here is a matmul or embedding: 2 per attention, 2 per MLP, wte (= lm_head), wpe
    assert len(decay["params"]) == 4 * model.config.n_layer + 2


def test_crop_block_size_shrinks_wpe_and_still_runs() -> None:
    model = make_model(seed=21, block_size=32)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        before, _ = model(idx)
    model.crop_block_size(16)
    assert model.config.block_size == 16 and model.transformer.wpe.weight.shape == (16, 32)
    with torch.no_grad():
        after, _ = model(idx)
    torch.testing.assert_close(after, before, atol=0, rtol=0)  # causal: the first 16 positions do not change
    out = model.generate(idx[:, :5], 20, temperature=0.0)
    assert out.shape == (2, 25) and torch.equal(out, model.generate(idx[:, :5], 20, temperature=0.0, use_cache=False))
    with pytest.raises(UserError, match="longer than block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(UserError, match="must be between 1 and the model's 16"):
        model.crop_block_size(32)


def test_no_per_layer_causal_mask_and_crop_keeps_no_view_of_the_larger_tables() -> None:
    """Bug: every layer held its own (block_size, block_size) mask (12 x 1 MiB for GPT-2) and crop_block_size kept
    views of the larger mask and position table alive. The model now holds no buffer, and a crop owns its storage."""
    model = make_model(seed=23, block_size=64, n_layer=3, attention="math")
    assert sum(b.numel() for b in model.buffers()) == 0
    model.crop_block_size(16)
    wpe = model.transformer.wpe
    assert wpe.weight.untyped_storage().nbytes() == 16 * 32 * wpe.weight.element_size()
    assert wpe.num_embeddings == 16
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in model.state_dict().values())


def test_estimate_mfu_and_device_peak_flops() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    # math attention: the counter sees its matmuls; no biases, which the estimate counts as if they were weights
    model = make_model(block_size=16, n_layer=2, n_head=2, n_embd=32, attention="math", bias=False)
    x = torch.randint(0, 100, (4, 16))
    with FlopCounterMode(display=False) as counter:  # PyTorch counts the FLOPs of forward and backward
        model(x, x)[1].backward()
    counted = counter.get_total_flops()
    # the 6N + 12·L·C·T estimate also counts the LayerNorm weights (0.6% of N here) as matmul weights
    assert model.estimate_mfu(4, 0.5, peak_flops=1e12) == pytest.approx(counted / 0.5 / 1e12, rel=0.01)
    assert model.estimate_mfu(4, 0.0, peak_flops=1e12) is None
    assert model.estimate_mfu(4, 0.5) is None  # on the CPU: no peak in the GPU table


# The names torch.cuda.get_device_name reports, and each one's dense bf16 (V100/T4: fp16) peak from NVIDIA's
# datasheets (the sparse figures halved). The NVL and PCIe parts are slower than the SXM ones of the same name.
DEVICE_PEAKS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA H800": 989e12,
    "NVIDIA H800 PCIe": 756e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA B200": 2.25e15,
    "NVIDIA GB200": 2.5e15,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A800 80GB PCIe": 312e12,
    "NVIDIA A10G": 70e12,
    "NVIDIA A10": 125e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L4": 121e12,
    "NVIDIA RTX A6000": 155e12,
    "NVIDIA GeForce RTX 4090": 165e12,
    "NVIDIA GeForce RTX 3090": 71e12,
    "Tesla V100-SXM2-16GB": 125e12,
    "Tesla T4": 65e12,
    # not in the table: no figure rather than a neighbour's
    "NVIDIA RTX A1000": None,
    "NVIDIA RTX A4000": None,
    "Some Unknown Accelerator": None,
}


@pytest.mark.parametrize("name", DEVICE_PEAKS)
def test_gpu_peak_flops_matches_the_most_specific_name(name: str) -> None:
    assert gpu_peak_flops(name) == DEVICE_PEAKS[name]


def test_mfu_of_a_cpu_run_never_takes_a_visible_gpus_peak(monkeypatch) -> None:
    # a GPU is visible, but the model runs on the CPU: its MFU has no peak (the old code took the A100's)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert device_peak_flops("cpu") is None
    assert make_model().estimate_mfu(4, 0.5) is None
    assert device_peak_flops("cuda:0") == 312e12


def test_peak_flops_asks_for_the_runs_gpu(monkeypatch) -> None:
    names = {0: "NVIDIA A100-SXM4-80GB", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_name",
        lambda device=None: names[0 if device is None else torch.device(device).index or 0],
    )
    assert device_peak_flops("cuda:1") == 989e12


def test_sequence_longer_than_block_size_is_an_error() -> None:
    model = make_model()  # block_size 16
    with pytest.raises(UserError, match=r"sequence of 17 tokens is longer than block_size=16: crop the input"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_dropout_is_active_in_train_mode_and_off_in_eval(attention: str) -> None:
    model = make_model(seed=23, attention=attention, dropout=0.2)
    no_dropout = rebuild(model, dropout=0.0)
    idx, targets, _ = padded_batch(seed=24, lengths=(12, 12))

    model.train()
    torch.manual_seed(25)
    logits1, loss = model(idx, targets)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    logits2, _ = model(idx, targets)
    assert max_err(logits1, logits2) > 1e-3, "dropout should make two train-mode passes differ"
    torch.manual_seed(25)
    torch.testing.assert_close(model(idx, targets)[0], logits1, atol=0, rtol=0)  # same seed, same masks

    model.eval()
    with torch.no_grad():
        e1, _ = model(idx)
        e2, _ = model(idx)
        ref, _ = no_dropout.eval()(idx)
    assert torch.equal(e1, e2)
    torch.testing.assert_close(e1, ref, atol=0, rtol=0)  # eval == the same weights without dropout


@pytest.mark.parametrize("attention", ["math", "sdpa"])
def test_attention_dropout_is_applied_on_both_paths(attention: str) -> None:
    model = make_model(seed=28, attention=attention, dropout=0.2).train()
    # Switch off every dropout but the one on the attention weights, so only it can make two passes differ.
    model.transformer.drop.p = 0.0
    for block in model.transformer.h:
        block.attn.resid_dropout.p = 0.0
        block.mlp.dropout.p = 0.0
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(29))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx)
        model.eval()
        c, _ = model(idx)
        d, _ = model(idx)
    assert max_err(a, b) > 1e-3, f"{attention}: attention dropout had no effect in train mode"
    assert torch.equal(c, d)


def test_a_cuda_kernel_refusal_becomes_a_clear_error(monkeypatch):
    """On CUDA, PyTorch words a refused kernel "No available kernel"; the model must turn it into a UserError
    (simulated here: the CPU cannot run the CUDA kernels)."""
    import torch.nn.functional as F

    from errors import UserError
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=16, sdpa_backend="flash"))

    def refuse(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with pytest.raises(UserError, match=r"sdpa_backend='flash' cannot run on cpu with dtype torch.float32"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_a_cuda_refusal_names_the_chosen_kernels_reasons_only():
    """The warnings an H100 gave (torch 2.11) when flash refused float32 with a mask: the refusal keeps the two
    reasons and drops the per-kernel headers, the kernels sdpa_kernel turned off and the source locations (the
    first version of the message began with "Memory efficient kernel not used because: (Triggered internally")."""
    from hardware import sdpa_refusal_reasons

    at = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:986.)"
    warned = [
        "Memory efficient kernel not used because:" + at,
        "Memory Efficient attention has been runtime disabled." + at,
        "Flash attention kernel not used because:" + at,
        "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, Key dtype: "
        "float, and Value dtype: float instead." + at,
        "Flash Attention does not support non-null attn_mask." + at,
        "cuDNN attention kernel not used because:" + at,
        "cuDNN attention has been runtime disabled." + at,
    ]
    assert sdpa_refusal_reasons(warned) == (
        "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, Key dtype: "
        "float, and Value dtype: float instead.; Flash Attention does not support non-null attn_mask."
    )
    assert sdpa_refusal_reasons(["Flash attention kernel not used because:" + at]) == (
        "Flash attention kernel not used because:")  # nothing more specific: what there is
    assert sdpa_refusal_reasons([]) == "no reason given by PyTorch"


def test_a_refused_forced_kernel_is_the_one_line_error_even_compiled(tmp_path) -> None:
    # flash refuses dropout on the CPU: eager and compiled runs both stop with the UserError before any step (the
    # compiled one raised torch._dynamo's TorchRuntimeError from inside the compiler)
    from helpers import make_char_dataset, tiny_config as train_config
    from train import train

    make_char_dataset(tmp_path / "data", n_chars=5_000)
    for compile in (False, True):
        cfg = train_config(tmp_path / "data", tmp_path / f"out{compile}", compile=compile, attention="sdpa",
                          sdpa_backend="flash", dropout=0.1, max_iters=2)
        with pytest.raises(UserError, match="sdpa_backend='flash' cannot run on cpu .*dropout"):
            train(cfg)
    model = make_model(attention="sdpa", sdpa_backend="flash", dropout=0.1)
    check_attention_kernel(model.eval(), compile=True)  # without dropout (eval) flash runs: nothing raised


def test_forced_kernel_compiles_into_one_graph_or_is_refused(monkeypatch) -> None:
    # a forced kernel's sdpa_kernel context must not break the compiled graph (torch before 2.5 broke it at
    # every layer's attention and ran attention eagerly)
    model = make_model(attention="sdpa", sdpa_backend="flash", n_layer=2)
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert sdpa_kernel_compiles()
    monkeypatch.setattr(hardware, "sdpa_kernel_compiles", lambda: False)  # a torch whose dynamo cannot
    with pytest.raises(UserError, match="needs torch 2.5 or later"):
        check_attention_kernel(model, compile=True)
    check_attention_kernel(model, compile=False)  # eager: fine on any torch


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
    out = model.generate(prompt, 20, temperature=0.0, window_dtype=torch.bfloat16)
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


def test_the_sliding_phase_casts_each_weight_to_the_window_dtype_once_not_once_a_step() -> None:
    """The window past block_size runs under one autocast context for the whole phase, which keeps its casts of
    the weights: 9 window steps cast the (128, 32) weights (each block's c_fc, the head) to bf16 as often as 2 steps
    do (a context per step cast them once a step)."""
    from torch.profiler import ProfilerActivity, profile

    model = make_model(seed=52)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(53))

    def weight_casts(window_steps: int) -> int:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = model.generate(prompt, 8 + window_steps, temperature=0.0, window_dtype=torch.bfloat16)
        assert out.size(1) == 16 + window_steps
        return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                   and tuple(e.input_shapes[0]) == (128, 32))

    assert weight_casts(9) == weight_casts(2) > 0


def test_float16_math_attention_ignores_a_masked_key_whose_score_overflows() -> None:
    """A future key's score past float16's range is inf; the mask must replace it, not add -inf to it (NaN)."""
    attn = make_model(seed=54, attention="math").transformer.h[0].attn
    q, k = torch.ones(1, 1, 3, 4, dtype=torch.float16), torch.ones(1, 1, 3, 4, dtype=torch.float16)
    v = torch.arange(12, dtype=torch.float16).view(1, 1, 3, 4)
    k[..., 2, :] = 60000  # only the last query may see it: 4 * 60000 overflows
    y = attn._math_attention(q, k, v, None)  # (1, 1, 3, 4)
    assert torch.equal(y[0, 0, :2], torch.stack([v[0, 0, 0], v[0, 0, :2].mean(0)]))  # equal scores: a mean


def test_a_float32_window_dtype_runs_the_window_in_float32_without_warnings() -> None:
    """window_dtype=torch.float32 (sample.py --window_dtype=float32) turns the caller's autocast off for the
    window, with no autocast warning (autocast to float32 is not supported: it warns and turns itself off)."""
    model = make_model(seed=55)  # block_size 16
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(56))
    seen = []
    model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda m, i, o: seen.append((o.size(1), o.dtype)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate(prompt, 3, window_dtype=torch.float32)  # within the block
        seen.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.generate(prompt, 20, temperature=0.0, window_dtype=torch.float32)
    assert {dtype for length, dtype in seen if length == 16} == {torch.float32}
    assert {dtype for length, dtype in seen if length < 16} == {torch.bfloat16}  # the caller's autocast


def test_last_only_refuses_a_padding_mask_or_a_cache() -> None:
    block = make_model(seed=57).transformer.h[0]
    x = torch.randn(2, 4, 32)
    with pytest.raises(AssertionError, match="last_only"):
        block.attn(x, key_padding_mask=torch.ones(2, 4), last_only=True)
