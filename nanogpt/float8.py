"""float8 training (fp8=True): the blocks' linear layers matmul in float8 through torchao's Float8Linear (dynamic
"tensorwise" or "rowwise" scaling) inside bf16 autocast; weights and optimizer state stay float32. Needs an NVIDIA GPU
of compute capability 8.9+ (refused in one line elsewhere). The head stays bf16: it is tied to the embedding, and its
logits feed the loss. fp8_layers="auto" converts only layers at least MIN_FEATURES[recipe] on both sides, where
benchmarks/float8_layers.py found float8 faster on an H100 (docs/gpu.md); "all": every one whose sizes are multiples
of 16, as the kernels need.
"""
from __future__ import annotations

import importlib.util

import torch.nn as nn

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_LAYERS = ("auto", "all")
MIN_CAPABILITY = (8, 9)
# (in_features, out_features) from which a layer trains faster in float8 (None: no shape of GPT-2's, up to XL, did)
MIN_FEATURES: dict[str, tuple[int, int] | None] = {"tensorwise": (1600, 1024), "rowwise": None}


def torchao_installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def pays_in_float8(in_features: int, out_features: int, recipe: str) -> bool:
    """Whether a linear layer of this shape trains faster in float8 than in bf16 (MIN_FEATURES)."""
    least = MIN_FEATURES[recipe]
    return least is not None and in_features >= least[0] and out_features >= least[1]


def converted_layer(module: nn.Module, name: str, recipe: str, layers: str) -> bool:
    """Whether a module trains in float8: a block's linear layer the kernels take, and under "auto" one that pays."""
    if not (isinstance(module, nn.Linear) and name.startswith("transformer.h.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0):
        return False
    return layers == "all" or pays_in_float8(module.in_features, module.out_features, recipe)


def fp8_layer_names(model: nn.Module, recipe: str, layers: str) -> list[str]:
    return [name for name, module in model.named_modules() if converted_layer(module, name, recipe, layers)]


def convert_to_fp8(model: nn.Module, recipe: str, layers: str = "auto") -> int:
    """Swap the chosen layers for Float8Linear in place (parameter names kept: checkpoints too); returns how many."""
    names = fp8_layer_names(model, recipe, layers)
    if names:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda m, name: converted_layer(m, name, recipe, layers))
    return len(names)


def describe(model: nn.Module, recipe: str, layers: str) -> str:
    """One line for the log: which layers train in float8, and why the others do not."""
    names = fp8_layer_names(model, recipe, layers)
    kinds = sorted({n.split(".", 3)[-1] for n in names})
    if not names:
        return (f"fp8: no layer trains in float8 ({recipe} scaling, fp8_layers={layers}): none of this model's block "
                f"layers is large enough for float8 to pay (fp8_layers=all converts them anyway)")
    return (f"fp8: {len(names)} block linear layers train in float8 ({recipe} scaling, fp8_layers={layers}: "
            f"{', '.join(kinds)}), the rest and the head in bf16")
