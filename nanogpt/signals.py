"""
SIGTERM (schedulers, preemption) and Ctrl-C during a run: before its start is accepted a signal stops it at once, with
nothing saved; after, it asks the run to stop with a checkpoint at the next micro-step, on every rank at the same one.
"""
from __future__ import annotations

import contextlib
import signal
import time

import torch
import torch.distributed as torch_dist

from nanogpt.distributed import Dist
from nanogpt.errors import Interrupted, stop_behind


class StopRequest:
    """
    SIGTERM (schedulers, preemption) and SIGINT (Ctrl-C), from the first moment of a run to its end. Before the start
    is accepted (until arm()), a signal stops the start at once: Interrupted, nothing saved, out_dir as it was (the
    hold's and the start's cleanup run as the exception unwinds). After it, a signal asks the run to stop after the
    current micro-step (an unfinished optimizer step is dropped) or eval, with a checkpoint: torchrun SIGKILLs its
    workers --shutdown-timeout seconds (30 by default) after forwarding a SIGTERM, so the stop must be quick. A second
    Ctrl-C exits at once. Under DDP every rank stops at the same micro-step: the ranks agree (all-reduce of the flag,
    over the group join() makes) before acting, so no rank waits forever in a collective.
    """

    def __init__(self):
        self.dist = Dist()
        self.signal: int | None = None
        self.armed = False
        self._group = None
        self._first = 0.0
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. train() called from a thread): no handlers
                pass

    @contextlib.contextmanager
    def joined(self, dist: Dist):
        """The ranks of `dist` agree on a stop inside the block, over a gloo group of their own on CPU tensors: asking
        between micro-steps never waits for the GPU (an NCCL all-reduce and .item() would sync with the queued
        kernels). The group is let go at the block's end, before the process group's end destroys it."""
        self.dist = dist
        if dist.enabled:
            self._group = torch_dist.new_group(backend="gloo") if torch_dist.get_backend() != "gloo" else None
        try:
            yield self
        finally:
            self._group, self.dist = None, Dist()

    def arm(self) -> None:
        """The start is accepted: from here on a signal stops the run with a checkpoint, at the next micro-step. A
        signal that came before, whose exception something swallowed (a finalizer, a callback that ignores errors),
        still stops the start here: nothing saved, out_dir as it was."""
        if self.signal is not None:
            raise self.interrupted()
        self.armed = True

    def _handle(self, signum, frame) -> None:
        if not self.armed:  # during the start: nothing to save, nothing to wait for
            self.signal = signum
            raise self.interrupted()
        # A second Ctrl-C exits at once; one within a second of the first is the same Ctrl-C (torchrun forwards
        # the terminal's SIGINT to workers that already got it).
        now = time.monotonic()
        if self.signal is not None and signum == signal.SIGINT and now - self._first > 1.0:
            raise SecondCtrlC("second Ctrl-C: exiting without a checkpoint")
        if self.signal is None:
            self.signal, self._first = signum, now

    def interrupted(self) -> Interrupted:
        name = signal.Signals(self.signal).name
        return Interrupted(f"stopped by {name} during the start, before the first step: nothing was saved, and the "
                           f"run folder is as it was", 128 + self.signal)

    def signalled(self) -> bool:
        """This rank's own flag (no collective)."""
        return self.signal is not None

    def requested(self) -> bool:
        return self.agree(self.signal is not None)

    def agree(self, flag: bool) -> bool:
        """Whether any rank's flag is set (every rank must ask): the ranks act on a decision together."""
        if self.dist.enabled:
            t = torch.tensor([1.0 if flag else 0.0])
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=self._group)
            flag = t.item() > 0
        return flag

    def exit_code(self) -> int:
        """128 + this rank's signal (SIGTERM where another rank got it)."""
        return 128 + (self.signal if self.signal is not None else signal.SIGTERM)

    def message(self, iter_num: int) -> str:
        name = signal.Signals(self.signal).name if self.signal is not None else "a signal on another rank"
        return f"stopped by {name} after iter {iter_num}; checkpoint saved: resume with --init_from=resume"

    def __enter__(self) -> "StopRequest":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, Exception) and self.signal is not None and not self.armed and stop_behind(exc) is None:
            # the start's signal, whose exception something swallowed on its way up, and an error after it: a module
            # whose import it cut short, then used (numpy.linalg: a RecursionError), is the signal's doing
            raise self.interrupted() from exc



class SecondCtrlC(KeyboardInterrupt):
    """A second Ctrl-C during a run: it exits at once, without a checkpoint (train.main: exit status 1, not a clean
    stop's 130), unlike a Ctrl-C before the run's handlers are in place (errors.exit_on_user_error's 130)."""
