"""The GPU speed keys on a GPU: compile_mode against eager, float8 training against bf16 (200 steps of the baby GPT's
shape), and the refusal on a GPU without float8 matmuls."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from nanogpt.errors import UserError
from cuda_helpers import capability, requires_cuda
from helpers import tiny_config
from train import train

pytestmark = requires_cuda
FP8_CAPABLE = capability() >= (8, 9)
requires_fp8 = pytest.mark.skipif(not FP8_CAPABLE or importlib.util.find_spec("torchao") is None,
                                  reason="float8 needs compute capability 8.9+ and torchao (pip install torchao)")
# 200 steps of a 6 x 384 model, block 256: float8's rounding moves the val loss by a few hundredths at most
FP8_VAL_TOL = 0.05
BABY = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=32, max_iters=200, lr_decay_iters=200,
            eval_interval=200, eval_iters=20, warmup_iters=20, learning_rate=1e-3, min_lr=1e-4, dropout=0.0,
            device="cuda", dtype="bfloat16")


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_compile_modes_train_as_eager_does(char_data, tmp_path, mode):
    run = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, max_iters=10, eval_interval=10, dropout=0.0,
               device="cuda", dtype="bfloat16")
    data_dir, _ = char_data
    eager = train(tiny_config(data_dir, tmp_path / "eager", **run, compile=False))
    compiled = train(tiny_config(data_dir, tmp_path / mode, **run, compile=True, compile_mode=mode))
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=2e-2)  # bf16 autocast: kernels differ


@requires_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_trains_the_baby_gpt_within_its_tolerance_of_bf16(char_data, tmp_path, recipe):
    data_dir, _ = char_data
    bf16 = train(tiny_config(data_dir, tmp_path / "bf16", **BABY, compile=True))
    fp8 = train(tiny_config(data_dir, tmp_path / "fp8", **BABY, compile=True, fp8=True, fp8_recipe=recipe,
                            fp8_layers="all"))  # at width 384 "auto" converts none
    print(f"val loss after 200 steps: bf16 {bf16['val_loss']:.4f}, fp8 ({recipe}) {fp8['val_loss']:.4f}")
    assert fp8["val_loss"] == pytest.approx(bf16["val_loss"], abs=FP8_VAL_TOL)
    assert fp8["val_loss"] < train(tiny_config(data_dir, tmp_path / "init", **{**BABY, "max_iters": 0}))["val_loss"]


@pytest.mark.skipif(FP8_CAPABLE, reason="this GPU has float8 matmuls: nothing to refuse")
def test_fp8_is_refused_on_a_gpu_without_float8_matmuls(char_data, tmp_path):
    with pytest.raises(UserError, match=r"fp8=True needs compute capability 8.9 or later .* has \d\.\d: set fp8=False"):
        train(tiny_config(char_data[0], tmp_path / "out", device="cuda", dtype="bfloat16", fp8=True))
