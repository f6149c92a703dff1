"""
float8 training (fp8=True): the transformer blocks' linear layers run their matmuls in float8 through torchao's
Float8Linear (dynamic scaling, "tensorwise" or "rowwise": torchao.float8.convert_to_float8_training), inside the
usual bf16 autocast; the weights, gradients and optimizer state stay as they were (float32 master weights).
float8 matmuls need an NVIDIA GPU of compute capability 8.9 or later (H100, H200, L4, RTX 40xx); anywhere else
fp8=True is refused in one line, before any slow work.

The head stays in bf16: it is tied to the token embedding (a Float8Linear would cast the shared weight every step)
and its logits feed the loss directly. Every block matmul is converted (their sizes are multiples of 16, which the
float8 kernels need; a layer that is not is left in bf16).

Imports torch, and torchao where fp8 is on; nothing of the project's scripts.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn

FP8_RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)


def fp8_problems(enabled: bool, recipe: str, device: str, dtype: str) -> list[str]:
    """What stops fp8 training here (train.py's and bench.py's config check): an unknown recipe always; with
    enabled, a device without float8 matmuls, a dtype other than bf16, or no torchao."""
    problems = []
    if recipe not in FP8_RECIPES:
        problems.append(f"fp8_recipe={recipe!r} is not one of {', '.join(FP8_RECIPES)}")
    if not enabled:
        return problems
    if device.split(":")[0] != "cuda":
        problems.append(f"fp8=True needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                        f"or later (H100, H200, L4, RTX 40xx), and device={device!r} is not one: set fp8=False")
    else:
        capability = torch.cuda.get_device_capability(torch.device(device))
        if capability < MIN_CAPABILITY:
            problems.append(
                f"fp8=True needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later (H100, H200, L4, "
                f"RTX 40xx), and {torch.cuda.get_device_name(torch.device(device))} has "
                f"{capability[0]}.{capability[1]}: set fp8=False")
    if dtype != "bfloat16":
        problems.append(f"fp8=True runs everything else in bf16 autocast, but dtype={dtype!r}: set dtype=bfloat16 "
                        f"(or auto)")
    if importlib.util.find_spec("torchao") is None:
        problems.append("fp8=True needs torchao, which is not installed: pip install torchao")
    return problems


def converted_layer(module: nn.Module, name: str) -> bool:
    """Which layers train in float8: the blocks' linear layers whose sizes the float8 kernels take."""
    return (isinstance(module, nn.Linear) and name.startswith("transformer.h.")
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model: nn.Module, recipe: str) -> int:
    """Swap the blocks' linear layers for torchao's Float8Linear with `recipe`'s scaling, in place (parameter names
    do not change, so checkpoints stay as they are); returns how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = [name for name, module in model.named_modules() if converted_layer(module, name)]
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=converted_layer)
    return len(names)
