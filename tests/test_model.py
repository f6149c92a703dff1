"""
Tests for model.py: attention paths, padded vocabulary, bad settings, init, MFU and the training helpers.
Decoding is tests/test_engine.py's, the GPT-2 import tests/test_hf_gpt2.py's, the device probes tests/test_hardware.py's. Tiny configs on the CPU, fixed seeds, and every comparison has its tolerance
next to it. Run with -s to see the measured errors of the attention paths.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from nanogpt import engine
from nanogpt.errors import UserError
from nanogpt.hardware import check_attention_kernel
from model import GPT

from model_helpers import (
    ERR_RATIO,
    ERR_SLACK,
    GRAD_ATOL,
    LOGITS_ATOL,
    LOSS_ATOL,
    SDPA_BACKENDS_ON_CPU,
    VOCAB,
    make_model,
    max_err,
    padded_batch,
    rebuild,
    run,
    tiny_config,
)


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


def test_padding_rows_do_not_change_the_initial_weights() -> None:
    """The same seed gives the same real rows and every other tensor whatever the padding: runs with and without it
    train the same model (the padding rows start at zero)."""
    plain = make_model(seed=5, vocab_padding_multiple=1).state_dict()
    padded = make_model(seed=5, vocab_padding_multiple=64).state_dict()
    assert plain.keys() == padded.keys()
    for name, w in plain.items():
        assert torch.equal(padded[name][: w.size(0)], w), name
    assert padded["lm_head.weight"].shape == (128, 32) and not padded["lm_head.weight"][VOCAB:].any()


def test_padded_vocab_gives_the_same_loss_and_gradients() -> None:
    padded, plain = padded_and_plain()
    assert padded.lm_head.weight.shape[0] == 128 and plain.lm_head.weight.shape[0] == VOCAB
    with torch.no_grad():  # random padding rows (not the init's zeros): if they were not masked the loss would differ
        padded.lm_head.weight[VOCAB:].normal_(generator=torch.Generator().manual_seed(1))
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


# ----------------------------------------------------------------------------------- 3. bad attention settings


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_cuda_only_sdpa_backends_fail_clearly_on_cpu(backend: str) -> None:
    model = make_model(sdpa_backend=backend)
    idx = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(UserError, match=rf"sdpa_backend='{backend}' cannot run on cpu.*use 'flash', 'math' or 'auto'"):
        check_attention_kernel(model)  # what train.py, bench.py and sample.py run before the first forward
    with pytest.raises(RuntimeError, match=rf"^sdpa_backend='{backend}' cannot run this attention on cpu with dtype "
                                            r"torch.float32: choose another sdpa_backend, or 'auto' \(PyTorch: No"):
        model(idx)  # model.py alone: its own error, with PyTorch's


def test_unknown_attention_settings_list_the_choices() -> None:
    with pytest.raises(ValueError, match=r"attention='flashy' is not one of math, sdpa"):
        tiny_config(attention="flashy")
    with pytest.raises(ValueError, match=r"sdpa_backend='fast' is not one of auto, flash, efficient, cudnn, math"):
        tiny_config(sdpa_backend="fast")
    with pytest.raises(ValueError, match=r"gelu='exact' is not one of tanh, erf"):
        tiny_config(gelu="exact")
    with pytest.raises(ValueError) as info:  # both at once: one error naming both
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


# ----------------------------------------------------------------------------------- 4. init and helpers


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
    assert abs(model.transformer.wte.weight[:VOCAB].std().item() / 0.02 - 1) < 0.03  # the padding rows are zeros
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
    out = engine.generate(model, idx[:, :5], 20, temperature=0.0)
    assert out.shape == (2, 25) and torch.equal(out, model.generate(idx[:, :5], 20, temperature=0.0))
    with pytest.raises(ValueError, match="longer than block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="must be between 1 and the model's 16"):
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


def test_estimate_mfu() -> None:
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
    assert model.estimate_mfu(4, 0.5, None) is None  # no peak known


def test_sequence_longer_than_block_size_is_an_error() -> None:
    model = make_model()  # block_size 16
    with pytest.raises(ValueError, match=r"sequence of 17 tokens is longer than block_size=16: crop the input"):
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


def test_float16_math_attention_ignores_a_masked_key_whose_score_overflows() -> None:
    """A future key's score past float16's range is inf; the mask must replace it, not add -inf to it (NaN)."""
    attn = make_model(seed=54, attention="math").transformer.h[0].attn
    q, k = torch.ones(1, 1, 3, 4, dtype=torch.float16), torch.ones(1, 1, 3, 4, dtype=torch.float16)
    v = torch.arange(12, dtype=torch.float16).view(1, 1, 3, 4)
    k[..., 2, :] = 60000  # only the last query may see it: 4 * 60000 overflows
    y = attn._math_attention(q, k, v, None)  # (1, 1, 3, 4)
    assert torch.equal(y[0, 0, :2], torch.stack([v[0, 0, 0], v[0, 0, :2].mean(0)]))  # equal scores: a mean


def test_last_only_refuses_a_padding_mask_or_a_cache() -> None:
    block = make_model(seed=57).transformer.h[0]
    x = torch.randn(2, 4, 32)
    with pytest.raises(AssertionError, match="last_only"):
        block.attn(x, key_padding_mask=torch.ones(2, 4), last_only=True)


def test_a_model_built_for_loading_draws_no_random_init_and_loads_whole():
    """GPT.uninitialized (what every load builds: a checkpoint's, a sharded one's, GPT-2's, a resume's) runs none of
    the random init a load would throw away: the global RNG is where it was, as after no init at all. A checkpoint
    loaded into it is the saved model exactly, its head tied to the token embedding; and GPT(config) after it
    initialises as before (the skipping ends with the build)."""
    from nanogpt.checkpoint_file import model_from_checkpoint

    torch.manual_seed(0)
    saved = GPT(tiny_config())
    state = torch.get_rng_state()
    empty = GPT.uninitialized(tiny_config())
    assert torch.equal(torch.get_rng_state(), state)
    loaded = model_from_checkpoint({"model": saved.state_dict(), "model_args": vars(saved.config)})
    assert torch.equal(torch.get_rng_state(), state)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and empty.lm_head.weight is empty.transformer.wte.weight
    for (name, p), q in zip(saved.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), name
    torch.manual_seed(0)
    again = GPT(tiny_config())
    for p, q in zip(saved.parameters(), again.parameters()):
        assert torch.equal(p, q)



COPIED_ALONE = """
import json, sys
root, folder = sys.argv[1], sys.argv[2]
sys.path[:] = [p for p in sys.path if p not in ("", root)]  # nothing of the project's but the copy
sys.path.insert(0, folder)
import torch
import model
from model import GPT, GPTConfig
torch.manual_seed(0)
gpt = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32))
optimizer = gpt.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu", verbose=False)
x = torch.randint(0, 50, (4, 16))
before = gpt(x, x)[1].item()
for _ in range(3):
    logits, loss = gpt(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
after = gpt(x, x)[1].item()
out = gpt.eval().generate(x[:1, :4], 20, temperature=0.8, top_k=10)  # past block_size: the window slides
# the loss-only forward: the plain loss, or the head_loss handed in (here the plain loss summed, halved)
plain, loss_only = gpt(x, x)[1].item(), gpt(x, x, return_logits=False)[1].item()
gpt.head_loss = lambda h, w, t, v: model.cross_entropy_sum(h @ w.t(), t, v) / 2
handed = gpt(x, x, return_logits=False)[1].item()
try:  # a forced kernel this machine cannot run: the error names it, the device, the dtype and the fix
    GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, attention="sdpa",
                  sdpa_backend="cudnn"))(x)
    refused = None
