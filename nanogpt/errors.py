"""
The errors a user reads as one line, whichever layer finds them, and exit_on_user_error, which every command runs its
main under to print them so (no traceback):
  UserError   a mistake the user can fix (a setting, a file, an input): exit status 2, refused before anything ran
  WriteError  a write that failed (a full disk, a read-only folder, a symbolic link where a file goes): a UserError
  RunError    a run that started and could not go on (a non-finite loss, a write that failed mid-run): exit status 1

A module of its own so that every other module can raise them: Imports nothing of the project's.
"""
from __future__ import annotations

import sys
from typing import Callable, NoReturn


class UserError(ValueError):
    """A mistake the user can fix (a bad setting or input, a missing file): the message names the bad value and
    the fix. Scripts print it as one line, without a traceback, and exit with `exit_code`."""

    exit_code = 2


class WriteError(UserError):
    """A write that failed: the message names the path, the cause and what was kept."""


class RunError(UserError):
    """A run that started and stopped on a failure it explains in one line (exit status 1, as any failure)."""

    exit_code = 1


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Run `main`; a UserError becomes a one-line message on stderr and its exit status (2; a RunError's 1)."""
    try:
        return main()
    except UserError as e:
        fail(str(e), e.exit_code)


def fail(msg: str, code: int = 2) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)
