"""
Loss curves of train.py runs from their metrics.jsonl: train and val loss against steps and against wall time.

$ python plot.py out-shakespeare-char-cpu                    # -> loss.png
$ python plot.py out-a out-b --out=compare.png               # two runs, one picture

The thin line is the training loss every log_interval steps (one batch's worth, so noisy); the thick one with dots
the val loss of each eval. Wall time is elapsed_s since the run started, evals included, so runs of different speed
compare on the right panel.
"""
from __future__ import annotations

import argparse
import os

from nanogpt.optional import pyplot
from nanogpt import files
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.metrics import read_metrics
from nanogpt.plot import draw


def plot_runs(out_dirs: list[str], out: str = "loss.png") -> str:
    pyplot("plot.py")  # a missing matplotlib is named first, before any run is read
    if not out.lower().endswith(".png"):
        raise UserError(f"--out={out!r}: the picture is a PNG: give a name ending in .png")
    if (why := files.replaced_problem(out, lambda head: head.startswith(b"\x89PNG\r\n\x1a\n"), "a PNG picture")):
        raise UserError(f"--out={out}: {why}")
    return draw([(os.path.basename(os.path.normpath(d)), read_metrics(d)) for d in out_dirs], out,
                fix="free disk space, or give another --out")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot train and val loss of train.py runs from metrics.jsonl.")
    parser.add_argument("out_dirs", nargs="+", metavar="OUT_DIR", help="a train.py run's out_dir")
    parser.add_argument("--out", default="loss.png", help="the PNG to write (default: loss.png)")
    args = parser.parse_args(argv)
    print(f"plot: written to {plot_runs(args.out_dirs, args.out)}")


if __name__ == "__main__":
    exit_on_user_error(main)
