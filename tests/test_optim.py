"""optim.py: Muon for the blocks' matrices and AdamW for the rest, as one optimizer that train.py steps."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanogpt.errors import UserError
from nanogpt.distributed import Dist
from nanogpt.checkpoint_file import load_checkpoint
from helpers import config_args, run_in_process, tiny_config
from model import GPT, GPTConfig
from nanogpt.optim import build_optimizer
from nanogpt.config import TrainConfig
from train import train
from nanogpt.step import train_step


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, bias=True))


def test_muon_takes_the_block_matrices_and_adamw_everything_else_once():
    model = _model()
    opt = build_optimizer(model, TrainConfig(optimizer="muon"), "cpu", verbose=False)
    names = {id(p): n for n, p in model.named_parameters()}  # the tied head is transformer.wte.weight here
    muon = [names[id(p)] for g in opt.optimizers["muon"].param_groups for p in g["params"]]
    adamw = [names[id(p)] for g in opt.optimizers["adamw"].param_groups for p in g["params"]]
    expected_muon = [f"transformer.h.{i}.{m}.weight" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert sorted(muon) == sorted(expected_muon)
    assert sorted(muon + adamw) == sorted(names.values())  # every parameter, each in one optimizer
    assert "transformer.wte.weight" in adamw and "transformer.wpe.weight" in adamw
    assert all(p.dim() == 1 for g in opt.optimizers["adamw"].param_groups if g["weight_decay"] == 0 for p in g["params"])


def test_muon_prints_one_optimizer_line_for_both_optimizers(capsys):
    build_optimizer(_model(), TrainConfig(optimizer="muon", fused_adamw=False, muon_ns_dtype="float32"), "cpu")
    # 2 blocks of n_embd 32: c_attn 32x96, attn.c_proj 32x32, c_fc 32x128, mlp.c_proj 128x32 = 12,288 params each;
    # the rest: wte 64x32 (50 rows padded to 64), wpe 16x32, and per block 2 LayerNorms (weight, bias) and 4 biases
    # (96 + 32 + 128 + 32), ln_f's weight and bias: 2 + 2 x 8 + 2 = 20 tensors, 2048 + 512 + 2 x 416 + 64 params
    assert capsys.readouterr().out.splitlines() == [
        "optimizer: Muon on 8 block matrices (24,576 params) at lr 0.02 (Newton-Schulz in float32); AdamW (for-loop) "
        "on the other 20 tensors (the embeddings and 1-D weights: 3,456 params) at lr 0.0006"]


def test_muon_step_is_torch_muon_and_adamw_stepped_by_hand_on_clipped_gradients():
    """train_step with optimizer=muon == the gradients clipped by hand, then torch.optim.Muon on the block matrices
    and torch.optim.AdamW on the rest, each at its own learning rate scaled by the schedule (half of the peak).
    Newton-Schulz in bfloat16, as torch's Muon runs it."""
    cfg = TrainConfig(optimizer="muon", learning_rate=1e-2, muon_learning_rate=0.05, muon_weight_decay=0.1,
                      weight_decay=0.1, grad_clip=0.5, fused_adamw=False, muon_ns_dtype="bfloat16")
    torch.manual_seed(1)
    x, y = torch.randint(0, 50, (4, 16)), torch.randint(0, 50, (4, 16))
    no_autocast = torch.autocast("cpu", enabled=False)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    model = _model()
    opt = build_optimizer(model, cfg, "cpu", verbose=False)
    for _ in range(2):  # the second step uses the momentum and Adam's moments
        opt.set_lr(cfg.learning_rate / 2)
        f = train_step(model, opt, scaler, [(x, y)], no_autocast, cfg, Dist()).read()
        norm, applied = f.grad_norm, f.applied
        assert applied and norm > cfg.grad_clip  # the clip is active

    ref = _model()
    hidden = [p for n, p in ref.named_parameters() if n.startswith("transformer.h.") and p.dim() == 2]
    rest_2d = [p for n, p in ref.named_parameters() if not n.startswith("transformer.h.") and p.dim() == 2]
    rest_1d = [p for p in ref.parameters() if p.dim() == 1]
    muon = torch.optim.Muon(hidden, lr=0.05 / 2, weight_decay=0.1, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW([{"params": rest_2d, "weight_decay": 0.1}, {"params": rest_1d, "weight_decay": 0.0}],
                              lr=1e-2 / 2, betas=(0.9, 0.95))
    for _ in range(2):
        _, loss = ref(x, y, return_logits=False)  # train_step's call: the same (fused) loss to the last bit
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    got, want = model.state_dict(), ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    assert max((got[k] - _model().state_dict()[k]).abs().max().item() for k in want) > 1e-2  # it did move


def test_resuming_with_the_other_optimizer_is_refused_in_one_line(data_dir, tmp_path, capsys):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2)
    train(cfg)
    r = run_in_process(["train.py", *config_args(cfg), "--init_from=resume", "--max_iters=4", "--optimizer=muon"],
                       capsys)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        "error: cannot resume: the checkpoint was written by optimizer='adamw', not 'muon': use "
        "--optimizer=adamw, or a new out_dir to start a new run"
    ]
    muon_cfg = tiny_config(data_dir, tmp_path / "muon", max_iters=2, eval_interval=2, optimizer="muon")
    train(muon_cfg)
    assert load_checkpoint(str(tmp_path / "muon" / "ckpt.pt"))["config"]["optimizer"] == "muon"
    with pytest.raises(UserError, match="written by optimizer='muon', not 'adamw'"):
        train(dataclasses.replace(muon_cfg, init_from="resume", max_iters=4, optimizer="adamw"))


