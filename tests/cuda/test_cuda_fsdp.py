"""CUDA: FSDP2 over NCCL, the GPU versions of tests/test_fsdp.py's equivalence and resume tests (issue 15, item 6).
Two ranks need two GPUs; on fewer each test skips with the reason."""
from __future__ import annotations

import pytest
import torch

from nanogpt import parallel
from nanogpt import checkpoint_sharded, outdir
from nanogpt.checkpoint_file import load_checkpoint
from cuda_helpers import MODEL_TOL, requires_cuda, requires_gpus, torchrun
from helpers import config_args, tiny_config
from train import train

pytestmark = [requires_cuda, requires_gpus(2)]

# float32 without TF32 (tiny_config's tf32 is turned off): the two runs differ by summation order only
RUN = dict(device="cuda", dtype="float32", tf32=False, max_iters=6, lr_decay_iters=6, eval_interval=3, dropout=0.0,
           log_interval=1)


def fsdp_params(out_dir) -> dict[str, torch.Tensor]:
    model, _ = checkpoint_sharded.load_sharded_as_full(str(out_dir / outdir.SHARDED))
    return model.state_dict()


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)


def run_torchrun(cfg) -> None:
    r = torchrun(["train.py", *config_args(cfg)], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("micro_steps_per_rank, checkpointing", [(1, False), (2, True)])
def test_nccl_fsdp_on_2_gpus_equals_one_gpu_with_the_same_global_batch(char_data, tmp_path, micro_steps_per_rank,
                                                                       checkpointing):
    data_dir, _ = char_data
    run = {**RUN, "gradient_accumulation_steps": 2 * micro_steps_per_rank}
    train(tiny_config(data_dir, tmp_path / "single", **run))
    run_torchrun(tiny_config(data_dir, tmp_path / "fsdp", **run, parallelism="fsdp",
                             activation_checkpointing=checkpointing))
    diff = max_diff(load_checkpoint(str(tmp_path / "single" / "ckpt.pt"))["model"], fsdp_params(tmp_path / "fsdp"))
    assert diff < MODEL_TOL[torch.float32], diff


def test_nccl_resume_2_to_1_and_1_to_2_gpus_continues_the_uninterrupted_run(char_data, tmp_path):
    data_dir, _ = char_data
    run = {**RUN, "gradient_accumulation_steps": 2, "max_iters": 8, "lr_decay_iters": 8, "eval_interval": 4}
    reference = train(tiny_config(data_dir, tmp_path / "ref", **run))
    ref_params = reference["model"].state_dict()
    # 2 GPUs for 4 steps, then one
    run_torchrun(tiny_config(data_dir, tmp_path / "a", **{**run, "max_iters": 4}, parallelism="fsdp"))
    resumed = train(tiny_config(data_dir, tmp_path / "a", **run, parallelism="fsdp", init_from="resume"))
    assert resumed["last_loss"] == pytest.approx(reference["last_loss"], abs=MODEL_TOL[torch.float32])
    assert max_diff(ref_params, fsdp_params(tmp_path / "a")) < MODEL_TOL[torch.float32]
    # one GPU for 4 steps, then 2
    train(tiny_config(data_dir, tmp_path / "b", **{**run, "max_iters": 4}, parallelism="fsdp"))
    run_torchrun(tiny_config(data_dir, tmp_path / "b", **run, parallelism="fsdp", init_from="resume"))
    assert max_diff(ref_params, fsdp_params(tmp_path / "b")) < MODEL_TOL[torch.float32]
