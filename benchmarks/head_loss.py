"""
The language-model head's loss alone, forward + backward, in each implementation at hand: the plain loss (logits, then
cross-entropy, compiled as train.py compiles the model), this project's fused_loss.py (chunk by chunk), llm.c's fused
classifier (the gradient written over the logits in the forward), and, where installed, quack-kernels' cross-entropy,
liger-kernel's and cut-cross-entropy's fused linear + cross-entropy. GPT-2's head (768 x 50304) on the tokens of a
12 x 1024 and a 64 x 1024 micro-batch, bf16 autocast, float32 master weights as in training.

    python benchmarks/head_loss.py                         # on the GPU: both token counts
    python benchmarks/head_loss.py --tokens=12288 --repeats=5 --device=cpu

Per row: ms per forward + backward (median of --repeats), the peak memory above the inputs, the relative error of the
loss and both gradients against the plain loss in float32 (bf16 makes ~1e-3 to 1e-2), and whether it waits for the
host (a synchronizing CUDA call, caught by set_sync_debug_mode). A missing package is a row that names its pip command.
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
from nanogpt.fused_loss import fused_linear_cross_entropy  # noqa: E402
from nanogpt.measure import write_json  # noqa: E402
from nanogpt.optional import optional_import  # noqa: E402
from model import cross_entropy_sum  # noqa: E402

N_EMBD, VOCAB, PADDED = 768, 50257, 50304


def plain(x, w, t):
    return cross_entropy_sum(F.linear(x, w), t, VOCAB)


def ours(x, w, t):
    return fused_linear_cross_entropy(x, w, t, VOCAB)


def liger(x, w, t):
    optional_import("liger_kernel", "the liger-kernel row")
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-1, reduction="sum")
    return loss(w[:VOCAB].to(torch.bfloat16), x.to(torch.bfloat16), t)  # its (weight, input, target) order


def cut_cross_entropy(x, w, t):
    cce = optional_import("cut_cross_entropy", "the cut-cross-entropy row")
    # filter_eps=None: every gradient entry computed (its default skips the small ones: not the same gradient)
    return cce.linear_cross_entropy(x.to(torch.bfloat16), w[:VOCAB].to(torch.bfloat16), t, ignore_index=-1,
                                    reduction="sum", filter_eps=None)


class GradientInForward(torch.autograd.Function):
    """llm.c's fused classifier: the forward computes the loss and the logits' gradient (softmax - one-hot) in one
    float32 (tokens x vocab) buffer in place and writes it over the logits, so the backward does not read the logits
    again; only the logits and that one copy are ever held."""

    @staticmethod
    def forward(ctx, x, w, t):
        logits = F.linear(x, w)  # (N, Vp), in autocast's dtype
        logits[:, VOCAB:] = float("-inf")  # the padded rows are no tokens
        keep, target = t != -1, t.clamp(min=0)
        z = logits.float()  # (N, Vp) float32: the one copy; every step below is in place (a no-op copy in float32)
        picked = z.gather(1, target[:, None]).squeeze(1)  # (N,), before z is overwritten
        # softmax by hand, not torch.logsumexp and then exp: logsumexp allocates an (N, Vp) temporary of its own
        m = z.amax(dim=-1, keepdim=True)  # (N, 1)
        z.sub_(m).exp_()
        s = z.sum(dim=-1, keepdim=True)  # (N, 1)
        z.div_(s)  # softmax
        lse = (m + s.log()).squeeze(1)  # (N,)
        loss = ((lse - picked) * keep).sum()
        z[torch.arange(t.numel(), device=t.device), target] -= 1.0
        z *= keep[:, None]
        logits.copy_(z)  # the gradient over the logits: the one (N, Vp) buffer kept for the backward
        ctx.save_for_backward(x, w, logits)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, w, dlogits = ctx.saved_tensors
        dlogits = dlogits * grad_loss.to(dlogits.dtype)
        return (dlogits @ w.to(dlogits.dtype)).to(x.dtype), (dlogits.t() @ x.to(dlogits.dtype)).to(w.dtype), None


gradient_in_forward = GradientInForward.apply


def quack(x, w, t):
    """quack-kernels' cross-entropy (CuTe DSL) over the plain logits, its backward written over them."""
    if not x.is_cuda:
        raise UserError("quack-kernels: its kernels run on NVIDIA GPUs only")
    optional_import("quack", "the quack-kernels row")
    from quack.cross_entropy import cross_entropy

    logits = F.linear(x, w)
    logits[:, VOCAB:] = float("-inf")
    return cross_entropy(logits, t, ignore_index=-1, reduction="sum", inplace_backward=True)


