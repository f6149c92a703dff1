"""SIGTERM and Ctrl-C during a run: during the start a signal stops it at once, after it with a checkpoint."""
from __future__ import annotations

import contextlib
import shlex
import signal
import time

import torch
import torch.distributed as torch_dist

from nanogpt.distributed import Dist
from nanogpt.errors import Interrupted, stop_behind


def resume_command(out_dir: str) -> str:
    return f"python train.py --init_from=resume --out_dir={shlex.quote(out_dir)}"


class StopRequest:
    """SIGTERM (schedulers, preemption) and SIGINT (Ctrl-C) from a run's first moment to its end. Until arm() a signal
    stops the start at once (Interrupted, nothing saved); after, it asks the run to stop with a checkpoint after the
    current micro-step, quickly: torchrun SIGKILLs its workers --shutdown-timeout (30 s) after forwarding a SIGTERM.
    A second Ctrl-C exits at once. The ranks agree on a stop before acting, so none waits forever in a collective."""

    def __init__(self):
        self.dist, self.armed = Dist(), False
        self.signal: int | None = None
        self._group, self._first, self._previous = None, 0.0, {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. train() called from a thread): no handlers
                pass

    @contextlib.contextmanager
    def joined(self, dist: Dist):
        """The ranks of `dist` agree on a stop inside the block, over a gloo group on CPU tensors: asking between
        micro-steps never waits for the GPU, as an NCCL all-reduce and .item() would."""
        self.dist = dist
        if dist.enabled:
            self._group = torch_dist.new_group(backend="gloo") if torch_dist.get_backend() != "gloo" else None
        try:
            yield self
        finally:
            self._group, self.dist = None, Dist()

    def arm(self) -> None:
        """The start is accepted: from here on a signal stops the run with a checkpoint. A signal that came before,
        whose exception something swallowed, still stops the start here."""
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
        """Whether any rank's flag is set (every rank must ask)."""
        if self.dist.enabled:
            t = torch.tensor([1.0 if flag else 0.0])
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=self._group)
            flag = t.item() > 0
        return flag

    def exit_code(self) -> int:
        """128 + this rank's signal (SIGTERM where another rank got it)."""
        return 128 + (self.signal if self.signal is not None else signal.SIGTERM)

    def message(self, iter_num: int, out_dir: str) -> str:
        name = signal.Signals(self.signal).name if self.signal is not None else "a signal on another rank"
        return f"stopped by {name} after iter {iter_num}; checkpoint saved: resume with {resume_command(out_dir)}"

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
    """A second Ctrl-C during a run: it exits at once without a checkpoint, with exit status 1 (train.main), not a
    clean stop's 130."""
