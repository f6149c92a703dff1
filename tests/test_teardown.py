"""
The end of a 2-rank gloo run (DDP and FSDP, under torchrun), on every path: a finished run, eval_only, a resume with
nothing to train, a stop by SIGTERM. Each must end in the same order (the last save, a barrier, the process group
destroyed) with the group really freed: its destructor is what stops gloo's worker threads, and a worker still
running when the interpreter exits can free a collective's work there, which takes the GIL; Python then ends that
thread inside a C++ destructor and the rank aborts ("terminate called without an active exception", SIGABRT, torchrun
exit 1) in a few percent of ends on a busy machine. The runs go beside a CPU busy loop, and each rank reports the
gloo threads still alive after train.main: none, or the race is there, whether or not this run lost it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from nanogpt import checkpoint_sharded
from helpers import HANG_S, ROOT, config_args, make_char_dataset, run_script, tiny_config

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc (Linux)")

PROBE = """
import os, signal, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import train
from nanogpt.errors import exit_on_user_error
from signal_at_step import signal_during_step

def gloo_threads():
    names = (open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return sorted(n for n in names if "gloo" in n)

args = sys.argv[1:]
if args[0].startswith("--sigterm_at_step="):  # rank 1 alone gets it, as when one node is preempted first
    if os.environ["RANK"] == "1":
        signal_during_step(signal.SIGTERM, int(args[0].split("=")[1]))
    args = args[1:]
try:
    exit_on_user_error(lambda: train.main(args))
finally:
    os.write(2, f"rank {{os.environ['RANK']}}: gloo threads after the run: {{gloo_threads()}}\\n".encode())
"""


@pytest.fixture(scope="module")
def busy_cpu():
    """A CPU busy loop beside the runs: ranks and gloo's threads wait for a core, as on a loaded machine."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield
    proc.kill()
    proc.wait()


@pytest.fixture()
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE.format(root=ROOT, tests=os.path.join(ROOT, "tests")))
    return path


def run_to_the_end(probe, cfg, *extra) -> subprocess.CompletedProcess:
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe), *extra,
                    *config_args(cfg)], timeout=HANG_S)
    assert "terminate called" not in r.stderr, r.stderr[-3000:]
    for rank in (0, 1):  # the group was freed, so its threads were joined before the interpreter's exit
        assert f"rank {rank}: gloo threads after the run: []" in r.stderr, r.stderr[-3000:]
    return r


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_every_end_of_a_2_rank_run_frees_the_process_group_and_exits_cleanly(busy_cpu, probe, tmp_path, parallelism):
    data, out = tmp_path / "tinychar", tmp_path / "run"
    make_char_dataset(data, n_chars=20_000)
    run = dict(max_iters=4, eval_interval=2, eval_iters=2, log_interval=1, gradient_accumulation_steps=2,
               parallelism=parallelism)
    r = run_to_the_end(probe, tiny_config(data, out, **run))  # the last save (rank 0's alone under DDP), the end
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = "ckpt_sharded" if parallelism == "fsdp" else "ckpt.pt"
    assert (out / ckpt).exists()
    # no save: DDP resumes with nothing to train (the resumes), FSDP evaluates its checkpoint only
    again = dict(init_from="resume") if parallelism == "ddp" else dict(init_from="resume", eval_only=True)
    r = run_to_the_end(probe, tiny_config(data, out, **run, **again))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 4: train loss" in r.stdout
    if parallelism == "ddp":  # DDP's stop is the same path, with no sharded model to let go (test_faults signals it)
        return
    # SIGTERM on rank 1 during its 3rd step: every rank saves and stops after iter 3 with the message, and exits 143
    # (a clean stop); torchrun reports 1 for workers that did not exit 0
    r = run_to_the_end(probe, tiny_config(data, out, **{**run, "max_iters": 50}), "--sigterm_at_step=3")
    assert r.returncode == 1 and "stopped by SIGTERM after iter 3; checkpoint saved" in r.stderr, r.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*143", r.stderr), r.stderr[-3000:]
    assert checkpoint_sharded.read_train_state(str(out / ckpt))["iter_num"] == 3