def test_muon_on_an_old_torch_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon")
    monkeypatch.setattr(torch, "__version__", "2.8.0")
    with pytest.raises(UserError, match=r"needs torch.optim.Muon \(torch >= 2.9\), and this is torch 2.8.0"):
        build_optimizer(_model(), TrainConfig(optimizer="muon"), "cpu", verbose=False)


def test_newton_schulz_in_float32_agrees_with_torchs_bfloat16_and_orthogonalises():
    """Our float32 iteration vs torch.optim.Muon's (bfloat16): the same within bf16 rounding; ours pushes every
    singular value of a badly conditioned matrix into the quintic's band around 1 (SVD in float64)."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    from nanogpt.optim import newton_schulz

    coefficients = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    torch.manual_seed(0)
    for shape in ((96, 32), (32, 96), (48, 48)):
        u, _ = torch.linalg.qr(torch.randn(shape[0], min(shape)))
        v, _ = torch.linalg.qr(torch.randn(shape[1], min(shape)))
        g = u @ torch.diag(torch.logspace(0, -2, min(shape))) @ v.T  # condition number 100
        ours = newton_schulz(g, coefficients, 5, 1e-7, torch.float32)
        theirs = _zeropower_via_newtonschulz(g, coefficients, 5, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        assert ((ours - theirs).norm() / theirs.norm()).item() < 0.05  # bf16 rounding, amplified by 5 iterations
        s = torch.linalg.svdvals(ours.double())
        assert s.min().item() > 0.5 and s.max().item() < 1.3, s


def test_muon_ns_dtype_auto_is_float32_only_on_a_cpu_without_bf16_kernels(monkeypatch):
    from nanogpt.optim import ns_dtype_for

    assert ns_dtype_for("float32", "cuda") == torch.float32 and ns_dtype_for("bfloat16", "cpu") == torch.bfloat16
    assert ns_dtype_for("auto", "cuda") == torch.bfloat16
    for capability, dtype in (("AVX512", torch.bfloat16), ("SVE256", torch.bfloat16), ("AVX2", torch.float32)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert ns_dtype_for("auto", "cpu") == dtype
