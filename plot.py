"""
Loss curves of training runs: train and val loss against steps and against wall time, one colour per run, from
each run's metrics.jsonl (train.py writes it into out_dir).

$ python plot.py out-shakespeare-char-cpu                    # -> loss.png
$ python plot.py out-a out-b --out=compare.png               # two runs, one picture

The thin line is the training loss logged every log_interval steps (one micro-batch's, so noisy); the thick line
with dots is the val loss of each eval. Wall time is train.py's elapsed_s: seconds since the run started, evals
included, so runs of different speed compare on the right panel.

Reads metrics.jsonl through metrics.py; imports no other script.
"""
from __future__ import annotations

import argparse
import os

from common import pyplot
from errors import exit_on_user_error
from metrics import RunMetrics, read_metrics


def plot_runs(out_dirs: list[str], out: str = "loss.png") -> str:
    """Draw the runs of `out_dirs` into the PNG `out` (left: against steps, right: against wall time)."""
    pyplot("plot.py")  # a missing matplotlib is named first, before any run is read
    return draw([(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in out_dirs], out)


def draw(runs: list[tuple[str, RunMetrics]], out: str) -> str:
    """Draw (name, metrics) runs into the PNG `out`; returns `out`."""
    plt = pyplot("plot.py")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for i, (name, (steps, evals, _)) in enumerate(runs):
        color = f"C{i}"
        for ax, x in zip(axes, ("iter", "elapsed_s")):
            ax.plot([r[x] for r in steps], [r["loss"] for r in steps], color=color, lw=0.8, alpha=0.5,
                    label=f"{name} train")
            ax.plot([r[x] for r in evals], [r["val_loss"] for r in evals], color=color, lw=2, marker="o", ms=4,
                    label=f"{name} val")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall time (s)")
    axes[0].set_ylabel("loss")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot train and val loss of train.py runs from metrics.jsonl.")
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="a train.py run's out_dir")
    parser.add_argument("--out", default="loss.png", help="the PNG to write (default: loss.png)")
    args = parser.parse_args(argv)
    print(f"plot: written to {plot_runs(args.out_dirs, args.out)}")


if __name__ == "__main__":
    exit_on_user_error(main)
