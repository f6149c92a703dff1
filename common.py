"""Shared runtime logic for train.py, sample.py and bench.py: user errors, device and dtype, checkpoints."""
from __future__ import annotations

import sys
from typing import Callable, NoReturn


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file...). Scripts print it on one line, no traceback."""


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Run `main`; a UserError becomes a one-line message on stderr and exit status 2."""
    try:
        return main()
    except UserError as e:
        _fail(str(e))


def _fail(msg: str) -> NoReturn:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)
