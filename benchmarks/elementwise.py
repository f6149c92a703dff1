"""
The step's memory-bound kernels alone, forward + backward, compiled as in training: LayerNorm (the float32 residual in,
bf16 out for the next matmul) and GELU (the MLP's bf16 hidden layer), at GPT-2 124M's widths for a 64 x 1024
micro-batch. Each row: the least bytes the kernel must move, the time, the bandwidth that makes and its share of the
GPU's (the datasheet table below, or --peak_bandwidth): near 100% only fusing it into a neighbour can win more.

    python benchmarks/elementwise.py                                 # on the GPU
    python benchmarks/elementwise.py --tokens=2048 --device=cpu --repeats=3

--result_json writes the rows; docs/gpu.md has them measured on an H100.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import markdown_table, median_ms  # noqa: E402
from nanogpt.device import resolve_device  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from nanogpt.measure import write_json  # noqa: E402

# Peak memory bandwidth (bytes/s) by the name CUDA reports, from NVIDIA's datasheets; the longest match wins
PEAK_BANDWIDTH = {"H100": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H200": 4.8e12, "B200": 8.0e12,
                  "A100": 2.039e12, "A100-SXM4-40GB": 1.555e12, "A100-PCIE-40GB": 1.555e12, "L4": 0.3e12,
                  "L40S": 0.864e12}


def peak_bandwidth(device_name: str) -> float | None:
    matches = [name for name in PEAK_BANDWIDTH if name in device_name]
    return PEAK_BANDWIDTH[max(matches, key=len)] if matches else None


def layer_norm(width: int, tokens: int, device: str):
    """LayerNorm as the blocks run it: (function, inputs, the least bytes forward + backward move)."""
    x = torch.randn(tokens, width, device=device)  # the residual stream: float32
    w, b = torch.ones(width, device=device), torch.zeros(width, device=device)

    def f(x, w, b):
        return F.layer_norm(x, (width,), w, b).to(torch.bfloat16)  # the next matmul's bf16 input

    # forward: x read (4 B), y written (2 B); backward: dy (2 B) and x (4 B) read, dx written (4 B)
    return f, (x, w, b), tokens * width * (4 + 2 + 2 + 4 + 4)


def gelu(width: int, tokens: int, device: str):
    """GELU (tanh form: GPT-2's) on the MLP's hidden layer, bf16 as the matmul wrote it."""
    h = torch.randn(tokens, 4 * width, device=device).to(torch.bfloat16)

    def f(h):
        return F.gelu(h, approximate="tanh")

    # forward: h read, y written; backward: dy and h read, dh written: 2 B each
    return f, (h,), tokens * 4 * width * 2 * 5


KERNELS = {"layernorm": layer_norm, "gelu": gelu}


def measure(name: str, width: int, tokens: int, device: str, repeats: int, peak: float | None) -> dict:
    fn, args, least_bytes = KERNELS[name](width, tokens, device)
    compiled = torch.compile(fn)
    # made once out here: filled in each step, it would be a write least_bytes does not count
    dy = torch.ones_like(fn(*args))

    def step():
        leaves = [a.detach().requires_grad_() for a in args]
        y = compiled(*leaves)
        y.backward(dy)

    step()  # compile
    ms = median_ms(step, repeats, device)
    bandwidth = least_bytes / (ms / 1000)
    return {"kernel": name, "tokens": tokens, "width": width, "ms": ms, "least_bytes": least_bytes,
            "bandwidth": bandwidth, "peak_share": bandwidth / peak if peak else None}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64 * 1024, help="rows: micro-batch x block_size")
    p.add_argument("--width", type=int, default=768, help="n_embd (GELU's layer is 4 x wider)")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N, cpu")
    p.add_argument("--repeats", type=int, default=20, help="timed passes per row (the median is reported)")
    p.add_argument("--peak_bandwidth", type=float, default=None, help="the GPU's bytes/s (default: the table's)")
    p.add_argument("--result_json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    if min(args.tokens, args.width, args.repeats) < 1:
        raise UserError(f"--tokens={args.tokens}, --width={args.width} and --repeats={args.repeats} must be positive")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    peak = args.peak_bandwidth or (peak_bandwidth(name) if device.startswith("cuda") else None)
    t0 = time.perf_counter()
    rows = [measure(kernel, args.width, args.tokens, device, args.repeats, peak) for kernel in KERNELS]
    print(f"forward + backward, compiled, on {name} (torch {torch.__version__}); {time.perf_counter() - t0:.0f} s")
    print(markdown_table(["kernel", "tokens x width", "ms", "least MB moved", "GB/s", "of peak"],
                         [[r["kernel"], f"{r['tokens']:,} x {r['width']}", f"{r['ms']:.3f}",
                           f"{r['least_bytes'] / 1e6:,.0f}", f"{r['bandwidth'] / 1e9:,.0f}",
                           "-" if r["peak_share"] is None else f"{r['peak_share']:.0%}"] for r in rows], "llrrrr"))
    if args.result_json:
        write_json(args.result_json, {"device": name, "torch": torch.__version__, "rows": rows})
    return rows


if __name__ == "__main__":
    exit_on_user_error(main)
