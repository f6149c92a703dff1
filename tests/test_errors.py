"""errors.py: a UserError run under exit_on_user_error, as every script's __main__ does, ends the process with exit
status 2 and one line on stderr, `error: ` and the message, no traceback."""
from __future__ import annotations

import signal

import pytest

from helpers import run_in_process, run_script
from nanogpt.errors import Stopped, UserError, exit_on_user_error


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

    with pytest.raises(SystemExit) as e:
        exit_on_user_error(raised_while_stopping)
    assert e.value.code == 130 and capsys.readouterr().err == "stopped by SIGINT during the start\n"

    def broken():
        raise RuntimeError("a bug") from ValueError("its cause")

    with pytest.raises(RuntimeError, match="a bug"):  # no stop behind it: the traceback a bug deserves
        exit_on_user_error(broken)


# a Ctrl-C while the command imports torch, before its main runs: what the terminal's Ctrl-C in the first seconds does
CTRL_C_AT_TORCH = """
import runpy, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("command", ["train.py", "sample.py", "bench.py", "export.py", "hellaswag.py", "plot.py",
                                     "convert_sharded.py"])
def test_a_ctrl_c_during_a_commands_imports_is_one_line(command):
    """Bug: `timeout -s INT 0.5 python train.py ...` printed KeyboardInterrupt's traceback from `import torch`: a
    Ctrl-C before main runs is no exit_on_user_error's. Each command imports errors.py before torch, whose
    excepthook prints the one line; the interpreter then ends the process by SIGINT, as for any Ctrl-C (the shell's
    130)."""
    r = run_script(["-c", CTRL_C_AT_TORCH, command, "--help"])
    assert r.stderr == "interrupted (Ctrl-C)\n", r.stderr[-3000:]
    assert r.returncode == -signal.SIGINT


@pytest.mark.parametrize("command", ["train.py", "sample.py", "export.py", "hellaswag.py", "bench.py"])
def test_a_config_file_that_raises_keyboard_interrupt_is_one_line(command, tmp_path, capsys):
    """A Ctrl-C while a command reads its config files (a plain Python file that runs): one line, exit status 130."""
    config = tmp_path / "config.py"
    config.write_text("raise KeyboardInterrupt\n")
    r = run_in_process([command, str(config)], capsys)
    assert (r.returncode, r.stderr) == (130, "interrupted (Ctrl-C)\n")


# a Ctrl-C while torch's C code imports numpy (numpy.linalg, from numpy.matrixlib): torch clears the exception of that
# import and goes on
# and, with `then`, a later import that fails, as a module that the Ctrl-C cut short does when imported again
CTRL_C_IN_NUMPY = """
import runpy, signal, sys
then = sys.argv.pop(1)
class CtrlC:
    sent = False
    def find_spec(self, name, path=None, target=None):
        if name == "numpy.linalg" and not CtrlC.sent:
            CtrlC.sent = True
            signal.raise_signal(signal.SIGINT)  # the handler runs here, as for a Ctrl-C landing here
        if name == then:
            raise ImportError("cannot load module more than once per process")
sys.meta_path.insert(0, CtrlC())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("then, code", [("-", 130), ("configurator", -signal.SIGINT)])
def test_a_ctrl_c_that_torchs_import_swallows_still_stops_the_command(tmp_path, then, code):
    """Bug: `timeout -s INT 0.5 python train.py ...` trained on (the Ctrl-C's KeyboardInterrupt cleared by torch's
    C code, which imports numpy), or died of a RecursionError in the half-imported numpy.linalg, or of an ImportError
    (a traceback, exit status 1). errors.py sees the Ctrl-C from its import on: the command stops before its main
    runs, in one line, with 130 (or by SIGINT, the shell's 130, where an import failed after it)."""
    out = tmp_path / "out"
    r = run_script(["-c", CTRL_C_IN_NUMPY, then, "train.py", "--device=cpu", f"--out_dir={out}", "--max_iters=1"])
    assert (r.returncode, r.stderr) == (code, "interrupted (Ctrl-C)\n"), r.stderr[-3000:]
    assert not out.exists()
