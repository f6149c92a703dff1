"""
Attention alone, every kernel at hand, forward and backward: causal self-attention at GPT-2 124M's shape (12 heads of
64) for a 64 x 1024 micro-batch (the FineWeb recipe's) and a 12 x 1024 one (nanoGPT's bench), bf16 on a GPU.

    python benchmarks/attention.py                                  # on the GPU: both shapes, every kernel
    python benchmarks/attention.py --shapes=2x64 --heads=2 --head_size=16 --dtype=float32 --device=cpu

Kernels: SDPA's flash, cuDNN, memory-efficient and math backends (each forced), SDPA's `auto` (and which kernel it
picks), flex_attention compiled with a causal block mask, and FlashAttention-4 through PyTorch's flash hook for its
row alone (the flash-attn-4 package: Hopper and Blackwell). A kernel that cannot run here is a row with its reason.
Per kernel and shape: ms of the forward and of forward + backward (median of --repeats), TFLOP/s (the backward counted
as 2.5 forwards, FlashAttention's convention) and the share of the GPU's dense bf16 peak, and the relative error of
the output and of dq, dk, dv against float64 math. --result_json writes the rows; docs/gpu.md has them for an H100.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack, nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks import markdown_table, median_ms  # noqa: E402
from nanogpt.device import DTYPES, resolve_device  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from nanogpt.hardware import flash_impl, flash_impl_problem  # noqa: E402
from nanogpt.measure import write_json  # noqa: E402
from nanogpt.mfu import device_peak_flops  # noqa: E402

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
KERNELS = ("flash", "cudnn", "efficient", "math", "auto", "flex", "fa4")


def attention_fn(kernel: str, device: str):
    """f(q, k, v) -> causal attention with `kernel`; a UserError where it cannot run here."""
    if kernel in SDPA or kernel == "auto":
        if kernel in ("cudnn", "efficient") and not device.startswith("cuda"):
            raise UserError(f"{kernel}: PyTorch has this kernel for CUDA only")
        ctx = (lambda: sdpa_kernel(SDPA[kernel])) if kernel in SDPA else nullcontext

        def sdpa(q, k, v):
            with ctx():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sdpa
    if kernel == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled, masks = torch.compile(flex_attention), {}

        def flex(q, k, v):
            T = q.size(-2)
            if T not in masks:
                masks[T] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=q.device)
            return compiled(q, k, v, block_mask=masks[T])
        return flex
    if kernel == "fa4":  # SDPA's flash kernel, FlashAttention-4's while measure's row puts it there
        if (why := flash_impl_problem("fa4", device)) is not None:
            raise UserError(why)
        if not hasattr(torch.nn.attention, "restore_flash_attention_impl"):
            raise UserError(f"fa4: torch {torch.__version__} cannot take FlashAttention-4 back after its row (no "
                            f"torch.nn.attention.restore_flash_attention_impl), so the rows after it would measure it")
        return attention_fn("flash", device)
    raise UserError(f"unknown kernel {kernel!r} (of: {', '.join(KERNELS)})")


def inputs(B: int, H: int, T: int, D: int, dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).to(device=device, dtype=dtype) for _ in range(3)]  # q, k, v


def reference(q, k, v):
    """float64 math attention and its gradients under the fixed upstream gradient."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / q.size(-1) ** 0.5  # (B, H, T, T)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    y = scores.softmax(-1) @ v  # (B, H, T, D)
    y.backward(upstream(y))
    return y.detach(), [t.grad for t in (q, k, v)]


