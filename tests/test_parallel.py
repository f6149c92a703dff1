"""parallel.py on the CPU: activation checkpointing (checkpoint_activations recomputes the first N blocks and trains
exactly as without), the FSDP settings' checks (config_problems; nanoGPT's Shakespeare config is accepted),
shard_model's bf16 mixed precision (bf16 compute over float32 shards and gradients), and memory_per_rank and
memory_text giving the memory line that the GPT-2 XL FSDP config states for 8 ranks. FSDP training on 2 ranks
against one process, its resumes and its measured memory: tests/test_fsdp.py."""
from __future__ import annotations

import os
import re

import pytest
import torch

from nanogpt import parallel
import train as train_module
from nanogpt.errors import UserError
from helpers import ROOT, tiny_config
from model import GPT, GPTConfig
from test_fsdp import max_diff
from nanogpt.config import TrainConfig
from train import train


def test_activation_checkpointing_recomputes_and_trains_exactly_as_without(data_dir, tmp_path):
    # dropout on: the recomputation must replay the same masks (the checkpoint restores the RNG state)
    run = dict(max_iters=4, eval_interval=4, dropout=0.1)
    plain = train(tiny_config(data_dir, tmp_path / "plain", **run))
    for setting in (True, 1):
        ac = train(tiny_config(data_dir, tmp_path / f"ac{setting}", **run, activation_checkpointing=setting))
        assert ac["last_loss"] == plain["last_loss"]
        assert max_diff(plain["model"].state_dict(), ac["model"].state_dict()) == 0.0
    # and it does recompute: the first N blocks' attention runs twice per forward+backward, the others once
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=11))
    assert parallel.checkpoint_activations(model, 2) == 2
    calls = [0, 0, 0]
    for i, block in enumerate(model.transformer.h):
        block.attn.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    idx = torch.randint(11, (2, 8))
    model(idx, idx)[1].backward()
    assert calls == [2, 2, 1]


def test_fsdp_and_activation_checkpointing_settings_are_checked(data_dir, tmp_path):
    cases = {
        "parallelism='zero' is not one of ddp, fsdp": dict(parallelism="zero"),
        "dtype='float16' is not supported with parallelism='fsdp'": dict(parallelism="fsdp", dtype="float16"),
        "keep_last=2 is not supported with sharded checkpoints": dict(parallelism="fsdp", keep_last=2),
        # with the settings, before anything loads (they were found only once the model or process group existed)
        "activation_checkpointing=3 must be True, False or a number of blocks 0..2": dict(activation_checkpointing=3),
        "backend='nccl' needs CUDA but device='cpu': use --backend=gloo": dict(backend="nccl"),
    }
    for message, overrides in cases.items():
        with pytest.raises(UserError, match=re.escape(message)):
            tiny_config(data_dir, tmp_path, **overrides).check(1)
    # a start from weights takes their depth: checked once they are loaded, still before out_dir changes
    train(tiny_config(data_dir, tmp_path / "two", max_iters=2, eval_interval=2))
    weights = str(tmp_path / "two" / "ckpt.pt")
    with pytest.raises(UserError, match=r"activation_checkpointing=3 must be True, False or a number of blocks 0\.\.2"):
        train(tiny_config(data_dir, tmp_path / "ac", init_from=weights, activation_checkpointing=3))
    assert not os.path.exists(tmp_path / "ac")


def test_nanogpts_shakespeare_config_runs_under_fsdp(tmp_path):
    from configurator import configure

    cfg = configure(TrainConfig(), [os.path.join(ROOT, "config", "train_shakespeare_char.py"),
                                                 "--parallelism=fsdp"])
    assert cfg.always_save_checkpoint is False
    cfg.check(1)  # was refused: always_save_checkpoint=False with sharded checkpoints


@pytest.mark.slow
def test_bf16_mixed_precision_computes_in_bf16_and_keeps_float32_shards_and_grads():
    from nanogpt.distributed import cleanup_distributed, setup_distributed

    dist = setup_distributed("cpu", group_of_one=True)  # FSDP needs a process group, even of one
    try:
        torch.manual_seed(0)
        model = parallel.shard_model(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=11)),
                                     dist, "bfloat16", compile=False)
        seen = []
        model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.append(m.weight.dtype))
        idx = torch.randint(11, (2, 8))
        model(idx, idx)[1].backward()
        assert seen == [torch.bfloat16]  # the all-gathered parameters the block computes with
        assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float32}
    finally:
        cleanup_distributed(dist)


def test_the_xl_fsdp_config_states_the_memory_line_of_8_ranks():
    """The config's comment gives what train.py's memory line says for GPT-2 XL on 8 ranks with its accumulation
    (5 micro-steps per rank: the unsharded gradients counted). The model is sharded on the meta device over a
    fake process group of 8 ranks: real shard shapes, no memory, one process."""
    import torch.distributed as torch_dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nanogpt.distributed import Dist
    from configurator import configure

    path = os.path.join(ROOT, "config", "train_gpt2_xl_fsdp.py")
    cfg = configure(TrainConfig(), [path])
    cfg.check(8)
    assert cfg.parallelism == "fsdp" and cfg.activation_checkpointing is True
    comment = " ".join(open(path).read().replace("#", " ").split())  # the words, without line breaks
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(GPTConfig(n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
                              bias=cfg.bias, vocab_size=50257))
    whole = parallel.memory_per_rank(model)
    gib = 1 << 30
    # DDP: a whole copy of everything, and as much again in gradient buckets
    assert f"DDP (a full copy per GPU): {whole['numel']:,} x 16 B = " \
           f"{(whole['params'] + whole['grads'] + whole['optimizer']) / gib:.1f} GiB, plus DDP's " \
           f"{whole['grads'] / gib:.1f} GiB of gradient buckets" in comment
    torch_dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        on_8 = parallel.shard_model(model, Dist(world_size=8, device="cpu", enabled=True), cfg.dtype, compile=False)
        line = parallel.memory_text(parallel.memory_per_rank(on_8, cfg.gradient_accumulation_steps // 8), 8)
    finally:
        torch_dist.destroy_process_group()
    print(line)
    figures = re.search(r"params ([\d.]+) GiB \+ grads ([\d.]+) GiB \(whole model, unsharded.*optimizer ([\d.]+) GiB "
                        r"= ([\d.]+) GiB", line).groups()
    stated = "params {} GiB + grads {} GiB (unsharded) + AdamW {} GiB = {} GiB per GPU".format(*figures)
    assert stated in comment, stated


@pytest.mark.slow
def test_the_memory_line_counts_the_optimizers_real_state(data_dir, tmp_path, capsys):
    """The memory line train.py prints counts the state the optimizer holds after a step: AdamW's two moments per
    element, Muon's one momentum for the blocks' matrices (it said AdamW's for a Muon run too)."""
    from nanogpt.optim import build_optimizer

    for optimizer in ("adamw", "muon"):
        cfg = tiny_config(data_dir, tmp_path / optimizer, optimizer=optimizer, max_iters=1, eval_interval=1)
        model = train(cfg)["model"]
        logged = int(re.search(r"memory per rank: .*; (\d+) bytes\)", capsys.readouterr().out)[1])
        opt = build_optimizer(model, cfg, "cpu", verbose=False)
        x = torch.randint(0, 11, (2, 8))
        model(x, x)[1].backward()
        opt.step()
        held = sum(t.numel() * t.element_size() for o in opt.optimizers.values() for s in o.state.values()
                   for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert logged == 2 * weights + held, optimizer  # params, their float32 gradients, the optimizer's state
