"""Tests for step.py: the micro-batches of a step (a function of the step alone) and train_step (gradient accumulation
equals one big batch, with ignored targets too, for SGD, AdamW and Muon); the non-finite guard decided on the device
(a skipped step leaves weights and optimizer state as they were; past its limit it skips the steps queued after) and
the figures read one step late."""
from __future__ import annotations

import pytest
import torch

from nanogpt import dataio
from nanogpt.distributed import Dist
from helpers import steps_with_loss_scales
from model import GPT, GPTConfig
from nanogpt.optim import build_optimizer
from nanogpt.config import StepConfig
from nanogpt.step import NonFiniteGuard, OneStepLate, batch_generator, get_batch, train_step


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
        f = train_step(model, opt, scaler, batches, torch.autocast("cpu", enabled=False), cfg, Dist()).read()
        loss, applied = f.loss, f.applied
        assert applied
        results.append((loss, {k: v.clone() for k, v in model.state_dict().items()}))
    (loss_big, p_big), (loss_acc, p_acc) = results
    assert loss_acc == pytest.approx(loss_big, abs=1e-6)
    assert max_param_diff(p_big, p_acc) < (1e-6 if optimizer == "sgd" else 1e-4)
    assert max_param_diff(p_big, _tiny_model().state_dict()) > 1e-3  # the step did move the weights


def _state_tensors(opt) -> list[torch.Tensor]:
    """Every tensor of an optimizer's state (AdamW's moments and step counts, Muon's momentum), copied."""
    opts = opt.optimizers.values() if hasattr(opt, "optimizers") else [opt]
    return [t.clone() for o in opts for state in o.state.values() for t in state.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("optimizer, fused", [("adamw", True), ("adamw", False), ("muon", True)])
def test_a_skipped_step_leaves_the_weights_and_the_optimizer_state_as_they_were(optimizer, fused):
    """A NaN loss after a good step: the skipped step changes no weight and no optimizer state (AdamW's moments and
    step count, whether its fused kernel reads the flag or the flag is read on the host; Muon's momentum)."""
    model = _tiny_model()
    cfg = StepConfig(optimizer=optimizer, learning_rate=1e-2, fused_adamw=fused, muon_ns_dtype="float32")
    opt = build_optimizer(model, cfg, "cpu", verbose=False)
    x = torch.randint(0, 50, (2, 16))
    scaler, ctx = torch.amp.GradScaler("cpu", enabled=False), torch.autocast("cpu", enabled=False)
    steps_with_loss_scales(model, opt, scaler, x, ctx, Dist(), [1.0])
    state = _state_tensors(opt)
    [(loss, _, applied, unchanged)] = steps_with_loss_scales(model, opt, scaler, x, ctx, Dist(), [float("nan")])
    assert not applied and unchanged and loss != loss
    after = _state_tensors(opt)
    assert len(after) == len(state) > 0 and all(torch.equal(a, b) for a, b in zip(state, after))


def test_past_its_limit_the_guard_skips_every_later_step():
    """The host reads a step's figures one step late, so a step is queued after the one that went past
    max_nonfinite_skips: the guard skips it too, and the run stops with the weights of the last good step. Within
    the limit the next finite step trains."""
    x = torch.randint(0, 50, (2, 16))
    scaler, ctx = torch.amp.GradScaler("cpu", enabled=False), torch.autocast("cpu", enabled=False)
    for limit, expect in ((0, [True, False, False, False]), (1, [True, False, True, True])):
        model = _tiny_model()
        opt = build_optimizer(model, StepConfig(learning_rate=1e-2), "cpu", verbose=False)
        guard = NonFiniteGuard("cpu", limit)
        steps = steps_with_loss_scales(model, opt, scaler, x, ctx, Dist(), [1.0, float("nan"), 1.0, 1.0], guard)
        assert [applied for _, _, applied, _ in steps] == expect
        assert [unchanged for _, _, _, unchanged in steps] == [not a for a in expect]
        assert guard.skips.item() == 1  # only the NaN step is counted


def test_a_float16_overflow_the_scaler_skips_is_no_non_finite_step():
    """Under float16's grad scaler a finite loss whose gradients overflow (an inf norm) is the scaler's to skip, with
    a lower scale next time, and is not counted against max_nonfinite_skips: with a limit of 0 the run goes on. A
    non-finite loss is counted, scaler or not; without a scaler an inf norm is counted too."""
    one, inf, nan = torch.tensor(1.0), torch.tensor(float("inf")), torch.tensor(float("nan"))
    guard = NonFiniteGuard("cpu", limit=0)
    assert guard.skip(one, inf, scaler_enabled=True).item() == 1.0  # not applied (the scaler skips it)...
    assert guard.skips.item() == 0  # ...and not counted
    assert guard.skip(one, one, scaler_enabled=True).item() == 0.0  # the next finite step trains: no stop
    assert guard.skip(nan, inf, scaler_enabled=True).item() == 1.0 and guard.skips.item() == 1
    plain = NonFiniteGuard("cpu")
    assert plain.skip(one, inf, scaler_enabled=False).item() == 1.0 and plain.skips.item() == 1


def test_one_step_late_returns_each_steps_figures_with_its_tag_when_the_next_is_pushed(monkeypatch):
    """Each step's figures come back one push later, with its tag and its time: from the end of the step before (or
    the last restart) to its own end, on the CPU the host clock (here one the test sets: 5, 7 and 11 ms steps)."""
    from nanogpt import measure

    now = {"t": 0.0}
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now["t"])
    model = _tiny_model()
    opt = build_optimizer(model, StepConfig(learning_rate=1e-2), "cpu", verbose=False)
    scaler, ctx = torch.amp.GradScaler("cpu", enabled=False), torch.autocast("cpu", enabled=False)
    batches = [(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16)))]
    late = OneStepLate("cpu")
    assert late.flush() is None
    results, reads = [], []
    for tag, ms in (("a", 5), ("b", 7), ("c", 11)):
        now["t"] += ms / 1000  # the step's time on the test's clock
        results.append(train_step(model, opt, scaler, batches, ctx, StepConfig(), Dist()))
        reads.append(late.push(tag, results[-1]))
    assert reads[0] is None
    (tag_a, figures_a, ms_a), (tag_b, _, ms_b) = reads[1:]
    assert (tag_a, tag_b) == ("a", "b") and figures_a == results[0].read()
    tag_c, figures_c, ms_c = late.flush()  # the last step: its own time, not the time since the read before
    assert tag_c == "c" and figures_c == results[2].read() and figures_c.applied and late.flush() is None
    assert [ms_a, ms_b, ms_c] == pytest.approx([5, 7, 11])
    now["t"] += 1.0  # an eval: not part of the next step's time once restart() marks its end
    late.restart()
    now["t"] += 0.003
    late.push("d", train_step(model, opt, scaler, batches, ctx, StepConfig(), Dist()))
    assert late.flush()[2] == pytest.approx(3)
    losses = [r.read().loss for r in results]
    assert losses[2] < losses[0]  # three different steps: the model trained
