"""
UserError, the one error of a mistake the user can fix (a setting, a file, an input), whichever layer finds it, and
exit_on_user_error, which every script runs its main under to print it as one line (exit status 2, no traceback).

A module of its own, importing nothing from the project, so that every other module can raise it.
"""
from __future__ import annotations

import sys
from typing import Callable, NoReturn


class UserError(ValueError):
    """A mistake the user can fix (a bad setting or input, a missing file): the message names the bad value and
    the fix. Scripts print it as one line, without a traceback."""


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Run `main`; a UserError becomes a one-line message on stderr and exit status 2."""
    try:
        return main()
    except UserError as e:
        fail(str(e))


def fail(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
