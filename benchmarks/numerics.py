"""
How exact each attention path and dtype is: the relative error of one attention module's output and of the
model's loss against a float64 copy of the same weights, with math attention (the formula itself, no kernel).

$ python benchmarks/numerics.py                        # bench.py's config (on the CPU: config/bench_cpu.py)
$ python benchmarks/numerics.py --batch_size=2 --block_size=128

Prints a Markdown table and writes results_dir/numerics.json.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench  # noqa: E402
from nanogpt.measure import write_json
from benchmarks import markdown_table  # noqa: E402
from nanogpt.device import autocast_context, resolve_device  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from model import GPT  # noqa: E402
from nanogpt.step import batch_generator  # noqa: E402

PATHS = {  # the model's own loss is the one fused_loss chose (its head_loss) but where it says "plain loss"
    "math": dict(attention="math"),
    "math, plain loss": dict(attention="math"),
    "sdpa/auto": dict(attention="sdpa", sdpa_backend="auto"),
    "sdpa/math": dict(attention="sdpa", sdpa_backend="math"),
    "sdpa/flash": dict(attention="sdpa", sdpa_backend="flash"),
}
DTYPES = ("float32", "bfloat16")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def token_losses(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of every position (B*T,); its mean is the model's loss. Compared position by position, errors
    cannot cancel out in the mean by chance."""
    logits, _ = model(idx)  # (B, T, vocab_size)
    # in the model's precision: under autocast cross_entropy runs in float32, as the model's own loss does
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


def float64_reference(model: GPT) -> GPT:
    """A float64 copy of `model` with math attention, whatever attention the model uses."""
    reference = GPT(dataclasses.replace(model.config, attention="math")).to(next(model.parameters()).device)
    reference.load_state_dict(copy.deepcopy(model.state_dict()))
    return reference.double().eval()


@torch.no_grad()
def numerics_study(cfg: bench.BenchConfig, device: str) -> list[dict]:
    """For each attention path and dtype, the relative errors against the float64 reference, same inputs."""
    base = bench.build_model(cfg, cfg.machine(), dropout=0.0).to(device).eval()
    reference = float64_reference(base)
    gen = torch.Generator().manual_seed(cfg.seed)
    # the input of the first attention module: LayerNorm'd activations, i.e. about unit variance
    x = torch.randn(cfg.batch_size, cfg.block_size, cfg.n_embd, generator=gen).to(device)  # (B, T, C)
    idx, targets = (t.to(device) for t in bench.draw_batch(cfg, batch_generator(cfg.seed, "eval_val", 0, 0), None))
    attn_ref = reference.transformer.h[0].attn(x.double())  # (B, T, C)
    losses_ref = token_losses(reference, idx, targets)  # (B*T,)
    del reference
    rows = []
    for path, changes in PATHS.items():
        model = GPT(dataclasses.replace(base.config, **changes)).to(device).eval()
        model.load_state_dict(base.state_dict())
        model.head_loss = None if path.endswith("plain loss") else base.head_loss
        for dtype in DTYPES:
            row = {"path": path, "dtype": bench.dtype_label(dtype)}
            try:
                with autocast_context(device, dtype):
                    attn = model.transformer.h[0].attn(x)
                    losses = token_losses(model, idx, targets)
                    # the training loss: fused or plain, as configured
                    _, loss = model(idx, targets, return_logits=False)
                row["attention_error"] = relative_error(attn, attn_ref)
                row["token_loss_error"] = relative_error(losses, losses_ref)
                row["loss_error"] = relative_error(loss, losses_ref.mean())
            except UserError as e:  # e.g. flash with float32 on a GPU
                row["reason"] = str(e)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    cfg, _ = bench.load_config(sys.argv[1:] if argv is None else argv, usage=__doc__)
    rows = numerics_study(cfg, resolve_device(cfg.device))
    print(f"numerics: relative error against float64 (same weights, math attention): the output of layer 0's "
          f"attention on random (B={cfg.batch_size}, T={cfg.block_size}, C={cfg.n_embd}) inputs, and the model's "
          f"loss on random tokens, position by position and its mean")
    keys = ("attention_error", "token_loss_error", "loss_error")
    table = [[r["path"], r["dtype"], *((f"{r[k]:.2e}" for k in keys) if "reason" not in r else ("-",) * 3),
              r.get("reason", "")] for r in rows]
    header = ["path", "dtype", "attention output", "loss per position", "mean loss", "note"]
    print(markdown_table(header, table, "llrrrl"))
    path = os.path.join(cfg.results_dir, "numerics.json")
    write_json(path, {"rows": rows})
    print(f"numerics: written to {path}")


if __name__ == "__main__":
    exit_on_user_error(main)
