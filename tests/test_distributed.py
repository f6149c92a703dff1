"""distributed.py and DDP under real torchrun (gloo, CPU): gradients all-reduced only on the last micro-step
(no_sync), the barrier that keeps a rank from exiting while rank 0 still writes its checkpoint, and a dropout
RNG of each rank's own, fresh and resumed. Each test runs train.main through a small wrapper that observes one
thing and prints it."""
from __future__ import annotations

import pytest

import re
import subprocess
import sys

from nanogpt.checkpoint_file import load_checkpoint
from helpers import HANG_S, ROOT, config_args, tiny_config

WRAPPER = """
import os, sys, time, hashlib
sys.path.insert(0, {root!r})
import torch
import train
from nanogpt import checkpoint_file
from nanogpt.errors import exit_on_user_error
rank = int(os.environ["RANK"])
what = os.environ["OBSERVE"]


def say(line):  # one write per line: both ranks share the pipe, and print writes a line's end apart, unbuffered
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()


if what == "allreduce":  # count the gradient all-reduces DDP runs
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    calls = [0]

    class CountingDDP(train.DDP):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

            def hook(group, bucket):
                calls[0] += 1
                return allreduce_hook(group, bucket)

            self.register_comm_hook(None, hook)

    train.DDP = CountingDDP
if what == "slow_save" and rank == 0:  # rank 0's save takes seconds, as a big model's does
    real_save = checkpoint_file.save_run_checkpoint

    def slow(*args, **kwargs):
        time.sleep(2)
        out = real_save(*args, **kwargs)
        say(f"rank 0 saved at {{time.time()}}")
        return out

    checkpoint_file.save_run_checkpoint = slow
if what in ("slow_save",) and rank == 1:  # SIGTERM to rank 1 alone, during its 3rd step
    import signal
    real_step, n = train.train_step, [0]

    def step(*args, **kwargs):
        n[0] += 1
        if n[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    train.train_step = step
if what == "rng":  # the dropout RNG state each rank starts its first step with
    real_step, seen = train.train_step, []

    def step(*args, **kwargs):
        if not seen:
            seen.append(1)
            say(f"rank {{rank}} rng " + hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest())
        return real_step(*args, **kwargs)

    train.train_step = step
try:
    exit_on_user_error(lambda: train.main(sys.argv[1:]))
finally:
    if what == "allreduce":
        say(f"rank {{rank}} allreduce calls {{calls[0]}}")
    say(f"rank {{rank}} exits at {{time.time()}}")
"""


def torchrun(tmp_path, observe: str, cfg, *torchrun_args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "observe.py"
    script.write_text(WRAPPER.format(root=ROOT))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *torchrun_args, str(script), *config_args(cfg)], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S, env={**__import__("os").environ, "OBSERVE": observe})


@pytest.mark.slow
def test_ddp_all_reduces_the_gradients_once_per_step_whatever_the_micro_steps(data_dir, tmp_path):
    """With 2 micro-steps per rank, the first runs under no_sync: as many all-reduces as with 1 micro-step per rank."""
    counts = {}
    for accum in (2, 4):  # 1 and 2 micro-steps per rank
        cfg = tiny_config(data_dir, tmp_path / f"a{accum}", max_iters=3, eval_interval=1000, dropout=0.0,
                          gradient_accumulation_steps=accum, report=False)
        r = torchrun(tmp_path, "allreduce", cfg)
        assert r.returncode == 0, r.stderr[-3000:]
        counts[accum] = sorted(int(n) for n in re.findall(r"allreduce calls (\d+)", r.stdout))
    assert len(counts[2]) == 2 and counts[2][0] > 0
    assert counts[4] == counts[2]


@pytest.mark.slow
def test_no_rank_exits_while_rank_0_still_writes_the_stops_checkpoint(data_dir, tmp_path):
    """A SIGTERM to rank 1 alone; rank 0's save takes seconds: rank 1 waits at the barrier and exits only after
    rank 0's checkpoint is written (a rank that exits first lets torchrun, or a scheduler that sees one process end,
    stop the job while rank 0 still writes)."""
    cfg = tiny_config(data_dir, tmp_path / "run", max_iters=50, eval_interval=1000, dropout=0.0,
                      gradient_accumulation_steps=2, report=False)
    r = torchrun(tmp_path, "slow_save", cfg)
    assert "stopped by SIGTERM after iter 3; checkpoint saved" in r.stderr, r.stderr[-3000:]
    assert load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))["iter_num"] == 3
    saved = float(re.search(r"rank 0 saved at ([\d.]+)", r.stdout).group(1))
    exits = float(re.search(r"rank 1 exits at ([\d.]+)", r.stdout).group(1))
    assert exits >= saved, (exits, saved)


