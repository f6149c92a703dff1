"""
Where float8 pays, layer by layer: each linear layer of a GPT block at GPT-2's widths, timed forward + backward in bf16
autocast and as torchao's Float8Linear with tensorwise and rowwise scaling, each compiled as train.py compiles the
model. float8.py's fp8_layers="auto" converts only the shapes this study found faster in float8.

    python benchmarks/float8_layers.py                              # GPT-2's four widths, 64 x 1024 tokens
    python benchmarks/float8_layers.py --widths=768,1280 --tokens=16384

Needs a CUDA GPU of compute capability 8.9+ and torchao. Each layer is an nn.Linear with float32 master weights and a
bias, fed a bf16 input that needs its gradient; the time is the median of --repeats passes after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from nanogpt import float8  # noqa: E402
from nanogpt.config import fp8_problems  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402


def block_layers(width: int) -> list[tuple[str, int, int]]:
    return [("attn.c_attn", width, 3 * width), ("attn.c_proj", width, width), ("mlp.c_fc", width, 4 * width),
            ("mlp.c_proj", 4 * width, width)]


def time_layer(in_features: int, out_features: int, tokens: int, recipe: str | None, repeats: int) -> float:
    """Median ms of one compiled forward + backward of the layer in bf16 autocast (recipe None) or float8."""
    torch._dynamo.reset()  # each layer compiles afresh (else dynamo's recompile limit sends later ones to eager)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(in_features, out_features)).cuda()  # a parent to convert the child in
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    fn = torch.compile(layer)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x)
        y.backward(grad)

    for _ in range(5):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="768,1024,1280,1600", help="n_embd values, comma-separated")
    p.add_argument("--tokens", type=int, default=64 * 1024, help="rows of each matmul (micro-batch x block_size)")
    p.add_argument("--repeats", type=int, default=30, help="timed passes per layer (the median is reported)")
    p.add_argument("--result_json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",") if w.strip()]
    if not torch.cuda.is_available():
        raise UserError("benchmarks/float8_layers.py times float8 matmuls on a CUDA GPU and none is available here")
    problems = fp8_problems("cuda", "bfloat16")
    if problems:
        raise UserError("; ".join(problems))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; {args.tokens:,} tokens per matmul; "
          f"forward + backward, compiled, median of {args.repeats}", flush=True)
    rows = []
    header = f"{'width':>5} {'layer':<12} {'K x N':>11} {'bf16 ms':>8} {'tensorwise':>16} {'rowwise':>16}  auto"
    print(header, flush=True)
    for width in widths:
        for name, k, n in block_layers(width):
            bf16 = time_layer(k, n, args.tokens, None, args.repeats)
            row = {"width": width, "layer": name, "in_features": k, "out_features": n, "bf16_ms": bf16}
            cells = []
            for recipe in float8.FP8_RECIPES:
                ms = time_layer(k, n, args.tokens, recipe, args.repeats)
                row[f"{recipe}_ms"], row[f"{recipe}_speedup"] = ms, bf16 / ms
                cells.append(f"{ms:7.3f} ({bf16 / ms:4.2f}x)")
            row["auto"] = {r: float8.pays_in_float8(k, n, r) for r in float8.FP8_RECIPES}
            auto = ",".join(r for r, yes in row["auto"].items() if yes) or "-"
            rows.append(row)
            print(f"{width:>5} {name:<12} {f'{k}x{n}':>11} {bf16:8.3f} {cells[0]:>16} {cells[1]:>16}  {auto}",
                  flush=True)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "tokens": args.tokens,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    exit_on_user_error(main)