except RuntimeError as e:
    refused = str(e)
print(json.dumps({"file": model.__file__, "logits": list(logits.shape), "before": before, "after": after,
                  "losses": [plain, loss_only, handed], "refused": refused, "generated": list(out.shape),
                  "imported": sorted(sys.modules.keys() & {"nanogpt", "transformers", "configurator"})}))
"""


@pytest.mark.slow
def test_model_py_works_copied_alone_into_an_empty_folder(tmp_path) -> None:
    """People copy model.py into their own projects, as nanoGPT's: there it builds a model, trains steps and generates
    with torch alone (no module of this project, nor transformers, imported), computes the loss it is handed, and
    names a forced attention kernel the machine refuses."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from helpers import ROOT

    shutil.copy(os.path.join(ROOT, "model.py"), tmp_path / "model.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", COPIED_ALONE, ROOT, str(tmp_path)], cwd=tmp_path, capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"] == str(tmp_path / "model.py") and got["imported"] == [], got
    assert got["logits"] == [4, 16, 50] and got["generated"] == [1, 24], got
    assert got["after"] < got["before"], got  # the steps trained it
    plain, loss_only, handed = got["losses"]
    assert loss_only == plain and handed == pytest.approx(plain / 2, rel=1e-6), got
    assert got["refused"].startswith("sdpa_backend='cudnn' cannot run this attention on cpu with dtype torch.float32: "
                                     "choose another sdpa_backend, or 'auto'"), got