IMPLEMENTATIONS = {"plain (compiled)": plain, "fused_loss.py": ours, "gradient in forward": gradient_in_forward,
                   "quack-kernels": quack, "liger-kernel": liger, "cut-cross-entropy": cut_cross_entropy}


def inputs(tokens: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's input (tokens, n_embd), its float32 weight (padded rows zero, as never-seen tokens'), and targets
    with a few ignored (-1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, N_EMBD, generator=g)
    w = torch.randn(PADDED, N_EMBD, generator=g) * 0.02
    w[VOCAB:] = 0
    t = torch.randint(0, VOCAB, (tokens,), generator=g)
    t[::97] = -1
    return x.to(device), w.to(device), t.to(device)


def loss_and_grads(fn, x, w, t, autocast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        loss = fn(x, w, t)
    loss.backward()
    return loss.detach().float(), x.grad, w.grad


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def waits_for_host(fn, x, w, t) -> bool | None:
    if not x.is_cuda:
        return None
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_and_grads(fn, x, w, t, autocast=True)
        return False
    except RuntimeError as e:
        if "synchronizing" not in str(e):
            raise
        return True
    finally:
        torch.cuda.set_sync_debug_mode(0)


def measure(name: str, fn, tokens: int, device: str, repeats: int) -> dict:
    x, w, t = inputs(tokens, device)
    try:
        got = loss_and_grads(fn, x, w, t, autocast=True)  # also the warm-up: compile, kernels' autotuning
    except UserError as e:
        return {"name": name, "tokens": tokens, "status": "n/a", "reason": str(e)}
    ref = loss_and_grads(plain, x, w, t, autocast=False)  # float32, eager
    errors = {k: relative_error(a, b) for k, a, b in zip(("loss", "grad_x"), got, ref)}
    errors["grad_w"] = relative_error(got[2][:VOCAB], ref[2][:VOCAB])  # the padded rows: no gradient either way
    padded_grad = got[2][VOCAB:].abs().max().item() if got[2].size(0) > VOCAB else 0.0
    cuda = device.startswith("cuda")
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(lambda: loss_and_grads(fn, x, w, t, autocast=True), repeats, device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda else None
    return {"name": name, "tokens": tokens, "status": "ok", "ms": ms, "peak_mib": peak, "errors": errors,
            "padded_rows_grad": padded_grad, "waits_for_host": waits_for_host(fn, x, w, t)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="12288,65536", help="token counts, comma-separated (12 x 1024, 64 x 1024)")
    p.add_argument("--repeats", type=int, default=20, help="timed forward + backward passes per row")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N, cpu")
    p.add_argument("--only", default="", help="comma-separated implementation names to run (default: all)")
    p.add_argument("--result_json", default="", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(s) for s in args.tokens.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"--tokens={args.tokens!r} must be comma-separated integers, e.g. 12288,65536") from None
    if not args.tokens or min(args.tokens) < 1 or args.repeats < 1:
        raise UserError(f"--tokens={args.tokens} and --repeats={args.repeats} must be positive")
    names = [s.strip() for s in args.only.split(",") if s.strip()] or list(IMPLEMENTATIONS)
    unknown = [n for n in names if n not in IMPLEMENTATIONS]
    if unknown:
        raise UserError(f"--only: unknown {', '.join(map(repr, unknown))} (of: {', '.join(IMPLEMENTATIONS)})")
    args.only = names
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    t0 = time.perf_counter()
    fns = {name: IMPLEMENTATIONS[name] for name in args.only}
    if "plain (compiled)" in fns:
        fns["plain (compiled)"] = torch.compile(plain)
    rows = []
    for tokens in args.tokens:
        for name, fn in fns.items():
            print(f"{name}, {tokens:,} tokens ...", flush=True)
            rows.append(measure(name, fn, tokens, device, args.repeats))
    table = [[r["name"], f"{r['tokens']:,}",
              *((f"{r['ms']:.2f}", "-" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}",
                 f"{r['errors']['loss']:.1e}", f"{r['errors']['grad_x']:.1e}", f"{r['errors']['grad_w']:.1e}",
                 {None: "-", True: "yes", False: "no"}[r["waits_for_host"]])
                if r["status"] == "ok" else ("-",) * 5 + (r["reason"],))] for r in rows]
    print(f"\nthe head's loss, forward + backward, bf16 autocast, on {device} (torch {torch.__version__}); "
          f"{time.perf_counter() - t0:.0f} s")
    print(markdown_table(["loss", "tokens", "ms", "peak MiB", "loss err", "grad x err", "grad w err", "waits for host"],
                         table, "llrrrrrl"))
    if args.result_json:
        write_json(args.result_json, {"device": device, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    exit_on_user_error(main)
