"""float8.py on a CPU: which layers fp8_layers converts (all: every block matmul whose shape float8 can take, never the head;
auto: only the shapes at or above the measured break-even), and, where torchao is installed, the conversion itself.
Training in float8 needs an H100-class GPU: tests/cuda/test_cuda_speed_keys.py."""
from __future__ import annotations

import importlib.util

import pytest

from nanogpt import float8
from model import GPT, GPTConfig


def test_fp8_layers_all_converts_every_block_matmul_and_keeps_the_head():
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=50))
    expected = [f"transformer.h.{i}.{layer}" for i in range(3)
                for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    for recipe in float8.FP8_RECIPES:
        assert float8.fp8_layer_names(model, recipe, "all") == expected  # lm_head (tied to the embedding) stays bf16
    odd = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=24, block_size=16, vocab_size=50))  # 24: no multiple of 16
    assert not float8.fp8_layer_names(odd, "tensorwise", "all")


def test_fp8_layers_auto_converts_only_the_shapes_at_or_above_the_measured_break_even(monkeypatch):
    monkeypatch.setitem(float8.MIN_FEATURES, "tensorwise", (64, 128))  # a rule small enough for a tiny model
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=50))
    # c_attn 64 -> 192 and c_fc 64 -> 256 reach it; c_proj 64 -> 64 and mlp.c_proj 256 -> 64 do not
    assert float8.fp8_layer_names(model, "tensorwise", "auto") == [
        f"transformer.h.{i}.{layer}" for i in range(2) for layer in ("attn.c_attn", "mlp.c_fc")]
    monkeypatch.setitem(float8.MIN_FEATURES, "rowwise", None)  # pays for no shape
    assert float8.fp8_layer_names(model, "rowwise", "auto") == []
    assert "no layer trains in float8" in float8.describe(model, "rowwise", "auto")
    # the measured rule: GPT-2 124M converts nothing, GPT-2 medium its MLP projection, GPT-2 XL every block layer
    monkeypatch.undo()
    names = {w: float8.fp8_layer_names(GPT(GPTConfig(n_layer=1, n_head=8, n_embd=w, block_size=8, vocab_size=50)),
                                       "tensorwise", "auto") for w in (768, 1024, 1600)}
    assert names == {768: [], 1024: ["transformer.h.0.mlp.c_proj"],
                     1600: [f"transformer.h.0.{n}" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]}


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (pip install "
                    "torchao): the float8 conversion itself is not tried")
def test_fp8_conversion_swaps_the_block_layers_and_keeps_the_parameter_names():
    from torchao.float8.float8_linear import Float8Linear

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50))
    names = list(model.state_dict())
    assert float8.convert_to_fp8(model, "tensorwise", "all") == 8
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 8
    assert not isinstance(model.lm_head, Float8Linear) and list(model.state_dict()) == names
