"""
train.py with a signal at a chosen point: `python tests/signal_at_step.py SIGNAL STEP RANK train.py-arguments...`
runs train.main, and the process of global rank RANK sends SIGNAL to itself during its STEP-th training step (1:
the first of this process). Under torchrun every worker runs this script. A fault injected where the test says,
never raced against the run.
"""
from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train  # noqa: E402
from nanogpt.errors import exit_on_user_error  # noqa: E402


def signal_during_step(sig: int, step: int) -> None:
    """Make this process's `step`-th call of train.train_step send `sig` to the process, before the step runs."""
    real_step, calls = train.train_step, []

    def step_with_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), sig)
        return real_step(*args, **kwargs)

    train.train_step = step_with_signal


if __name__ == "__main__":
    name, step, rank, *args = sys.argv[1:]
    if int(os.environ.get("RANK", "0")) == int(rank):
        signal_during_step(signal.Signals[name], int(step))
    exit_on_user_error(lambda: train.main(args))
