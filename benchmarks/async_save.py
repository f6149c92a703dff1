"""
What a sharded checkpoint costs the training of an FSDP run, written on the training thread (DCP's save) or in
the background (async_save=True, DCP's async_save), side by side with the same run saving nothing.

    python data/shakespeare_char/prepare.py
    python benchmarks/async_save.py                       # CPU: 2 gloo ranks, a 6 x 384 GPT, a save every 5 steps
    python benchmarks/async_save.py --device=cuda --nproc=1 --args="--n_layer=12 --n_embd=768 --n_head=12"

Each run is `torchrun --nproc_per_node=N train.py` in a fresh process group, the three modes alternating for
--rounds rounds. A run's time per step is the wall time from its first logged step to its last (metrics.jsonl's
elapsed_s) over the steps between them, so the saves in that span count, wherever they run. The table also gives
what the log says of each save: its time on the training thread (the whole save, or the copy to CPU memory
before the background write) and, in the background, how long the write ran beside training.

Exit status: 0; 1 if a run fails (its stderr is shown).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanogpt.metrics import read_records  # noqa: E402

RUN = ["config/train_shakespeare_char.py", "--parallelism=fsdp", "--n_layer=6", "--n_head=6", "--n_embd=384",
       "--block_size=256", "--batch_size=8", "--gradient_accumulation_steps=2", "--eval_interval=100000",
       "--eval_iters=1", "--log_interval=1", "--compile=False", "--report=False", "--dropout=0.0"]
MODES = {
    "no saves": ["--checkpoint_interval=0"],
    "saves on the training thread": ["--checkpoint_interval={every}"],
    "saves in the background": ["--checkpoint_interval={every}", "--async_save=True"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="checkpoint_interval of the saving modes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--args", default="", help="extra train.py arguments for every mode")
    return p.parse_args(argv)


def step_ms(metrics_path: str) -> tuple[float, int]:
    """Milliseconds per step from the first logged step to the last, saves between them included; the step count."""
    steps = [r for r in read_records(metrics_path) if "loss" in r and "iter" in r]
    first, last = steps[0], steps[-1]
    n = last["iter"] - first["iter"]
    return 1000 * (last["elapsed_s"] - first["elapsed_s"]) / n, n


def save_times(log: str, last_iter: int) -> dict[str, list[float]]:
    """What train.py printed of the saves between steps (not the last one, after them): seconds on the training
    thread, seconds written in the background."""
    on_thread = re.findall(r"saved sharded checkpoint at iter (\d+) to \S+ in ([\d.]+) s", log)
    return {
        "thread": [float(s) for it, s in on_thread if int(it) != last_iter]
        + [float(s) for s in re.findall(r"in the background \(staged in ([\d.]+) s\)", log)],
        "background": [float(s) for s in re.findall(r"written in ([\d.]+) s beside training", log)],
    }


def seconds(times: list[float]) -> str:
    return f"{statistics.median(times):.2f}" if times else "-"


def run_mode(args: argparse.Namespace, mode: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="async_save_") as out_dir:
        extra = [m.format(every=args.every) for m in mode] + shlex.split(args.args)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                "train.py", *RUN, f"--device={args.device}", f"--max_iters={args.steps}",
                f"--lr_decay_iters={args.steps}", f"--out_dir={out_dir}", *extra]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"error: train.py failed (exit {proc.returncode}): {shlex.join(argv[1:])}\n{proc.stderr[-3000:]}")
        ms, n = step_ms(os.path.join(out_dir, "metrics.jsonl"))
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out_dir) for f in files
                   if ".distcp" in f)
        return {"ms": ms, "steps": n, "bytes": size, **save_times(proc.stdout, args.steps)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in MODES}
    for r in range(args.rounds):
        for name, mode in MODES.items():
            results[name].append(run_mode(args, mode))
            last = results[name][-1]
            print(f"round {r + 1}/{args.rounds}: {name}: {last['ms']:.1f} ms/step over {last['steps']} steps",
                  flush=True)
    base = statistics.median(run["ms"] for run in results["no saves"])
    size = max(run["bytes"] for runs in results.values() for run in runs)
    print(f"\n{args.nproc} ranks on {args.device}, {args.steps} steps, a save every {args.every} steps "
          f"(shards: {size / 1e6:.0f} MB)\n")
    print("| mode | ms/step, saves included (each round) | vs no saves | a save on the training thread (s) "
          "| written in the background (s) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        ms = statistics.median(run["ms"] for run in runs)
        thread = [t for run in runs for t in run["thread"]]
        background = [t for run in runs for t in run["background"]]
        each = ", ".join(f"{run['ms']:.1f}" for run in runs)
        print(f"| {name} | {ms:.1f} ({each}) | {ms / base:.2f}x | "
              f"{seconds(thread)} | {seconds(background)} |")


if __name__ == "__main__":
    main()