def upstream(y: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(y) / y.numel() ** 0.5


def run_once(fn, q, k, v, backward: bool):
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    y = fn(q, k, v)
    if backward:
        y.backward(upstream(y))
    return y, [t.grad for t in (q, k, v)]


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def auto_choice(q, k, v) -> str:
    """The kernel SDPA's `auto` picks for these inputs, by name."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return "?"
    index = choose(q, k, v, None, 0.0, True)
    return {int(b): n for n, b in SDPA.items()}.get(int(index), str(index))


def measure(kernel: str, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str, repeats: int,
            peak: float | None) -> dict:
    B, H, T, D = shape
    row = {"kernel": kernel, "shape": f"{B}x{H}x{T}x{D}"}
    q, k, v = inputs(B, H, T, D, dtype, device)
    with ExitStack() as row_scope:  # what the row changes in the process, undone when it ends, failed or not
        try:
            fn = attention_fn(kernel, device)
            if kernel == "fa4":  # it holds for the whole process: taken back after this row, for the rows after it
                row_scope.enter_context(flash_impl("fa4"))
            y, grads = run_once(fn, q, k, v, backward=True)  # also the warm-up: compile, kernels' autotuning
        except UserError as e:
            return {**row, "status": "n/a", "reason": str(e)}
        except RuntimeError as e:  # the forced kernel refuses this case: PyTorch's reasons
            return {**row, "status": "n/a", "reason": str(e).strip().splitlines()[0][:200]}
        forward_ms = median_ms(lambda: run_once(fn, q, k, v, False), repeats, device)
        total_ms = median_ms(lambda: run_once(fn, q, k, v, True), repeats, device)
    y_ref, grads_ref = reference(q, k, v)
    errors = {"out": relative_error(y, y_ref), **{f"d{n}": relative_error(g, r) for n, g, r in
                                                  zip("qkv", grads, grads_ref)}}
    fwd = 4 * B * H * T * T * D / 2  # the forward: q k^T and p v, 2*B*H*T*T*D FLOPs each, half masked away
    row.update(status="ok", forward_ms=forward_ms, total_ms=total_ms, errors=errors,
               forward_tflops=fwd / forward_ms / 1e9,
               backward_tflops=2.5 * fwd / max(total_ms - forward_ms, 1e-9) / 1e9,
               total_tflops=3.5 * fwd / total_ms / 1e9)
    row["peak_share"] = row["total_tflops"] * 1e12 / peak if peak else None
    if kernel == "auto":
        row["picks"] = auto_choice(q, k, v)
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="64x1024,12x1024", help="batch x tokens, comma-separated")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head_size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N, cpu")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of: {', '.join(KERNELS)}")
    p.add_argument("--repeats", type=int, default=20, help="timed passes per row (the median is reported)")
    p.add_argument("--peak_flops", type=float, default=None, help="the GPU's dense bf16 peak (default: mfu.py's)")
    p.add_argument("--result_json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        args.shapes = [tuple(int(n) for n in s.lower().split("x")) for s in args.shapes.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--shapes={args.shapes!r}: give batch x tokens, comma-separated, e.g. "
                        "64x1024,12x1024") from None
    args.kernels = [s.strip() for s in args.kernels.split(",") if s.strip()]
    problems = [f"unknown kernel {k!r}" for k in args.kernels if k not in KERNELS]
    if not args.shapes or any(len(s) != 2 or min(s) < 1 for s in args.shapes):
        problems.append(f"--shapes={args.shapes} must be positive pairs batch x tokens")
    if min(args.heads, args.head_size, args.repeats) < 1:
        problems.append("--heads, --head_size and --repeats must be at least 1")
    if problems:
        raise UserError("; ".join(problems) + f" (kernels: {', '.join(KERNELS)})")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    peak = args.peak_flops or (device_peak_flops(device) if device.startswith("cuda") else None)
    t0, rows = time.perf_counter(), []
    for B, T in args.shapes:
        for kernel in args.kernels:
            print(f"{kernel}, {B} x {args.heads} x {T} x {args.head_size} ...", flush=True)
            rows.append(measure(kernel, (B, args.heads, T, args.head_size), dtype, device, args.repeats, peak))
    table = [[r["kernel"] + (f" ({r['picks']})" if r.get("picks") else ""), r["shape"],
              *((f"{r['forward_ms']:.3f}", f"{r['total_ms']:.3f}", f"{r['forward_tflops']:.3g}",
                 f"{r['backward_tflops']:.3g}", "-" if r["peak_share"] is None else f"{r['peak_share']:.0%}",
                 f"{max(r['errors'].values()):.1e}") if r["status"] == "ok" else ("-",) * 5 + (r["reason"],))]
             for r in rows]
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    print(f"\ncausal attention, {args.dtype}, on {name} (torch {torch.__version__}); {time.perf_counter() - t0:.0f} s")
    print(markdown_table(["kernel", "B x H x T x D", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "bwd TFLOP/s",
                          "of peak", "max rel err"], table, "llrrrrrl"))
    if args.result_json:
        write_json(args.result_json, {"device": name, "torch": torch.__version__, "dtype": args.dtype, "rows": rows})
    return rows


if __name__ == "__main__":
    exit_on_user_error(main)
