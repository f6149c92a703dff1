"""
Time to a validation loss, side by side: nanoGPT's CPU recipe for the baby GPT vs our CPU config.

    python data/shakespeare_char/prepare.py
    python benchmarks/time_to_loss.py               # the baseline, then ours
    python benchmarks/time_to_loss.py --rounds=2    # alternate them twice (a shared machine's speed drifts)

nanoGPT's README trains the baby GPT on a CPU with
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
      --lr_decay_iters=2000 --dropout=0.0
and gets a val loss of about 1.88. The baseline is that command run with this repo's train.py, set to do what
nanoGPT does on a CPU: float32 (no autocast), SDPA attention, no vocabulary padding, the for-each AdamW, glibc's
default malloc. Ours is config/train_shakespeare_char_cpu.py as it is.

Every run is train.py in a fresh process with its own out_dir. Its metrics.jsonl gives the val loss of each eval
and the wall time since training started (elapsed_s, which includes the evals). The target is the baseline's final
val loss (or --target); a run's time to it is interpolated linearly between the two evals around it. The speed-up
is the ratio of the two recipes' median times to the target.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NANOGPT_CPU = [  # nanoGPT's README command, then the settings that make this train.py do what nanoGPT's does
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0",
    "--dtype=float32", "--attention=sdpa", "--vocab_padding_multiple=1", "--fused_adamw=False",
    "--keep_freed_memory=False",
]
OURS = ["config/train_shakespeare_char_cpu.py"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="runs of each recipe, alternating baseline and ours")
    p.add_argument("--target", type=float, default=None, help="val loss to reach (default: the baseline's final)")
    p.add_argument("--args", default="", help="extra train.py arguments for both recipes, e.g. '--data_dir=...'")
    p.add_argument("--ours_args", default="", help="extra train.py arguments for ours only, e.g. '--compile=True'")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds} must be at least 1")
    return args


def read_evals(metrics_path: str) -> list[tuple[int, float, float]]:
    """(iteration, elapsed seconds, val loss) of every eval in a run's metrics.jsonl."""
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [(r["iter"], r["elapsed_s"], r["val_loss"]) for r in records if "val_loss" in r]


def time_to_target(evals: list[tuple[int, float, float]], target: float) -> float | None:
    """The wall time at which the val loss first reaches target, interpolated linearly between the eval before
    and the eval that reaches it; None if no eval does."""
    previous = None
    for _, t, loss in evals:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return t
            t0, loss0 = previous
            return t0 + (t - t0) * (loss0 - target) / (loss0 - loss)
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
    recipes = {"nanoGPT CPU recipe": NANOGPT_CPU + extra, "ours": OURS + extra + shlex.split(args.ours_args)}
    runs = []
    for r in range(args.rounds):
        for name, recipe in recipes.items():
            print(f"round {r + 1}/{args.rounds}: {name}: python {shlex.join(['train.py', *recipe])}", flush=True)
            runs.append({"name": name, **run_recipe(recipe)})
            it, t, loss = runs[-1]["evals"][-1]
            print(f"  val loss {loss:.4f} at iter {it}, {t:.1f} s of training ({runs[-1]['wall_s']:.1f} s wall)")

    baseline_finals = [run["evals"][-1][2] for run in runs if run["name"] == "nanoGPT CPU recipe"]
    target = args.target if args.target is not None else statistics.median(baseline_finals)
    source = "--target" if args.target is not None else "the baseline's final val loss"
    print(f"\ntime to val loss {target:.4f} ({source}):")
    print(f"| recipe | final val loss | iters | time to {target:.4f} |\n|:--|--:|--:|--:|")
    times: dict[str, list[float]] = {name: [] for name in recipes}
    for run in runs:
        t = time_to_target(run["evals"], target)
        it, _, loss = run["evals"][-1]
        print(f"| {run['name']} | {loss:.4f} | {it} | {'not reached' if t is None else f'{t:.1f} s'} |")
        if t is not None:
            times[run["name"]].append(t)
    base, ours = (statistics.median(v) if v else None for v in times.values())
    if base is None or ours is None:
        print("speed-up: n/a (a recipe never reached the target)")
        sys.exit(1)
    print(f"speed-up to val loss {target:.4f}: {base / ours:.2f}x (median {base:.1f} s vs {ours:.1f} s, "
          f"{args.rounds} run(s) each)")


if __name__ == "__main__":
    main()
