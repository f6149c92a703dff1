"""
The errors a user reads as one line, whichever layer finds them, and exit_on_user_error, which every command runs its
main under to print them so (no traceback):
  UserError   a mistake the user can fix (a setting, a file, an input): exit status 2, refused before anything ran
  WriteError  a write that failed (a full disk, a read-only folder, a symbolic link where a file goes): a UserError
  RunError    a run that started and could not go on (a non-finite loss, a write that failed mid-run): exit status 1
  Stopped     a run stopped by a signal (SIGTERM, Ctrl-C): exit status 128 + the signal
and a Ctrl-C anywhere else in a command's main: one line, `interrupted (Ctrl-C)`, exit status 130 (128 + SIGINT).

A module of its own so that every other module can raise them: Imports nothing of the project's.
"""
from __future__ import annotations

import signal
import sys
from typing import Callable, NoReturn

INTERRUPTED = "interrupted (Ctrl-C)"


class UserError(ValueError):
    """A mistake the user can fix (a bad setting or input, a missing file): the message names the bad value and
    the fix. Scripts print it as one line, without a traceback, and exit with `exit_code`."""

    exit_code = 2


class WriteError(UserError):
    """A write that failed: the message names the path, the cause and what was kept."""


class RunError(UserError):
    """A run that started and stopped on a failure it explains in one line (exit status 1, as any failure)."""

    exit_code = 1


class Stopped(SystemExit):
    """A stop by a signal, with a checkpoint: every rank raises it at the same step. Exits 143 after a SIGTERM and
    130 after a SIGINT (128 + the signal, the shell's convention for a process ended on request), so a requeue
    script tells a clean, resumable stop from the end of training (0), a failure (1) and a user error (2);
    train.main prints the message."""

    def __init__(self, message: str, code: int = 128 + signal.SIGTERM):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def stop_behind(e: BaseException) -> Stopped | KeyboardInterrupt | None:
    """The stop (a Stopped, or a Ctrl-C's KeyboardInterrupt) that `e` is, or was raised from (its __cause__, not an
    error raised while a stop unwound: that one is a bug's, or a failed write's, and keeps its own message); None if
    none, or if an exit (SystemExit) was decided after it. A signal handler's exception can come out wrapped: Python
    3.11 turns one raised while a class body's names are set into `RuntimeError: Error calling __set_name__ ...` (its
    __cause__ the stop), which a SIGTERM during `import torch._dynamo` did."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, (Stopped, KeyboardInterrupt)):
            return e
        if isinstance(e, SystemExit):
            return None
        seen.add(id(e))
        e = e.__cause__
    return None


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Run `main`; a UserError becomes a one-line message on stderr and its exit status (2; a RunError's 1); a stop,
    also one that another exception wraps (stop_behind), becomes one line and 128 + its signal: a Stopped's message,
    or `interrupted (Ctrl-C)` and 130. Never a traceback for either."""
    try:
        return main()
    except UserError as e:
        fail(str(e), e.exit_code)
    except BaseException as e:
        stop = stop_behind(e)
        if isinstance(stop, Stopped):
            say(stop.message, stop.code)
        if isinstance(stop, KeyboardInterrupt):
            say(INTERRUPTED, 128 + signal.SIGINT)
        raise


def say(msg: str, code: int) -> NoReturn:
    """msg as the command's last line, on stderr, and exit with `code` (a stop's: no "error: ")."""
    print(msg, file=sys.stderr, flush=True)
    sys.exit(code)


def fail(msg: str, code: int = 2) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


class Interrupted(Stopped):
    """A stop by a signal during the start, before anything was saved: exits 128 + the signal, as a stop does, and the
    ranks do not wait for each other (some may never get the signal)."""
