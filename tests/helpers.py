"""Small datasets and configs that the tests build themselves (nothing downloaded, nothing large)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from nanogpt import dataio
from nanogpt.config import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_files() -> list[str]:
    """README.md and every docs/*.md: the files whose commands the README-commands tests check."""
    import glob

    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def doc_shell_lines() -> list[tuple[str, list[str]]]:
    """(line, its words before a `  #` comment) of every line in the ```sh blocks of doc_files()."""
    import shlex

    lines = []
    for path in doc_files():
        in_code = False
        for line in open(path):
            if line.startswith("```"):
                in_code = line.strip() == "```sh"
            elif in_code:
                lines.append((line.strip(), shlex.split(line.split("  #")[0].strip())))
    return lines


def make_char_dataset(data_dir, n_chars: int = 60_000, seed: int = 0) -> dict:
    """A learnable character corpus: words from a small vocabulary in a random but repetitive order."""
    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "lady", "of", "york", "hath"]
    text = []
    while sum(map(len, text)) < n_chars:
        line = " ".join(rng.choice(words, size=rng.integers(3, 9)))
        text.append(line.capitalize() + ".\n")
    text = "".join(text)[:n_chars]
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    os.makedirs(data_dir, exist_ok=True)
    dataio.write_tokens(os.path.join(data_dir, "train.bin"), ids[:n])
    dataio.write_tokens(os.path.join(data_dir, "val.bin"), ids[n:])
    meta = {"vocab_size": len(itos), "tokenizer": "char", "itos": itos, "train_tokens": n,
            "val_tokens": len(ids) - n, "dtype": "uint16", "source": "tests"}
    dataio.write_meta(data_dir, meta)
    return meta


def tiny_config(data_dir, out_dir, **overrides) -> TrainConfig:
    """A model and run small enough for a test on two CPU cores (seconds, not minutes)."""
    base = dict(
        dataset=os.path.basename(str(data_dir)), data_dir=str(data_dir), out_dir=str(out_dir),
        n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4, gradient_accumulation_steps=1,
        max_iters=20, eval_interval=10, eval_iters=4, log_interval=5, warmup_iters=2, learning_rate=3e-3,
        min_lr=3e-4, compile=False, device="cpu", dtype="float32", wandb_log=False, report=False,
    )
    base.update(overrides)
    return TrainConfig(**base)


def folder_state(folder) -> dict:
    """Every file and folder under `folder` (previous/ included), a file with its bytes: what a start that must
    change nothing leaves as it was."""
    from pathlib import Path

    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(Path(folder).rglob("*"))}


def starts_of(out_dir) -> list[dict]:
    """The start lines of out_dir's metrics.jsonl: one per start of its run that trained or evaluated."""
    return [json.loads(line)["start"] for line in open(os.path.join(out_dir, "metrics.jsonl")) if '"start"' in line]


def config_args(cfg: TrainConfig) -> list[str]:
    """The --key=value arguments that rebuild `cfg` in a train.py subprocess."""
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in vars(cfg).items()]


HANG_S = 1800  # a subprocess's limit: it catches a hang, never a slow machine (a suite beside another on 2 cores)


def run_script(args: list[str], timeout: float = HANG_S, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a python script or module of the repo in a fresh process; output captured as text. The timeout only
    catches hangs."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env, **kw)


def run_script_waiting(args: list[str], timeout: float = HANG_S,
                       env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[float]]:
    """run_script(args) for a script, and every wait it asked time.sleep for, in seconds: it runs (runpy, as
    __main__) in a process whose time.sleep records them, so that a test can say a script gave up without retrying
    and backing off, whatever the machine's speed. Its output is the script's own."""
    fd, waits_file = tempfile.mkstemp(suffix=".waits")
    os.close(fd)
    code = ("import runpy, time\n_sleep, waits = time.sleep, []\n"
            "def sleep(seconds):\n    waits.append(seconds)\n    _sleep(seconds)\n"
            f"time.sleep = sleep\ntry:\n    runpy.run_path({args[0]!r}, run_name='__main__')\n"
            f"finally:\n    open({waits_file!r}, 'w').write(repr(waits))\n")
    try:
        r = run_script(["-c", code, *args[1:]], timeout=timeout, env=env)
        with open(waits_file) as f:
            return r, ast.literal_eval(f.read())
    finally:
        os.remove(waits_file)


def run_in_process(args: list[str], capsys) -> subprocess.CompletedProcess:
    """`python SCRIPT.py ARGS...` (args as run_script takes them) run in this process, the way its __main__ runs
    it (errors.exit_on_user_error(main)), from the repo root, with run_script's (returncode, stdout, stderr): for
    the user-error tests. A fresh interpreter costs ~4 s on 2 cores (torch, and torch._dynamo that torch.optim
    imports); each script keeps tests that run it as a real process."""
    import importlib

    from nanogpt.errors import exit_on_user_error

    script, argv = args[0], args[1:]
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    capsys.readouterr()  # only this run's output
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exit_on_user_error(lambda: module.main(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def hide_module(monkeypatch, name: str) -> None:
    """Until the test ends, `import name` (and its submodules) fails as it does where the package is not installed:
    ModuleNotFoundError naming it (a None in sys.modules stops the import system)."""
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")] + [name]:
        monkeypatch.setitem(sys.modules, key, None)


def wait_for_iter(metrics_path, at_least: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until a running train.py has logged iteration `at_least` (to signal it at a known point)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if os.path.exists(metrics_path):
            iters = [json.loads(l).get("iter", 0) for l in open(metrics_path) if l.strip()]
            if iters and max(iters) >= at_least:
                return
        time.sleep(0.05)
    raise TimeoutError(f"no iter {at_least} in {metrics_path}")


def steps_with_loss_scales(model, opt, scaler, x, ctx, dist, loss_scales: list[float], guard=None) -> list[tuple]:
    """train.train_step on the batch (x, x) once per loss scale, the model's loss multiplied by it (inf or nan
    make an overflow or a non-finite step), with `guard` (step.NonFiniteGuard; None: each step its own). Returns
    (loss, grad norm, applied, parameters unchanged) per step."""
    import torch

    from nanogpt.step import train_step

    scale = {"now": 1.0}

    class Scaled(torch.nn.Module):  # the model, with its loss multiplied
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, idx, targets, **kw):
            logits, loss = self.m(idx, targets, **kw)
            return logits, loss * scale["now"]

    steps = []
    for loss_scale in loss_scales:
        scale["now"] = loss_scale
        before = {k: v.clone() for k, v in model.state_dict().items()}
        f = train_step(Scaled(), opt, scaler, [(x, x)], ctx, TrainConfig(), dist, guard=guard).read()
        loss, norm, applied = f.loss, f.grad_norm, f.applied
        steps.append((loss, norm, applied, all(torch.equal(before[k], v) for k, v in model.state_dict().items())))
    return steps


def json_values():
    """A hypothesis strategy of any JSON value: null, booleans, numbers of any size (nan and inf too: Python's json
    writes them), strings, and lists and objects of them, nested."""
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(min_value=-10**30, max_value=10**30)
               | st.sampled_from([10**400, -10**400])  # past a float's range: float(x) raises OverflowError
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                                  max_size=4),
                        max_leaves=12)
