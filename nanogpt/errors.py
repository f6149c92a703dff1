"""The errors a user reads as one line, whichever layer finds them, and exit_on_user_error, which every command's
main runs under to print them without a traceback: a UserError (a WriteError too) exits 2, a RunError 1, a Stopped
128 + its signal, and a Ctrl-C anywhere else prints `interrupted (Ctrl-C)` and exits 130. It imports nothing of the
project's, so that every module can raise them."""
from __future__ import annotations

import os
import signal
import sys
from typing import Callable, NoReturn

INTERRUPTED = "interrupted (Ctrl-C)"


class UserError(ValueError):
    """A mistake the user can fix (a bad setting or input, a missing file): the message names the bad value and the
    fix."""

    exit_code = 2


class WriteError(UserError):
    """A write that failed: the message names the path, the cause and what was kept."""


class RunError(UserError):
    """A run that started and stopped on a failure it explains in one line (exit status 1, as any failure)."""

    exit_code = 1


class Stopped(SystemExit):
    """A stop by a signal, with a checkpoint, raised by every rank at the same step. It exits 128 + the signal (the
    shell's convention): a requeue script tells a resumable stop from the end (0), a failure (1), a user error (2)."""

    def __init__(self, message: str, code: int = 128 + signal.SIGTERM):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def stop_behind(e: BaseException) -> Stopped | KeyboardInterrupt | None:
    """The stop (Stopped, or a Ctrl-C's KeyboardInterrupt) that `e` is or was raised from (its __cause__: an error
    raised while a stop unwound keeps its own message); None if none, or if a SystemExit came after it. Python 3.11
    wraps a handler's exception raised while a class body's names are set (a SIGTERM during an import)."""
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
    """Run `main`; a UserError or a stop (also one another exception wraps) becomes one line on stderr and its exit
    status, never a traceback."""
    try:
        return main()
    except UserError as e:
        fail(str(e), e.exit_code)
    except BrokenPipeError:  # stdout's reader has gone (`--help | head`): end quietly, as a Unix tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit fails again
        sys.exit(128 + signal.SIGPIPE)
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
    """A stop by a signal during the start, before anything was saved: the ranks do not wait for each other (some may
    never get the signal)."""
