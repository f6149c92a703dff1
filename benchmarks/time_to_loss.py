"""
Time to a validation loss, side by side: nanoGPT's CPU recipe for the baby GPT vs our CPU config.

    python data/shakespeare_char/prepare.py
    python benchmarks/time_to_loss.py               # the baseline, then ours
    python benchmarks/time_to_loss.py --rounds=2    # alternate them twice (a shared machine's speed drifts)
    python benchmarks/time_to_loss.py --variant=--gelu=tanh --variant=--dtype=float32   # + ours with one change

nanoGPT's README trains the baby GPT on a CPU with
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
      --lr_decay_iters=2000 --dropout=0.0
and gets a val loss of about 1.88. The baseline is that command run with this repo's train.py, set to do what
nanoGPT does on a CPU: float32 (no autocast), SDPA attention, the exact GELU (nn.GELU()), no vocabulary padding,
the for-loop AdamW, glibc's default malloc. Ours is config/train_shakespeare_char_cpu.py as it is.

Every run is train.py in a fresh process with its own out_dir. Its metrics.jsonl gives the val loss of each eval
and the wall time since training started (elapsed_s, which includes the evals). The target is the baseline's final
val loss (or --target); a run's time to it is interpolated linearly between the two evals around it. The speed-up
is the ratio of the two recipes' median times to the target, over the runs that reached it (the table shows every
run). Each --variant is our config with those extra arguments, run in the same rounds, so what each of our choices
buys is measured side by side too.

Exit status: 0; 1 if a train.py run fails (its stderr is shown) or if the baseline or ours never reaches the
target (a variant that never reaches it is reported as such, with status 0).
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanogpt.metrics import read_records  # noqa: E402

NANOGPT_CPU = [  # nanoGPT's README command, then the settings that make this train.py do what nanoGPT's does
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0",
    "--dtype=float32", "--attention=sdpa", "--gelu=erf", "--vocab_padding_multiple=1", "--fused_adamw=False",
    "--keep_freed_memory=False",
]
OURS = ["config/train_shakespeare_char_cpu.py"]
NANOGPT_COMMAND = NANOGPT_CPU[: NANOGPT_CPU.index("--dropout=0.0") + 1]  # the command alone: this repo's defaults
BASELINE, OURS_NAME = "nanoGPT CPU recipe", "ours"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="runs of each recipe, alternating baseline and ours")
    p.add_argument("--target", type=float, default=None, help="val loss to reach (default: the baseline's final)")
    p.add_argument("--args", default="", help="extra train.py arguments for both recipes, e.g. '--data_dir=...'")
    p.add_argument("--ours", choices=("config", "defaults"), default="config",
                   help="config: config/train_shakespeare_char_cpu.py; defaults: nanoGPT's command itself, nothing "
                        "changed, so this repo's defaults (dtype, attention, fused loss and AdamW, malloc) decide")
    p.add_argument("--variant", action="append", default=[],
                   help="also run ours with these extra train.py arguments, e.g. '--gelu=tanh' (repeatable)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} must be at least 1")
    return args


def read_evals(metrics_path: str) -> list[tuple[int, float, float]]:
    """(iteration, elapsed seconds, val loss) of every eval in a run's metrics.jsonl."""
    return [(r["iter"], r["elapsed_s"], r["val_loss"]) for r in read_records(metrics_path) if "val_loss" in r]


def time_to_target(evals: list[tuple[int, float, float]], target: float) -> float | None:
    """The wall time at which the val loss first reaches target, interpolated linearly between the eval before
    (whose loss is above the target) and the eval that reaches it; None if no eval does. A non-finite loss counts
    as not reached and is not interpolated from."""
    previous = None
    for _, t, loss in evals:
        if not math.isfinite(loss):
            previous = None
        elif loss <= target:
            if previous is None:
                return t
            t0, loss0 = previous
            return t0 + (t - t0) * (loss0 - target) / (loss0 - loss)
        else:
            previous = (t, loss)
    return None


def run_recipe(recipe: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="time_to_loss_") as out_dir:
        argv = [sys.executable, "train.py", *recipe, f"--out_dir={out_dir}"]
        start = time.time()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - start
        if proc.returncode != 0:
            sys.exit(f"error: train.py failed (exit {proc.returncode}): {shlex.join(argv[1:])}\n{proc.stderr[-2000:]}")
        return {"evals": read_evals(os.path.join(out_dir, "metrics.jsonl")), "wall_s": wall}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    extra = shlex.split(args.args)
    ours = OURS if args.ours == "config" else NANOGPT_COMMAND
    recipes = {BASELINE: NANOGPT_CPU + extra, OURS_NAME: ours + extra}
    for variant in args.variant:
        recipes[f"{OURS_NAME} {variant}"] = ours + extra + shlex.split(variant)
    runs = []
    for r in range(args.rounds):
        for name, recipe in recipes.items():
            print(f"round {r + 1}/{args.rounds}: {name}: python {shlex.join(['train.py', *recipe])}", flush=True)
            runs.append({"name": name, **run_recipe(recipe)})
            it, t, loss = runs[-1]["evals"][-1]
            print(f"  val loss {loss:.4f} at iter {it}, {t:.1f} s of training ({runs[-1]['wall_s']:.1f} s wall)")

    baseline_finals = [run["evals"][-1][2] for run in runs if run["name"] == BASELINE]
    target = args.target if args.target is not None else statistics.median(baseline_finals)
    source = "--target" if args.target is not None else "the baseline's final val loss"
    print(f"\ntime to val loss {target:.4f} ({source}):")
    lines, speedups = summarize(runs, target)
    print("\n".join(lines))
    if speedups[OURS_NAME] is None:
        sys.exit(1)


def summarize(runs: list[dict], target: float) -> tuple[list[str], dict[str, float | None]]:
    """A Markdown table of the runs, then a line per recipe other than the baseline with its speed-up: the
    baseline's median time to the target over the recipe's (None, and says so, if either never reached it)."""
    lines = [f"| recipe | iters | process wall time | training time | final val loss | time to {target:.4f} |",
             "|:--|--:|--:|--:|--:|--:|"]
    times: dict[str, list[float]] = {}
    for run in runs:
        t = time_to_target(run["evals"], target)
        it, total, loss = run["evals"][-1]
        reached = "not reached" if t is None else f"{t:.1f} s"
        lines.append(f"| {run['name']} | {it} | {run['wall_s']:.1f} s | {total:.1f} s | {loss:.4f} | {reached} |")
        times.setdefault(run["name"], [])
        if t is not None:
            times[run["name"]].append(t)
    speedups: dict[str, float | None] = {}
    base = statistics.median(times[BASELINE]) if times.get(BASELINE) else None
    for name, ts in times.items():
        if name == BASELINE:
            continue
        if base is None or not ts:
            speedups[name] = None
            lines.append(f"{name}: speed-up n/a ({'the baseline' if base is None else 'it'} never reached the target)")
            continue
        speedups[name] = base / statistics.median(ts)
        lines.append(f"{name}: {speedups[name]:.2f}x faster to val loss {target:.4f} (median {base:.1f} s vs "
                     f"{statistics.median(ts):.1f} s, {len(ts)} run(s))")
    return lines, speedups


if __name__ == "__main__":
    main()
