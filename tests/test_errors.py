"""errors.py: a UserError run under exit_on_user_error, as every script's __main__ does, ends the process with exit
status 2 and one line on stderr, `error: ` and the message, no traceback."""
from __future__ import annotations

import pytest

from nanogpt.errors import UserError, exit_on_user_error


def test_user_errors_exit_2_with_one_line(capsys):
    def bad():
        raise UserError("block_size=0 must be at least 1")

    with pytest.raises(SystemExit) as e:
        exit_on_user_error(bad)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: block_size=0 must be at least 1\n"
