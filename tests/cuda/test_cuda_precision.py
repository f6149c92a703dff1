"""CUDA precision: TF32 on and off (the flags read back, and the numbers they give), bf16 autocast training, and
float16 with the grad scaler (overflow skipped and the scale halved; a skipped non-finite step does not break the
next one, issue 17 item 1)."""
from __future__ import annotations

import math

import pytest
import torch

from nanogpt.device import autocast_context, resolve_dtype, set_tf32
from nanogpt.distributed import Dist
from cuda_helpers import capability, has_bf16, relative_error, requires_bf16, requires_cuda
from helpers import steps_with_loss_scales, tiny_config
from model import GPT, GPTConfig
from train import train

pytestmark = requires_cuda


def _matmul_error() -> float:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    return relative_error(a.cuda() @ b.cuda(), a.double() @ b.double())


def test_tf32_setting_is_applied_and_read_back() -> None:
    set_tf32(False)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cuda.matmul.allow_tf32
    exact = _matmul_error()
    assert exact < 1e-5  # float32 rounding only
    set_tf32(True)
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    if capability()[0] >= 8:  # Ampere+: the inputs are rounded to 10-bit mantissas (~5e-4 relative)
        assert 1e-4 < _matmul_error() < 5e-3
    set_tf32(False)
    assert _matmul_error() == pytest.approx(exact, rel=1e-3)


def test_train_applies_its_tf32_key(char_data, tmp_path) -> None:
    data_dir, _ = char_data
    for tf32, precision in ((True, "high"), (False, "highest")):
        train(tiny_config(data_dir, tmp_path / f"tf32{tf32}", device="cuda", tf32=tf32, max_iters=2))
        assert torch.get_float32_matmul_precision() == precision


@requires_bf16
def test_bf16_autocast_run_tracks_float32(char_data, tmp_path) -> None:
    data_dir, _ = char_data
    runs = {dtype: train(tiny_config(data_dir, tmp_path / dtype, device="cuda", dtype=dtype, tf32=False,
                                     max_iters=30, eval_interval=30, learning_rate=1e-2))
            for dtype in ("float32", "bfloat16")}
    assert runs["bfloat16"]["val_loss"] == pytest.approx(runs["float32"]["val_loss"], abs=0.05)
    assert runs["bfloat16"]["val_loss"] != runs["float32"]["val_loss"]  # autocast really ran in bf16
    assert resolve_dtype("auto", "cuda") == ("bfloat16" if has_bf16() else "float16")


def _fp16_steps(loss_scales: list[float]):
    """float16 train_steps of one tiny CUDA model, optimizer and scaler; the i-th loss multiplied by loss_scales[i].
    Returns [(loss, norm, applied, weights unchanged)] and the scaler."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=64)).cuda()
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda", verbose=False)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    steps = steps_with_loss_scales(model, opt, scaler, x, autocast_context("cuda", "float16"), Dist(device="cuda"),
                                   loss_scales)
    return steps, scaler


def test_fp16_overflow_is_skipped_and_the_scale_halves() -> None:
    # 1e5 x the loss: its float16 gradients overflow (65504 is float16's largest value) at a scale of 2^16
    steps, scaler = _fp16_steps([1.0, 1e5, 1.0])
    (l0, _, a0, u0), (l1, n1, a1, u1), (l2, _, a2, u2) = steps
    assert a0 and not u0  # a normal step trains
    assert math.isfinite(l1) and not math.isfinite(n1) and not a1 and u1  # the overflow: skipped, weights kept
    assert a2 and not u2
    assert scaler.get_scale() == 2.0**15  # halved once, not grown (growth needs 2000 good steps)


def test_fp16_nan_step_skipped_then_training_goes_on() -> None:
    steps, scaler = _fp16_steps([float("nan"), 1.0, 1.0])
    assert [applied for _, _, applied, _ in steps] == [False, True, True]
    assert steps[0][3] and not steps[1][3]


def test_fp16_train_run_skips_an_injected_nan_and_finishes(char_data, tmp_path, monkeypatch) -> None:
    data_dir, _ = char_data
    forward, calls = GPT.forward, {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        logits, loss = forward(self, idx, targets, **kw)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 4:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    result = train(tiny_config(data_dir, tmp_path / "fp16", device="cuda", dtype="float16", max_iters=10,
                               max_nonfinite_skips=1))
    assert result["iter_num"] == 10 and math.isfinite(result["val_loss"])
