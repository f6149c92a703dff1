"""FSDP2 (parallelism="fsdp") on the CPU: 2 gloo processes under torchrun against one process, sharded checkpoints,
activation checkpointing. Expected values come from the plain one-process run (no FSDP, no recompute), and the
memory line's from the bytes each rank's tensors hold. parallel.py's own tests: tests/test_parallel.py; checkpoint_sharded.py's:
tests/test_checkpoint_sharded.py."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from dataclasses import replace

import pytest
import torch

from nanogpt import checkpoints
from nanogpt import checkpoint_sharded, outdir
import convert_sharded
from nanogpt import parallel
from nanogpt.checkpoint_file import load_checkpoint
from helpers import HANG_S, ROOT, config_args, run_script, tiny_config
from test_checkpoint_sharded import KILL_CHILD
from train import train

# float32 on the CPU: FSDP computes the same sums in another order (reduce-scatter of 2 halves, sharded AdamW)
TOL = 1e-5


def torchrun(cfg, nproc: int = 2, script: str = "train.py") -> subprocess.CompletedProcess:
    r = run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
                    *config_args(cfg)], timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


# train.py's main, measuring after every micro-step the bytes each rank holds in tensors: its parameter shards,
# the optimizer's moments, and the gradients wherever they are: the sharded ones (p.grad), and the unsharded ones
# FSDP2 keeps on its FSDPParams between no-sync micro-steps (the unsharded parameter's .grad when computing in
# float32; unsharded_accumulated_grad, in the float32 reduce dtype, when computing in bf16). Bytes are those of
# the tensors' storages, each storage once. Each rank prints its peak.
MEASURING_TRAIN = """
import contextlib, os, sys
sys.path.insert(0, {root!r})
import train
from nanogpt import parallel
from nanogpt.errors import exit_on_user_error
from torch.distributed.fsdp import FSDPModule

def unsharded_grads(model):
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    yield from (g for g in (p._unsharded_param.grad, p.unsharded_accumulated_grad) if g is not None)

def held_bytes(tensors) -> int:
    storages = {{}}
    for t in tensors:
        s = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())

held, optimizers = [], []
step, parallel_sync = train.train_step, parallel.gradient_sync

def train_step(model, optimizer, *args, **kwargs):
    optimizers[:] = [optimizer]
    return step(model, optimizer, *args, **kwargs)

@contextlib.contextmanager
def gradient_sync(model, dist, sync: bool):
    with parallel_sync(model, dist, sync):
        yield
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None] + list(unsharded_grads(model))
    moments = [t for opt in optimizers[0].optimizers.values() for state in opt.state.values()
               for name, t in state.items() if name != "step"]  # step: one scalar per tensor
    held.append(held_bytes(params) + held_bytes(grads) + held_bytes(moments))

train.train_step, parallel.gradient_sync = train_step, gradient_sync
try:
    exit_on_user_error(lambda: train.main(sys.argv[1:]))
finally:
    print(f"measured on rank {{os.environ['RANK']}}: peak {{max(held)}} bytes", flush=True)
