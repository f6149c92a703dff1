"""plot.py: two real runs' metrics.jsonl into one PNG, looked at pixel by pixel."""
from __future__ import annotations

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest

from helpers import make_char_dataset, run_script, tiny_config
from plot import plot_runs
from train import train


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    make_char_dataset(tmp / "data")
    runs = [tmp / "run-a", tmp / "run-b"]
    for run, lr in zip(runs, (3e-3, 1e-2)):
        train(tiny_config(tmp / "data", run, max_iters=20, eval_interval=10, log_interval=2, learning_rate=lr))
    return runs


def pixels_of(image: np.ndarray, color: str) -> int:
    """How many pixels have (about) this colour."""
    rgb = np.array(matplotlib.colors.to_rgb(color))
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.08).sum())


@pytest.mark.slow
def test_two_runs_draw_two_coloured_curves_into_the_png(two_runs, tmp_path):
    out = plot_runs([str(r) for r in two_runs], str(tmp_path / "loss.png"))
    image = matplotlib.image.imread(out)  # (H, W, RGBA) floats in [0, 1]
    assert image.shape[:2] == (400, 1000)  # 10 x 4 inches at 100 dpi
    assert image[..., :3].std() > 0.05  # not blank
    # each run has its own colour (matplotlib's C0, C1), drawn as curves: hundreds of pixels each
    assert pixels_of(image, "C0") > 300 and pixels_of(image, "C1") > 300
    assert pixels_of(image, "C2") == 0  # and no third run


@pytest.mark.slow
def test_the_command_line_writes_the_png_and_names_a_missing_run(two_runs, tmp_path):
    r = run_script(["plot.py", str(two_runs[0]), f"--out={tmp_path / 'one.png'}"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"plot: written to {tmp_path / 'one.png'}"
    assert pixels_of(matplotlib.image.imread(tmp_path / "one.png"), "C0") > 300
    r = run_script(["plot.py", str(tmp_path / "nope")], timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: no {tmp_path / 'nope' / 'metrics.jsonl'}: give the out_dir of a train.py run"
    (tmp_path / "afile").write_text("mine\n")  # --out under a file: the line says so, and names --out (no out_dir)
    r = run_script(["plot.py", str(two_runs[0]), f"--out={tmp_path / 'afile' / 'x.png'}"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: could not write loss picture {tmp_path / 'afile' / 'x.png'} ({tmp_path / 'afile'} is a file, not a "
        f"folder); loss picture was not written: free disk space, or give another --out"), r.stderr


@pytest.mark.slow
def test_without_matplotlib_plot_py_is_one_line_naming_the_pip_command(tmp_path):
    # a fresh process where matplotlib cannot be imported, as on a machine without it
    hidden = ("import runpy, sys; sys.modules['matplotlib'] = None; "
              f"sys.argv = ['plot.py', {str(tmp_path)!r}]; runpy.run_path('plot.py', run_name='__main__')")
    r = run_script(["-c", hidden], timeout=120)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["error: plot.py needs matplotlib, which is not installed: pip install matplotlib"]


@pytest.mark.slow
def test_out_never_writes_over_a_file_that_is_not_a_picture(two_runs, tmp_path):
    """A review's reproduction: `plot.py RUN --out=RUN/ckpt.pt` replaced the run's checkpoint with a PNG, exit 0.
    A file there that is not a PNG is refused in one line; an earlier picture is written over as before."""
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04 a checkpoint")
    (tmp_path / "mine.png").write_bytes(b"my notes, named .png")
    r = run_script(["plot.py", str(two_runs[0]), f"--out={tmp_path / 'mine.png'}"], timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"error: --out={tmp_path / 'mine.png'}: {tmp_path / 'mine.png'} exists and is not a PNG picture: it is not "
        f"written over; give another file name, or move it away first"), r.stderr
    assert run_script(["plot.py", str(two_runs[0]), f"--out={tmp_path / 'ckpt.pt'}"], timeout=120).returncode == 2
    assert (tmp_path / "ckpt.pt").read_bytes() == b"PK\x03\x04 a checkpoint"
    assert (tmp_path / "mine.png").read_bytes() == b"my notes, named .png"
    for _ in range(2):  # the second writes over the first's picture
        assert run_script(["plot.py", str(two_runs[0]), f"--out={tmp_path / 'p.png'}"], timeout=120).returncode == 0
    for name in (str(tmp_path / "x.pdf"), ""):  # PNG bytes under another name; an empty name ("free disk space")
        r = run_script(["plot.py", str(two_runs[0]), f"--out={name}"], timeout=120)
        assert r.returncode == 2 and r.stderr.strip() == (
            f"error: --out={name!r}: the picture is a PNG: give a name ending in .png"), r.stderr
