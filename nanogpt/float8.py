"""
float8 training (fp8=True): the transformer blocks' linear layers run their matmuls in float8 through torchao's
Float8Linear (dynamic scaling, "tensorwise" or "rowwise": torchao.float8.convert_to_float8_training), inside the
usual bf16 autocast; the weights, gradients and optimizer state stay as they were (float32 master weights).
float8 matmuls need an NVIDIA GPU of compute capability 8.9 or later (H100, H200, L4, RTX 40xx); anywhere else
fp8=True is refused in one line, before any slow work.

The head stays in bf16: it is tied to the token embedding (a Float8Linear would cast the shared weight every step)
and its logits feed the loss directly. A float8 matmul saves time only where the matmul outweighs the casts and
scales it adds: with fp8_layers="auto" (the default) a block's linear layer is converted only where its shape is
at least MIN_FEATURES[recipe] on both sides (benchmarks/float8_layers.py times each layer both ways: the rule is
what it found on an H100, docs/gpu.md); fp8_layers="all" converts every block linear layer whose sizes are
multiples of 16, which the float8 kernels need.
"""
from __future__ import annotations

import importlib.util

import torch.nn as nn

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_LAYERS = ("auto", "all")
MIN_CAPABILITY = (8, 9)
# (in_features, out_features) from which a layer trains faster in float8 than in bf16, per recipe (None: no shape
# of GPT-2's sizes, up to XL, did); benchmarks/float8_layers.py measures it, docs/gpu.md has the table
MIN_FEATURES: dict[str, tuple[int, int] | None] = {"tensorwise": (1600, 1024), "rowwise": None}


def torchao_installed() -> bool:
    """Whether torchao, which fp8=True trains through, can be imported."""
    return importlib.util.find_spec("torchao") is not None


def pays_in_float8(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether a linear layer of this shape trains faster in float8 than in bf16 (MIN_FEATURES)."""
    if MIN_FEATURES[recipe] is None:
        return False
    min_in, min_out = MIN_FEATURES[recipe]
    return in_features >= min_in and out_features >= min_out


def converted_layer(module: nn.Module, name: str, recipe: str, layers: str) -> bool:
    """Which layers train in float8: the blocks' linear layers whose sizes the float8 kernels take, and with
    layers="auto" only those whose shape pays."""
    if not (isinstance(module, nn.Linear) and name.startswith("transformer.h.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0):
        return False
    return layers == "all" or pays_in_float8(module.in_features, module.out_features, recipe)


def fp8_layer_names(model: nn.Module, recipe: str, layers: str) -> list[str]:
    """The names of the linear layers convert_to_fp8 converts."""
    return [name for name, module in model.named_modules() if converted_layer(module, name, recipe, layers)]


def convert_to_fp8(model: nn.Module, recipe: str, layers: str = "auto") -> int:
    """Swap the chosen block linear layers for torchao's Float8Linear with `recipe`'s scaling, in place (parameter
    names do not change, so checkpoints stay as they are); returns how many were converted (0: nothing to do)."""
    names = fp8_layer_names(model, recipe, layers)
    if names:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda m, name: converted_layer(m, name, recipe, layers))
    return len(names)


def describe(model: nn.Module, recipe: str, layers: str) -> str:
    """One line for the log: which layers train in float8 and why the others do not."""
    names = fp8_layer_names(model, recipe, layers)
    kinds = sorted({n.split(".", 3)[-1] for n in names})
    if not names:
        return (f"fp8: no layer trains in float8 ({recipe} scaling, fp8_layers={layers}): none of this model's block "
                f"layers is large enough for float8 to pay (fp8_layers=all converts them anyway)")
    return (f"fp8: {len(names)} block linear layers train in float8 ({recipe} scaling, fp8_layers={layers}: "
            f"{', '.join(kinds)}), the rest and the head in bf16")
