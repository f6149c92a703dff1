"""CUDA: sample.py puts only the weights on the GPU, not the checkpoint's optimizer state (issue 13, bug 4)."""
from __future__ import annotations

import os

import torch

from common import load_checkpoint
from cuda_helpers import requires_cuda
from helpers import tiny_config
from sample import SampleConfig, load_model
from train import train

pytestmark = requires_cuda


def test_sampling_allocates_the_weights_not_the_optimizer_state(char_data, tmp_path):
    data_dir, _ = char_data
    out_dir = tmp_path / "out"
    train(tiny_config(data_dir, out_dir, max_iters=2, eval_interval=2, n_embd=256, n_head=4))  # on the CPU
    ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    weights = sum(t.numel() * t.element_size() for k, t in ckpt["model"].items() if k != "lm_head.weight")  # tied
    moments = sum(t.numel() * t.element_size() for s in ckpt["optimizer"]["state"].values()
                  for t in s.values() if t.dim() > 0)
    assert moments > 1.9 * weights  # exp_avg and exp_avg_sq: what the old code also put on the GPU
    del ckpt
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model, _ = load_model(SampleConfig(out_dir=str(out_dir), device="cuda", dtype="float32"))
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < 1.2 * weights, (peak, weights)
    assert next(model.parameters()).is_cuda
