"""
The fused, chunked linear + cross-entropy (fused_loss.fused_linear_cross_entropy, a model's head_loss): the same loss
and gradients as the plain path (full logits, F.cross_entropy), checked against a float64 reference, in float32
and under bf16 autocast, with ignored targets (-1), a padded vocabulary, several chunks, gradient accumulation,
DDP (torchrun, gloo) and torch.compile. Its CUDA checks are in tests/cuda/test_cuda_fused.py.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from nanogpt import engine
from nanogpt.distributed import Dist
from helpers import HANG_S, config_args, make_char_dataset, run_script, tiny_config
from nanogpt.fused_loss import fused_linear_cross_entropy
from model import GPT, GPTConfig
from nanogpt.config import TrainConfig
from train import train
from nanogpt.step import train_step

VOCAB = 101  # padded to 128: 27 rows that must get no probability and no gradient
# float32 against the float64 reference: both paths sum the same terms in another order, a few ulps apart
F32_LOSS_RTOL, F32_GRAD_ATOL = 1e-6, 1e-6
# bf16 autocast: the matmuls round to 8 bits of mantissa, in either path; the fused path's error against the
# float64 reference may not exceed the plain path's by more than this factor (plus a float32-size slack), so it is
# as exact as the plain bf16 path, not merely "close to float32".
BF16_ERR_RATIO, BF16_SLACK = 1.5, 1e-6


def reference_loss_sum(x, weight, targets, vocab_size):
    """The plain path's definition, in the inputs' dtype: full logits over the real rows, summed cross-entropy."""
    logits = x @ weight[:vocab_size].t()  # (N, V)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")


def loss_and_grads(fn, x, weight):
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(x, weight)
    (2.5 * loss).backward()  # a scale, as gradient accumulation and the grad scaler apply one
    return loss.detach(), x.grad, weight.grad


def head_inputs(seed=0, N=70, C=24, Vp=128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    weight = torch.randn(Vp, C, generator=g) * 0.3
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    targets[::5] = -1  # ignored positions
    targets[-9:] = -1  # and a whole chunk's tail
    return x, weight, targets


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_loss_and_grads_match_the_float64_reference_like_the_plain_path(dtype):
    x, weight, targets = head_inputs()
    ref = loss_and_grads(lambda a, w: reference_loss_sum(a, w, targets, VOCAB), x.double(), weight.double())
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def plain(a, w):  # the model's plain path: padded logits set to -inf
        with autocast:
            logits = a @ w.t()
            logits[:, VOCAB:] = float("-inf")
            return F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")

    def fused(a, w):  # 16 rows per chunk: 5 chunks, the last one partial
        with autocast:
            return fused_linear_cross_entropy(a, w, targets, VOCAB, chunk_rows=16)

    plain_out, fused_out = loss_and_grads(plain, x, weight), loss_and_grads(fused, x, weight)
    assert fused_out[0].dtype == torch.float32 and fused_out[1].dtype == fused_out[2].dtype == torch.float32
    assert torch.all(fused_out[2][VOCAB:] == 0)  # padded rows: exactly no gradient
    names = ("loss", "grad x", "grad weight")
    errors = {n: (rel(p, r), rel(f, r)) for n, p, f, r in zip(names, plain_out, fused_out, ref)}
    print(f"\n[{dtype}] relative error vs float64 (plain, fused): {errors}")
    for name, (plain_err, fused_err) in errors.items():
        if dtype == "float32":
            assert fused_err < (F32_LOSS_RTOL if name == "loss" else F32_GRAD_ATOL), (name, fused_err)
        else:
            assert fused_err <= BF16_ERR_RATIO * plain_err + BF16_SLACK, (name, fused_err, plain_err)


def test_fused_loss_is_exact_in_float64_and_without_grad():
    """In float64 the fused path is the plain one up to float64 rounding; under no_grad (evaluation) the same
    loss comes out of the forward-only loop."""
    x, weight, targets = (t.double() if t.is_floating_point() else t for t in head_inputs(seed=3))
    ref = loss_and_grads(lambda a, w: reference_loss_sum(a, w, targets, VOCAB), x, weight)
    out = loss_and_grads(lambda a, w: fused_linear_cross_entropy(a, w, targets, VOCAB, chunk_rows=7), x, weight)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(x, weight, targets, VOCAB, 7), ref[0], rtol=1e-12, atol=0)


def tiny_model(fused: bool, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32))
    model.head_loss = fused_linear_cross_entropy if fused else None
    return model


def model_batch(seed=1, B=3, T=16):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (B, T), generator=g)
    targets = torch.randint(0, VOCAB, (B, T), generator=g)
    targets[1, 5:] = -1
    return idx, targets


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_fused_loss_equals_the_plain_model(dtype):
    """The fused head_loss against the plain loss, same weights: loss and every parameter's gradient (the
    tied embedding/head too), and the padded embedding rows get no gradient. Tolerances: float32 ulps; bf16 the
    rounding of the head matmul's bf16 output, the same order as bf16 against float32 (measured ~1e-3 relative)."""
    idx, targets = model_batch()
    results = {}
    for fused in (False, True):
        model = tiny_model(fused)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits, loss = model(idx, targets, return_logits=False)  # the training step's call
        loss.backward()
        assert logits is None
        results[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (plain_loss, plain_grads), (fused_loss, fused_grads) = results[False], results[True]
    rtol = 1e-6 if dtype == "float32" else 1e-2
    torch.testing.assert_close(fused_loss, plain_loss, rtol=rtol, atol=0)
    for n in plain_grads:
        assert rel(fused_grads[n], plain_grads[n]) < (1e-5 if dtype == "float32" else 2e-2), n
    assert torch.all(fused_grads["transformer.wte.weight"][VOCAB:] == 0)  # = lm_head.weight (tied)


def test_sampling_and_plain_forward_still_return_logits():
    model = tiny_model(fused=True).eval()
    idx, _ = model_batch()
    logits, loss = model(idx)
    assert logits.shape == (3, 16, VOCAB) and loss is None
    out = engine.generate(model, idx[:, :4], max_new_tokens=3, generator=torch.Generator().manual_seed(0))
    assert out.shape == (3, 7)


@pytest.mark.parametrize("fused", [True, False])
def test_model_x_y_returns_every_positions_logits_and_the_training_loss(fused):
    """nanoGPT's `logits, loss = model(X, Y)`, with either loss setting: the logits of every position over the real
    vocabulary (against a float64 copy of the model), and the loss and gradients of the training call
    (return_logits=False, fused or plain as configured) and of the float64 cross-entropy of those logits."""
    idx, targets = model_batch()
    model = tiny_model(fused)
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        ref_logits, _ = reference(idx)  # (B, T, VOCAB) in float64
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    logits, loss = model(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    _, train_loss = model(idx, targets, return_logits=False)
    train_loss.backward()
    assert logits.shape == (3, 16, VOCAB)
    torch.testing.assert_close(logits.double(), ref_logits, rtol=0, atol=1e-5)  # float32 against float64
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, train_loss, rtol=1e-6, atol=0)  # the fused and plain paths: a few ulps
    for n, p in model.named_parameters():
        assert rel(grads[n], p.grad) < 1e-5, n


def test_the_training_step_and_evaluation_form_no_logits_with_the_fused_loss(tmp_path):
    """train_step and estimate_loss ask for the loss only: with fused_loss the head's (tokens x vocab) output is
    never produced, so the lm_head module never runs (its weight goes to the fused loss); the plain model runs it."""
    from helpers import make_char_dataset
    from train import estimate_loss

    make_char_dataset(tmp_path, n_chars=2_000)
    splits = {split: str(tmp_path / f"{split}.bin") for split in ("train", "val")}
    cfg = TrainConfig(batch_size=2, block_size=16, eval_iters=2, grad_clip=0.0)
    no_autocast = torch.autocast("cpu", enabled=False)
    idx, targets = model_batch()
    for fused in (True, False):
        model = tiny_model(fused)
        head_outputs = []
        model.lm_head.register_forward_hook(lambda module, args, out: head_outputs.append(out.shape))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        f = train_step(model, opt, scaler, [(idx, targets)], no_autocast, cfg, Dist()).read()
        loss, applied = f.loss, f.applied
        losses = estimate_loss(model, cfg, splits, Dist(), no_autocast)
        assert applied and math.isfinite(loss) and all(math.isfinite(v) for v in losses.values())
        assert (head_outputs == []) == fused, head_outputs  # plain: 1 step + 2 splits x 2 batches
        assert fused or len(head_outputs) == 5


def test_gradient_accumulation_with_fused_loss_equals_one_plain_batch():
    """2 micro-steps of the fused model == 1 step of the plain model on both micro-batches at once (SGD lr 1: the
    parameters move by the gradient), with unequal numbers of ignored targets per micro-batch."""
    idx, targets = model_batch(seed=2, B=4)
    targets[2:, 3:] = -1
    params = {}
    for fused, batches in ((False, [(idx, targets)]), (True, [(idx[:2], targets[:2]), (idx[2:], targets[2:])])):
        model = tiny_model(fused)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        train_step(model, opt, scaler, batches, torch.autocast("cpu", enabled=False), TrainConfig(grad_clip=0.0), Dist())
        params[fused] = model.state_dict()
    assert max((params[True][k] - params[False][k]).abs().max().item() for k in params[True]) < 1e-6


@pytest.mark.slow
def test_compiled_fused_loss_equals_eager_plain():
    idx, targets = model_batch(seed=4)
    plain = tiny_model(fused=False)
    compiled = torch.compile(copy.deepcopy(plain).train())
    compiled._orig_mod.head_loss = fused_linear_cross_entropy
    grads = []
    for model in (plain, compiled):
        _, loss = model(idx, targets, return_logits=False)
        loss.backward()
        grads.append((loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=0)
    for n, g in grads[0][1].items():
        assert rel(grads[1][1][n], g) < 1e-5, n


@pytest.mark.slow
def test_ddp_with_fused_loss_equals_one_plain_process(tmp_path):
    """torchrun --nproc_per_node=2 (gloo) with the fused loss == 1 process with the plain loss and 2 micro-steps:
    same parameters after 4 steps and the same logged losses (train and eval)."""
    data_dir = tmp_path / "data"
    make_char_dataset(data_dir, n_chars=20_000)
    common = dict(gradient_accumulation_steps=2, max_iters=4, eval_interval=2, log_interval=1)
    single = tiny_config(data_dir, tmp_path / "single", fused_loss=False, **common)
    train(single)
    ddp = tiny_config(data_dir, tmp_path / "ddp", fused_loss=True, **common)
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                    *config_args(ddp)], timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=False)["model"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    logs = [[json.loads(l) for l in open(tmp_path / run / "metrics.jsonl")] for run in ("single", "ddp")]
    for x, y in zip(*logs):
        for key in ("loss", "val_loss", "train_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-5), (key, x, y)


@pytest.mark.parametrize("fused", [True, False])
def test_targets_with_any_strides_give_the_loss_of_contiguous_ones(fused):
    """y = x[:, 1:] of one (B, T + 1) block is not contiguous: targets.view(-1) raised "view size is not compatible"
    (found writing the CUDA suite's repro); both loss paths take such targets."""
    model = tiny_model(fused)
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(5))
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert not y.is_contiguous()
    with torch.no_grad():
        _, loss = model(x, y, return_logits=False)
        _, expected = model(x.contiguous(), y.contiguous(), return_logits=False)
    assert torch.equal(loss, expected)