@pytest.mark.slow
def test_each_ddp_rank_draws_its_own_dropout_fresh_and_resumed(data_dir, tmp_path):
    cfg = tiny_config(data_dir, tmp_path / "run", max_iters=4, eval_interval=2, dropout=0.1,
                      gradient_accumulation_steps=2, report=False)
    for start in ("scratch", "resume"):
        if start == "resume":
            cfg = tiny_config(data_dir, tmp_path / "run", max_iters=6, eval_interval=2, dropout=0.1,
                              gradient_accumulation_steps=2, report=False, init_from="resume")
        r = torchrun(tmp_path, "rng", cfg)
        assert r.returncode == 0, r.stderr[-3000:]
        states = dict(re.findall(r"rank (\d) rng (\w+)", r.stdout))
        assert len(states) == 2 and states["0"] != states["1"], (start, states)


def test_a_torchrun_restart_keeps_its_process_groups_keys_apart_from_the_failed_attempts(monkeypatch):
    """torchrun's agent store outlives an attempt with the failed attempt's keys in it (each rank's gloo address):
    a restarted rank that read its peer's old address waited forever ("Gloo connectFullMesh failed ... timed out
    connecting: Connection refused"). A restart's group keeps its keys under the attempt's own prefix."""
    import socket

    import torch.distributed as torch_dist

    from nanogpt import distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent_store = torch_dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    seen = {}
    monkeypatch.setattr(torch_dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for key, value in {**env, "TORCHELASTIC_RESTART_COUNT": "2"}.items():
        monkeypatch.setenv(key, value)
    distributed.setup_distributed("cpu")
    seen["store"].set("rank_0", "address")  # as gloo publishes a rank's address
    assert agent_store.check(["/attempt_2/rank_0"]) and not agent_store.check(["rank_0"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a first attempt: torch's own rendezvous, as before
    seen.clear()
    distributed.setup_distributed("cpu")
    assert "store" not in seen and seen["backend"] == "gloo"


@pytest.mark.slow
def test_ranks_whose_settings_differ_are_refused_in_one_line_before_anything_changes(data_dir, tmp_path):
    """A review's reproduction: a config file that reads RANK (max_iters 4 on rank 0, 6 on rank 1) left rank 1
    waiting forever in a collective rank 0 never made; n_layer that differs ended in DDP's own RuntimeError. Every
    rank now compares its resolved settings with the others' first: one line on each, naming the keys, and no
    out_dir made."""
    config = tmp_path / "by_rank.py"
    config.write_text('import os\nmax_iters = 4 if os.environ.get("RANK") == "0" else 6\n'
                      'n_layer = 2 if os.environ.get("RANK") == "0" else 3\n')
    out = tmp_path / "out"
    cfg = tiny_config(data_dir, out, gradient_accumulation_steps=2)
    args = [a for a in config_args(cfg) if not a.startswith(("--max_iters=", "--n_layer="))]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                        *args, str(config)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert lines == ["error: the ranks' settings differ (n_layer: 2 vs 3; max_iters: 4 vs 6): give every rank the same "
                     "config files and --key=value overrides"] * 2, r.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
def test_micro_steps_that_do_not_split_over_the_ranks_are_refused_on_every_rank(data_dir, tmp_path):
    """gradient_accumulation_steps=3 on 2 ranks would train 1 micro-batch per rank (2 a step) while logging 3's
    tokens: one line, exit status 2, and no out_dir made. (The rank that refuses first ends the job: torchrun may
    stop the other before it says the same.)"""
    out = tmp_path / "out"
    r = torchrun(tmp_path, "nothing", tiny_config(data_dir, out, max_iters=2, gradient_accumulation_steps=3))
    lines = {ln for ln in r.stderr.splitlines() if ln.startswith("error: ")}
    assert lines == {"error: gradient_accumulation_steps=3 is not divisible by the 2 DDP processes: make it a multiple "
                     "of 2"}, r.stderr[-3000:]
    assert "exitcode  : 2 " in r.stderr and not out.exists(), r.stderr[-3000:]
