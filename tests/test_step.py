"""Tests for step.py: the micro-batches of a step (a function of the step alone) and train_step (gradient accumulation
equals one big batch, with ignored targets too, for SGD, AdamW and Muon)."""
from __future__ import annotations

import pytest
import torch

import dataio
from distributed import Dist
from helpers import make_char_dataset
from model import GPT, GPTConfig
from optim import build_optimizer
from step import StepConfig, batch_generator, get_batch, train_step


@pytest.fixture()
def data_dir(tmp_path):
    d = tmp_path / "tinychar"
    make_char_dataset(d)
    return d


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_get_batch_targets_are_next_tokens_and_stream_is_deterministic(data_dir):
    path = str(data_dir / "train.bin")
    data = dataio.open_tokens(path)
    x, y = get_batch(path, 8, 16, batch_generator(1, "train", 3, 0))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = get_batch(path, 8, 16, batch_generator(1, "train", 3, 0))
    x3, _ = get_batch(path, 8, 16, batch_generator(1, "train", 3, 1))
    assert torch.equal(x, x2) and not torch.equal(x, x3)  # same (step, index): same windows; another index: others
    for row in x:  # every window is a real slice of the file
        first = row[0].item()
        assert any(torch.equal(row, torch.from_numpy(data[i : i + 16].astype("int64")))
                   for i in range(len(data) - 16) if data[i] == first)


def _tiny_model(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, bias=True))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "muon"])
@pytest.mark.parametrize("ignore", [False, True])
def test_accumulation_equals_one_big_batch(ignore, optimizer):
    """4 micro-steps of batch 2 give the same parameters after one step as 1 step of batch 8, also when
    micro-batches hold different numbers of ignored (-1) targets. SGD with lr 1 shows the gradients themselves
    (atol 1e-6); AdamW's first step divides by sqrt(v), which magnifies rounding of tiny gradients (atol 1e-4, 1% of
    its lr 1e-2 step); Muon's (lr 0.02, float32 Newton-Schulz) normalises the gradient too (atol 1e-4)."""
    torch.manual_seed(1)
    x = torch.randint(0, 50, (8, 16))
    y = torch.randint(0, 50, (8, 16))
    if ignore:  # unequal numbers of real targets per micro-batch: a plain mean of means would be wrong
        y[0, 3:] = -1
        y[5, :10] = -1
        y[6:8] = -1  # and a micro-batch with no target at all (its loss must not be NaN)
    cfg = StepConfig(grad_clip=0.0)

    results = []
    for batches in ([(x, y)], [(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)]):
        model = _tiny_model()
        if optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
        else:
            opt_cfg = StepConfig(optimizer=optimizer, learning_rate=1e-2, muon_ns_dtype="float32")
            opt = build_optimizer(model, opt_cfg, "cpu", verbose=False)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        loss, _, applied = train_step(model, opt, scaler, batches, torch.autocast("cpu", enabled=False), cfg, Dist())
        assert applied
        results.append((loss, {k: v.clone() for k, v in model.state_dict().items()}))
    (loss_big, p_big), (loss_acc, p_acc) = results
    assert loss_acc == pytest.approx(loss_big, abs=1e-6)
    assert max_param_diff(p_big, p_acc) < (1e-6 if optimizer == "sgd" else 1e-4)
    assert max_param_diff(p_big, _tiny_model().state_dict()) > 1e-3  # the step did move the weights
