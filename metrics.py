"""
A run's metrics, in one place: out_dir/metrics.jsonl (a JSON line per logged step and per eval, with the run's wall
time, which continues across resumes), written by train.py through Logger (which also prints on rank 0 and logs to
wandb when asked) and read by plot.py and report.py.

Imports common.py and distributed.py only; never a script.
"""
from __future__ import annotations

import itertools
import json
import netrc
import os
import time
from dataclasses import asdict
from urllib.parse import urlsplit

from common import UserError, optional_import
from distributed import Dist

METRICS_NAME = "metrics.jsonl"


def wandb_problem(cfg) -> str | None:
    """Why wandb_log=True would fail, asked before anything slow: wandb not installed, or (logging online) no API key,
    where wandb.init looks for one: WANDB_API_KEY (or WANDB_IDENTITY_TOKEN_FILE), else the netrc entry for its
    host that `wandb login` writes (NETRC, ~/.netrc or ~/_netrc). Without them wandb.init raises once the run is
    under way."""
    if not cfg.wandb_log:
        return None
    try:
        optional_import("wandb", "wandb_log=True")
    except UserError as e:
        return f"{e} (or --wandb_log=False)"
    if os.environ.get("WANDB_MODE", "online").lower() in ("offline", "dryrun", "disabled"):
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    candidates = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    path = next((p for p in map(os.path.expanduser, candidates) if os.path.isfile(p)), None)
    where = "no netrc file"
    if path is not None:
        try:
            if netrc.netrc(path).authenticators(host):
                return None
            where = f"no entry for {host} in {path}"
        except (OSError, netrc.NetrcParseError) as e:
            where = f"{path} is unreadable ({e})"
    return (f"wandb_log=True but wandb has no API key (no WANDB_API_KEY, {where}): run `wandb login` once, or log "
            f"offline with WANDB_MODE=offline (upload later with `wandb sync`), or set --wandb_log=False")


class Logger:
    """Prints on rank 0 and appends JSON lines to out_dir/metrics.jsonl (and wandb when asked). A resumed run
    appends to its run's file; a new run in a folder that has one starts its own, the old file kept as
    metrics.<N>.jsonl (the first free N)."""

    def __init__(self, cfg, dist: Dist):
        self.master = dist.master
        self.path = os.path.join(cfg.out_dir, METRICS_NAME)
        if self.master and cfg.init_from != "resume" and os.path.exists(self.path):
            names = (os.path.join(cfg.out_dir, f"metrics.{n}.jsonl") for n in itertools.count(1))
            kept = next(name for name in names if not os.path.exists(name))
            os.replace(self.path, kept)
            self.print(f"a new run in {cfg.out_dir}: the previous run's metrics are kept in {kept}")
        self.t_start = time.time()
        self.wandb = None
        if self.master and cfg.wandb_log:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))

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
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=record["iter"])


def read_metrics(out_dir: str) -> tuple[list[dict], list[dict]]:
    """The run's logged training steps (iter, loss, elapsed_s) and its evals (iter, val_loss, elapsed_s)."""
    path = os.path.join(out_dir, METRICS_NAME)
    if not os.path.isfile(path):
        raise UserError(f"no {path}: give the out_dir of a train.py run")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    if not steps and not evals:
        raise UserError(f"{path} has no losses yet: plot after the first logged step")
    return steps, evals
