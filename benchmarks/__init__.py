"""Studies and side-by-side benchmarks beside bench.py, built on it and nanogpt/, never the reverse; they run bench.py
in fresh processes and read back its result JSON (run_child), their one interface to it."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from typing import TypeVar

from configurator import configure, exit_on_help, script_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: bench.py and train.py

T = TypeVar("T")


def load_note(fraction: float | None) -> str:
    """A warning when other processes took a noticeable share of the CPUs."""
    if fraction is None or fraction < 0.1:
        return ""
    return f"busy machine: other processes took {fraction:.0%} of the CPUs"


def markdown_table(header: list[str], rows: list[list[str]], align: str) -> str:
    """A Markdown table (pastes into the README as it is); align: one 'l' or 'r' per column."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if a == "r" else ":" + "-" * (w + 1) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def median_ms(step, repeats: int, device: str) -> float:
    """The median ms of `repeats` calls of step(), on the device's own timeline."""
    from nanogpt.device import DeviceClock, synchronize

    clock, marks = DeviceClock(device), []
    for _ in range(repeats):
        a = clock.mark()
        step()
        marks.append((a, clock.mark()))
    synchronize(device)
    return statistics.median(clock.ms(a, b) for a, b in marks)


def sdpa(backend: str, vocab_padding_multiple: int = 1) -> dict:
    return {"attention": "sdpa", "sdpa_backend": backend, "vocab_padding_multiple": vocab_padding_multiple}


def override_args(overrides: dict) -> list[str]:
    """--key=value arguments that set `overrides` (strings quoted, so '--dtype=float32' stays a string)."""
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in overrides.items()]


def run_child(argv: list[str], overrides: dict, result_path: str, script: str = "bench.py") -> dict:
    """One bench run in a fresh process (same interpreter and environment, so the same allocator and threads): its
    result JSON, or status "n/a" and the reason for a user error (e.g. a kernel the device lacks), "failed" else."""
    cmd = [sys.executable, os.path.join(ROOT, script), *argv, *override_args(overrides), f"--result_json={result_path}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall_s = round(time.perf_counter() - t0, 1)  # the whole process: start-up, model, compile, steps
    command = " ".join([f"python {script}", *argv, *override_args(overrides)])
    if proc.returncode == 0:
        with open(result_path) as f:
            result = json.load(f)
        result.pop("config", None)  # the command rebuilds it
        return {"status": "ok", "command": command, "wall_s": wall_s, **result}
    lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
    errors = [line for line in lines if line.startswith("error: ")]
    if proc.returncode == 2 and errors:
        return {"status": "n/a", "reason": errors[-1][len("error: "):], "command": command}
    print(f"  {command} failed:\n    " + "\n    ".join(lines[-8:]), file=sys.stderr)
    return {"status": "failed", "reason": f"failed (exit {proc.returncode}): {lines[-1]}", "command": command}


def study_config(defaults: T, argv: list[str], bench_defaults) -> tuple[T, list[str]]:
    """A study's own keys (the fields of `defaults`) from argv, and the rest, for bench.load_config and the child
    runs. --help lists both (`bench_defaults`: the bench.BenchConfig() the study passes in)."""
    exit_on_help(argv, script_doc(defaults), defaults, bench_defaults)
    own = {f.name for f in fields(defaults)}
    mine = [a for a in argv if a.startswith("--") and a[2:].split("=")[0] in own]
    return configure(defaults, mine), [a for a in argv if a not in mine]