"""


def measured_peaks(r: subprocess.CompletedProcess) -> dict[int, int]:
    return {int(rank): int(n) for rank, n in re.findall(r"measured on rank (\d+): peak (\d+) bytes", r.stdout)}


@pytest.fixture()
def measuring_train(tmp_path) -> str:
    script = tmp_path / "measuring_train.py"
    script.write_text(MEASURING_TRAIN.format(root=ROOT))
    return str(script)


def sharded_params(out_dir) -> dict[str, torch.Tensor]:
    model, _ = checkpoint_sharded.load_sharded_as_full(str(out_dir / outdir.SHARDED))
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def memory_bytes(stdout: str) -> int:
    return int(re.search(r"memory per rank: .*; (\d+) bytes\)", stdout).group(1))


def losses(out_dir, key: str = "loss") -> list[float]:
    return [r[key] for r in map(json.loads, open(out_dir / "metrics.jsonl")) if key in r]


@pytest.mark.slow
@pytest.mark.parametrize("micro_steps_per_rank, checkpointing", [(1, False), (2, True)])
def test_fsdp_on_2_ranks_equals_one_process_with_the_same_global_batch(
    data_dir, tmp_path, measuring_train, micro_steps_per_rank, checkpointing
):
    # eval_iters=3 over 2 ranks: one rank runs a batch more, the other repeats one uncounted (FSDP's forwards
    # are collective)
    run = dict(gradient_accumulation_steps=2 * micro_steps_per_rank, max_iters=6, lr_decay_iters=6, eval_interval=3,
               eval_iters=3, log_interval=1, dropout=0.0)
    train(tiny_config(data_dir, tmp_path / "single", **run))
    r = torchrun(tiny_config(data_dir, tmp_path / "fsdp", **run, parallelism="fsdp",
                             activation_checkpointing=checkpointing), script=measuring_train)
    steps = {1: "1 micro-step", 2: "2 micro-steps"}[micro_steps_per_rank]
    assert f"tokens per iteration: {256 * micro_steps_per_rank:,} ({steps} x 2 ranks" in r.stdout
    diff = max_diff(load_checkpoint(str(tmp_path / "single" / "ckpt.pt"))["model"], sharded_params(tmp_path / "fsdp"))
    print(f"max |param diff| after 6 AdamW steps, {micro_steps_per_rank} micro-steps/rank, AC={checkpointing}: {diff:.2e}")
    assert diff < TOL, diff
    for key in ("loss", "val_loss", "train_loss"):
        assert losses(tmp_path / "fsdp", key) == pytest.approx(losses(tmp_path / "single", key), abs=TOL), key
    # the memory line (rank 0's) is what rank 0's tensors held at their peak: with 2 micro-steps per rank, the
    # whole model's unsharded gradients of the no-sync micro-step
    assert memory_bytes(r.stdout) == measured_peaks(r)[0]
    assert ("(whole model, unsharded" in r.stdout) == (micro_steps_per_rank > 1)


RESUME = dict(gradient_accumulation_steps=2, max_iters=8, lr_decay_iters=8, eval_interval=4, log_interval=1,
              dropout=0.0)


@pytest.mark.slow
def test_resume_from_1_to_2_ranks_and_from_ckpt_pt_continues_the_uninterrupted_run(data_dir, tmp_path):
    reference = train(tiny_config(data_dir, tmp_path / "ref", **RESUME))
    ref_params = reference["model"].state_dict()
    # 1 rank (FSDP, a process group of one) for 4 steps, a sharded save, then 2 ranks for the other 4
    train(tiny_config(data_dir, tmp_path / "run", **{**RESUME, "max_iters": 4}, parallelism="fsdp"))
    torchrun(tiny_config(data_dir, tmp_path / "run", **RESUME, parallelism="fsdp", init_from="resume"))
    assert losses(tmp_path / "run")[-1] == pytest.approx(losses(tmp_path / "ref")[-1], abs=TOL)
    diff = max_diff(ref_params, sharded_params(tmp_path / "run"))
    print(f"resume 1 -> 2 ranks: max |param diff| {diff:.2e}")
    assert diff < TOL
    # the conversion to one ckpt.pt: logits equal the sharded model's, and the uninterrupted run's within TOL
    convert_sharded.main([str(tmp_path / "run" / outdir.SHARDED)])  # python convert_sharded.py OUT_DIR/ckpt_sharded
    converted = load_checkpoint(str(tmp_path / "run" / "ckpt.pt"))
    assert converted["iter_num"] == 8 and converted["optimizer"]["state"]
    idx = torch.randint(converted["model_args"]["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    gathered, _ = checkpoint_sharded.load_sharded_as_full(str(tmp_path / "run" / outdir.SHARDED))
    from nanogpt.checkpoint_file import model_from_checkpoint

    from sample import SampleConfig, load_model

    sampled, _ = load_model(SampleConfig(out_dir=str(tmp_path / "run"), ckpt=outdir.SHARDED, device="cpu"))
    models = (model_from_checkpoint(converted), gathered, sampled, reference["model"].eval())
    # the last position's logits and the loss over all positions (training's fused path)
    logits = [torch.cat([m.eval()(idx)[0].flatten(), m(idx, idx)[1].view(1)]) for m in models]
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    logits = logits[:2] + logits[3:]
    assert (logits[0] - logits[2]).abs().max() < 1e-4
    # a one-process ckpt.pt resumed under FSDP: the optimizer's whole tensors are sharded on load
    train(tiny_config(data_dir, tmp_path / "plain", **{**RESUME, "max_iters": 4}))
    resumed = train(tiny_config(data_dir, tmp_path / "plain", **RESUME, parallelism="fsdp", init_from="resume"))
    assert resumed["last_loss"] == pytest.approx(reference["last_loss"], abs=TOL)
    assert max_diff(ref_params, sharded_params(tmp_path / "plain")) < TOL


@pytest.mark.slow
def test_sigterm_under_fsdp_saves_every_shard_and_resume_on_1_rank_continues(data_dir, tmp_path):
    run = {**RESUME, "max_iters": 16, "lr_decay_iters": 16, "eval_interval": 1000}
    reference = train(tiny_config(data_dir, tmp_path / "ref", **run))
    cfg = tiny_config(data_dir, tmp_path / "run", **run, parallelism="fsdp")
    # the signal reaches rank 1 only, during its 4th step, as when one node is preempted first (injected at that step
    # by tests/signal_at_step.py, never raced against the run)
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "tests/signal_at_step.py",
                    "SIGTERM", "4", "1", *config_args(cfg)], timeout=HANG_S)
    err = r.stderr
    assert r.returncode != 0
    assert f"checkpoint saved: resume with python train.py --init_from=resume --out_dir={tmp_path / 'run'}" in err
    folder = tmp_path / "run" / outdir.SHARDED
    stopped_at = checkpoint_sharded.read_train_state(str(folder))["iter_num"]
    assert stopped_at == 4, err[-2000:]
    assert sorted(f for f in os.listdir(folder) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # saved on 2 ranks, resumed in one process (FSDP with a group of one)
    resumed = train(tiny_config(data_dir, tmp_path / "run", **run, parallelism="fsdp", init_from="resume"))
    assert resumed["iter_num"] == 16
    assert resumed["last_loss"] == pytest.approx(reference["last_loss"], abs=TOL)
    diff = max_diff(reference["model"].state_dict(), sharded_params(tmp_path / "run"))
    print(f"SIGTERM at iter {stopped_at} on 2 ranks, resume on 1: max |param diff| {diff:.2e}")
    assert diff < TOL


ASYNC = {**RESUME, "max_iters": 8, "lr_decay_iters": 8, "eval_interval": 1000, "checkpoint_interval": 2}


@pytest.mark.slow
def test_async_saves_on_2_ranks_stop_and_resume_as_the_uninterrupted_run(data_dir, tmp_path):
    """Two ranks whose saves are written in the background (a group of their own beside the training's), a SIGTERM
    to rank 1 at iter 5 (the save of iter 4 possibly still in flight), a resume to the end, also in the background:
    the weights of the uninterrupted one-process run, and one folder left."""
    reference = train(tiny_config(data_dir, tmp_path / "ref", **ASYNC))
    cfg = tiny_config(data_dir, tmp_path / "run", **ASYNC, parallelism="fsdp", async_save=True)
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    os.path.join("tests", "signal_at_step.py"), "SIGTERM", "5", "1", *config_args(cfg)])
    assert r.returncode != 0 and "stopped by SIGTERM after iter 5; checkpoint saved" in r.stderr, r.stderr[-3000:]
    assert re.findall(r"saved sharded checkpoint at iter (\d+)", r.stdout) == ["2", "4", "5"], r.stdout[-3000:]
    assert "iter 4 to" in r.stdout and "beside training" in r.stdout
    # the saves of iters 2 and 4 staged on the training thread and written beside training; the stop's, on the thread
    assert len(re.findall(r"in the background \(staged in [\d.]+ s\)", r.stdout)) == 2, r.stdout[-3000:]
    assert len(re.findall(r"written in [\d.]+ s beside training", r.stdout)) == 2, r.stdout[-3000:]
    assert re.findall(r"saved sharded checkpoint at iter (\d+) to \S+ in [\d.]+ s", r.stdout) == ["5"], r.stdout[-3000:]
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                    *config_args(replace(cfg, init_from="resume"))])
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.findall(r"saved sharded checkpoint at iter (\d+)", r.stdout) == ["6", "8"], r.stdout[-3000:]
    diff = max_diff(reference["model"].state_dict(), sharded_params(tmp_path / "run"))
    print(f"async saves, SIGTERM at iter 5 on 2 ranks, resume: max |param diff| {diff:.2e}")
    assert diff < TOL
    assert sorted(f for f in os.listdir(tmp_path / "run") if f.startswith("ckpt")) == [
        "ckpt_sharded", "ckpt_sharded_0000008_0"]


@pytest.mark.slow
def test_a_kill_after_a_background_save_is_linked_resumes_from_it_exactly(data_dir, tmp_path):
    """SIGKILL right after the save of iter 4, written in the background, was linked (training went on meanwhile):
    the resume starts at iter 4 and ends with the uninterrupted run's weights."""
    reference = train(tiny_config(data_dir, tmp_path / "ref", **ASYNC))
    out = tmp_path / "run"
    child = KILL_CHILD.replace('max_iters=4, eval_interval=2, parallelism="fsdp"', "**{run!r}").format(
        root=ROOT, tests=os.path.join(ROOT, "tests"), data=str(data_dir), out=str(out),
        run={**ASYNC, "parallelism": "fsdp", "async_save": True})
    r = subprocess.run([sys.executable, "-c", child, "after_link"], capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    # training went on while the save was written: the step of iter 4 (the 5th) ran before the save was linked
    assert int(re.search(r"steps run: (\d+)", r.stdout).group(1)) > 4, r.stdout[-2000:]
    assert checkpoints.find_checkpoint(str(out), prefer_sharded=True).read()["iter_num"] == 4
    resumed = train(tiny_config(data_dir, out, **ASYNC, parallelism="fsdp", async_save=True, init_from="resume"))
    assert resumed["iter_num"] == 8
    diff = max_diff(reference["model"].state_dict(), sharded_params(out))
    print(f"SIGKILL after the background save of iter 4, resume: max |param diff| {diff:.2e}")
    assert diff < TOL


@pytest.mark.slow
def test_the_memory_line_counts_the_unsharded_float32_gradients_of_bf16_accumulation(data_dir, tmp_path,
                                                                                      measuring_train):
    """bf16 compute: FSDP accumulates the no-sync micro-steps' gradients in its float32 reduce dtype, not in bf16
    (which would be measured 2 bytes per element smaller). Each rank's measured peak is the line's figure (rank
    0's; rank 1's shards are the same size here)."""
    r = torchrun(tiny_config(data_dir, tmp_path / "run", parallelism="fsdp", dtype="bfloat16",
                             gradient_accumulation_steps=4, max_iters=2, eval_interval=2), script=measuring_train)
    assert measured_peaks(r) == {0: memory_bytes(r.stdout), 1: memory_bytes(r.stdout)}
    assert "(whole model, unsharded" in r.stdout


@pytest.mark.slow
def test_init_from_gpt2_weights_loads_them_once_then_shards(data_dir, tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    folder = tmp_path / "tiny-gpt2"
    vocab = json.loads((data_dir / "meta.json").read_text())["vocab_size"]  # a char model in HF's format: the
    # dataset's tokenizer (GPT-2's vocabulary on char data is refused: tests/test_checkpoints.py)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=vocab))
    hf.save_pretrained(folder)
    run = dict(init_from=str(folder), max_iters=2, eval_interval=2, dropout=0.0)
    plain = train(tiny_config(data_dir, tmp_path / "plain", **run))
    # count the reads of the HF weights, and keep the weights of the model handed to sharding
    reads, handed = [], []
    read, shard = GPT2LMHeadModel.from_pretrained, parallel.shard_model

    def counted_read(*args, **kwargs):
        reads.append(args)
        return read(*args, **kwargs)

    def kept_shard(model, *args, **kwargs):
        handed.append({name: t.clone() for name, t in model.state_dict().items()})
        return shard(model, *args, **kwargs)

    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained", staticmethod(counted_read))
    monkeypatch.setattr(parallel, "shard_model", kept_shard)
    fsdp = train(tiny_config(data_dir, tmp_path / "fsdp", **run, parallelism="fsdp"))
    assert reads == [(str(folder),)]  # once (this process is the one rank)
    assert len(handed) == 1  # sharded once, and what was sharded are the saved weights (wpe cropped to block 32)
    assert torch.equal(handed[0]["transformer.wte.weight"][:vocab], hf.transformer.wte.weight.detach())
    assert torch.equal(handed[0]["transformer.wpe.weight"], hf.transformer.wpe.weight.detach()[:32])
    for key in ("val_loss", "train_loss", "last_loss"):  # the evaluation at iter 0 ran on the imported weights
        assert fsdp[key] == pytest.approx(plain[key], abs=TOL), key
    assert losses(tmp_path / "fsdp", "val_loss")[0] == pytest.approx(losses(tmp_path / "plain", "val_loss")[0], abs=TOL)


NAN_ON_RANK_1 = """
import os, sys
sys.path.insert(0, {root!r})
import train
from nanogpt.errors import exit_on_user_error
from model import GPT

forward, calls = GPT.forward, [0]
def poisoned(self, idx, targets=None, **kw):  # rank 1's loss of iteration 3 is NaN; rank 0's stays finite
    logits, loss = forward(self, idx, targets, **kw)
    if self.training and os.environ["RANK"] == "1":
        calls[0] += 1
        if calls[0] == 4:
            loss = loss * float("nan")
    return logits, loss
GPT.forward = poisoned
exit_on_user_error(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_nonfinite_loss_on_one_rank_stops_every_rank_at_that_step(data_dir, tmp_path):
    script = tmp_path / "nan_on_rank_1.py"
    script.write_text(NAN_ON_RANK_1.format(root=ROOT))
    cfg = tiny_config(data_dir, tmp_path / "run", max_iters=8, eval_interval=1000, parallelism="fsdp",
                      gradient_accumulation_steps=2)
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
                    *config_args(cfg)], timeout=HANG_S)
    assert r.returncode != 0
    # the loss is averaged over ranks before the check, so both ranks see it and stop with the same error
    assert r.stderr.count("error: non-finite loss at iter 4 ") == 2, r.stderr[-3000:]  # as the log counts: the 4th step


@pytest.mark.slow
def test_the_scripts_start_without_importing_fsdp_and_find_its_shards_once_imported():
    """FSDP and DTensor took 1.2 s of every sample.py start on 2 cores: the scripts' modules import them only where
    a run shards (train.py and bench.py still get them through torch.optim, which imports torch._dynamo);
    distributed.is_dtensor then still tells a shard from a tensor."""
    probe = ("import sys, bench, sample, train, torch; from nanogpt import distributed, parallel; "
             "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor') if m in sys.modules)); "
             "import torch.distributed as d; "
             "d.init_process_group('gloo', store=d.HashStore(), rank=0, world_size=1); "
             "from torch.distributed.device_mesh import init_device_mesh; "
             "from torch.distributed.tensor import distribute_tensor; "
             "shard = distribute_tensor(torch.zeros(2), init_device_mesh('cpu', (1,))); "
             "print(distributed.is_dtensor(torch.zeros(1)), distributed.is_dtensor(shard)); d.destroy_process_group()")
    r = run_script(["-c", probe])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == ["[]", "False True"]
