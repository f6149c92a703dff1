"""errors.py: a UserError run under exit_on_user_error, as every script's __main__ does, ends the process with exit
status 2 and one line on stderr, `error: ` and the message, no traceback."""
from __future__ import annotations

import pytest

from helpers import run_in_process
from nanogpt.errors import RunError, Stopped, UserError, exit_on_user_error


def test_user_errors_exit_2_with_one_line(capsys):
    def bad():
        raise UserError("block_size=0 must be at least 1")

    with pytest.raises(SystemExit) as e:
        exit_on_user_error(bad)
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: block_size=0 must be at least 1\n"


def test_a_ctrl_c_is_one_line_and_exit_130(capsys):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        exit_on_user_error(interrupted)
    assert e.value.code == 130  # 128 + SIGINT
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"


@pytest.mark.slow
def test_help_into_a_pipe_closed_early_ends_quietly():
    """Bug: `python train.py --help | head` ended in a BrokenPipeError traceback; a reader that has gone ends the
    command quietly, 128 + SIGPIPE, as a Unix tool does."""
    import subprocess
    import sys

    from helpers import ROOT

    p = subprocess.Popen([sys.executable, "train.py", "--help"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the script has printed anything (its imports take longer)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_a_stop_that_another_exception_wraps_is_still_one_line(capsys):
    """Bug: a SIGTERM while Python set a class body's names (a dataclass field's __set_name__, in `import
    torch._dynamo` during train.py's start) came out as `RuntimeError: Error calling __set_name__ ...` (Python 3.11
    wraps what __set_name__ raises; its __cause__ the stop): a traceback and exit status 1 instead of one line and
    143. The stop is found along __cause__ and __context__; an error with no stop behind it is raised as it is."""

    class RaisesWhenNamed:
        def __init__(self, stop: BaseException):
            self.stop = stop

        def __set_name__(self, owner, name):  # what a signal handler raising here does
            raise self.stop

    def naming(stop: BaseException):
        def main():
            class Holder:
                field = RaisesWhenNamed(stop)

        return main

    for stop, code, line in [
        (Stopped("stopped by SIGTERM during the start", 143), 143, "stopped by SIGTERM during the start"),
        (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)"),
    ]:
        with pytest.raises(SystemExit) as e:
            exit_on_user_error(naming(stop))
        assert e.value.code == code
        assert capsys.readouterr().err == line + "\n"

    def raised_while_stopping():
        try:
            raise Stopped("stopped by SIGINT during the start", 130)
        finally:
            raise OSError("a cleanup that failed on the way out")  # its __context__: the stop

    with pytest.raises(OSError, match="a cleanup that failed"):  # raised while the stop unwound: a bug's traceback,
        exit_on_user_error(raised_while_stopping)                  # not hidden behind the stop's line

    def failed_write_while_stopping():
        try:
            raise Stopped("stopped by SIGTERM after iter 6; checkpoint saved", 143)
        finally:
            raise RunError("could not write checkpoint out/ckpt.pt (No space left on device)")

    for main in (failed_write_while_stopping, lambda: train_main_with(failed_write_while_stopping)):
        with pytest.raises(SystemExit) as e:  # its own line and exit status: a requeue must not take it for a clean stop
            exit_on_user_error(main)
        assert e.value.code == 1 and capsys.readouterr().err.endswith("error: could not write checkpoint "
                                                                      "out/ckpt.pt (No space left on device)\n")

    def broken():
        raise RuntimeError("a bug") from ValueError("its cause")

    with pytest.raises(RuntimeError, match="a bug"):  # no stop behind it: the traceback a bug deserves
        exit_on_user_error(broken)


@pytest.mark.parametrize("command", ["train.py", "sample.py", "export.py", "hellaswag.py", "bench.py"])
def test_a_config_file_that_raises_keyboard_interrupt_is_one_line(command, tmp_path, capsys):
    """A Ctrl-C while a command reads its config files (a plain Python file that runs): one line, exit status 130."""
    config = tmp_path / "config.py"
    config.write_text("raise KeyboardInterrupt\n")
    r = run_in_process([command, str(config)], capsys)
    assert (r.returncode, r.stderr) == (130, "interrupted (Ctrl-C)\n")


def train_main_with(run):
    """train.main with its train() replaced by `run`."""
    import train

    real = train.train
    train.train = lambda cfg, given=None: run()
    try:
        train.main(["--device=cpu"])
    finally:
        train.train = real
