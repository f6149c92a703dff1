"""A run's metrics: out_dir/metrics.jsonl, a JSON line per logged step, per eval and per start of the run, with the
run's wall time (which continues across resumes); written by train.py through Logger, read by plot.py and report.py.
A line cut short (a kill, a full disk) or edited by hand is skipped by the readers with one warning, and the next
append starts a new line."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import NamedTuple

from nanogpt import files
from nanogpt.errors import UserError
from nanogpt.distributed import Dist
from nanogpt.outdir import METRICS


class Logger:
    """Prints on rank 0; once the start is accepted (start()), appends to out_dir/metrics.jsonl and logs to wandb when
    asked (`wandb`: wandb.init's arguments). Before start() nothing is written: a refused start changes nothing."""

    def __init__(self, dist: Dist, out_dir: str, wandb: dict | None = None):
        self.master, self.out_dir, self.wandb_init = dist.master, out_dir, wandb
        self.path: str | None = None  # metrics.jsonl, once the start is accepted and saves
        self.t_start, self.wandb = time.time(), None

    def continue_from(self, elapsed_s: float) -> None:
        """A resumed run's wall time continues from its checkpoint's, so elapsed_s never runs backwards."""
        self.t_start = time.time() - elapsed_s

    def elapsed(self) -> float:
        return time.time() - self.t_start

    def print(self, msg: str) -> None:
        if self.master:
            print(msg, flush=True)

    def metrics(self, record: dict) -> None:
        if not self.master:
            return
        record = {**record, "elapsed_s": round(self.elapsed(), 3)}  # wall time since the run began, for time-to-loss
        if self.path is not None:
            self._append(record)
        if self.wandb is not None:
            self.wandb.log(record, step=record["iter"])

    def start(self, run_id: str | None, iter_num: int, init_from: str, changes: list[str] | None = None,
              saves: bool = True) -> None:
        """The start is accepted: from here on records are logged, and a start that saves writes a line for itself
        (run id, iteration, how, the settings a resume changed, the command). eval_only writes nothing in out_dir."""
        if not self.master:
            return
        if saves:
            self.path = os.path.join(self.out_dir, METRICS)
            _end_torn_line(self.path)
            self._append({"start": {"run_id": run_id, "iter": iter_num, "init_from": init_from,
                                    "changes": changes or [], "command": " ".join(["python", *sys.argv]),
                                    "time": round(time.time(), 3)},
                          "elapsed_s": round(self.elapsed(), 3)})
        if self.wandb_init is not None:
            import wandb

            self.wandb = wandb.init(**self.wandb_init)

    def _append(self, record: dict) -> None:
        files.append_line(self.path, json.dumps(record) + "\n")


def _end_torn_line(path: str) -> None:
    """A file whose last line was cut short (no newline) gets one, so the next record starts a line of its own."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            torn = size > 0 and f.seek(size - 1) >= 0 and f.read(1) != b"\n"
    except FileNotFoundError:
        return
    except OSError as e:
        raise files.write_failed(path, e) from None
    if torn:
        files.append_line(path, "\n")


_NUMBER = (int, float)
_FLOAT_MAX = int(sys.float_info.max)
# What a record of each kind (the key that marks it) holds, with the types its readers (plot.py, report.py) use
FIELDS = {
    "loss": {"iter": int, "loss": _NUMBER, "elapsed_s": _NUMBER, "tok_s": _NUMBER, "mfu": (*_NUMBER, type(None))},
    "val_loss": {"iter": int, "val_loss": _NUMBER, "train_loss": _NUMBER, "elapsed_s": _NUMBER},
    "hellaswag_acc": {"hellaswag_acc": _NUMBER, "hellaswag_acc_norm": _NUMBER},
}
START_FIELDS = {"iter": int, "init_from": str, "command": str}


def is_record(record) -> bool:
    """Whether a line's JSON is a record as train.py writes it (a JSON object whose fields have their types)."""
    def has(d: dict, fields: dict) -> bool:  # an int past a float's range too is none (its readers plot floats)
        return all(isinstance(d.get(k), t) and not (isinstance(d[k], int) and abs(d[k]) > _FLOAT_MAX)
                   for k, t in fields.items())

    def start(d) -> bool:
        if not isinstance(d, dict) or not has(d, START_FIELDS):
            return False
        changes = d.get("changes", [])  # none in the lines of older runs
        return isinstance(changes, list) and all(isinstance(c, str) for c in changes)

    return (isinstance(record, dict) and all(has(record, FIELDS[kind]) for kind in FIELDS if kind in record)
            and ("start" not in record or start(record["start"])))


def read_records(path: str) -> list[dict]:
    """Every record of a metrics.jsonl; lines that are not JSON or not a record are skipped, named in one warning."""
    records, torn, foreign = [], [], []
    with open(path, encoding="utf-8", errors="replace") as f:  # a byte that is no UTF-8: that line is not JSON
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):  # not JSON, a 5000-digit number, '[' nested 100000 deep
                    torn.append(n)
                    continue
                if is_record(record):
                    records.append(record)
                else:
                    foreign.append(n)
    if torn or foreign:
        why = [f"{_line_numbers(torn)}: not JSON, cut short by a kill or a full disk?"] if torn else []
        why += [f"{_line_numbers(foreign)}: JSON but not a record of train.py, edited by hand?"] if foreign else []
        n = len(torn) + len(foreign)
        print(f"warning: {path}: skipped {n} unreadable line{'s' if n > 1 else ''} ({'; '.join(why)})",
              file=sys.stderr)
    return records


def _line_numbers(numbers: list[int]) -> str:
    more = " ..." if len(numbers) > 5 else ""
    return f"line{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers[:5]))}{more}"


class MetricsLog(NamedTuple):
    """A run's metrics.jsonl, read once: its logged training steps, its evals and its starts."""
    steps: list[dict]
    evals: list[dict]
    starts: list[dict]


def read_metrics(out_dir: str) -> MetricsLog:
    """The run's metrics.jsonl, read (and any unreadable line warned of) once."""
    path = os.path.join(out_dir, METRICS)
    if not os.path.isfile(path):
        raise UserError(f"no {path}: give the out_dir of a train.py run")
    records = read_records(path)
    run = MetricsLog(steps=[r for r in records if "loss" in r], evals=[r for r in records if "val_loss" in r],
                     starts=[r["start"] for r in records if "start" in r])
    if not run.steps and not run.evals:
        raise UserError(f"{path} has no losses yet: plot after the first logged step")
    return run
