"""nanogpt/config.py: the values each setting declares beside its type (Range, OneOf), and the checks of the keys
together and of what this machine can run (float8, wandb's key), each problem one phrase of one message."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Annotated

import pytest

from nanogpt import config
from nanogpt.config import AtLeast1, OneOf, Range, StepConfig, TrainConfig, declared_problems, wandb_problem
from nanogpt.errors import UserError
from test_train import no_wandb_login


def test_ranges_and_choices_say_the_bad_value_and_what_it_may_be():
    assert Range(1).problem("batch_size", 0) == "batch_size=0 must be at least 1"
    assert Range(0, low_open=True).problem("peak_flops", 0.0) == "peak_flops=0.0 must be > 0"
    assert Range(0, 1, high_open=True).problem("dropout", 1.0) == "dropout=1.0 must be in [0, 1)"
    assert Range(0, 1, high_open=True).problem("dropout", float("nan")) == "dropout=nan must be in [0, 1)"
    assert [Range(1).problem("k", v) for v in (1, 10**9, None, True)] == [None] * 4  # None and bools pass
    assert OneOf("a", "b").problem("kind", "c") == "kind='c' is not one of a, b"
    assert OneOf("a", "b").problem("kind", None) is None

    @dataclass
    class Settings:
        steps: AtLeast1[int] = 1
        kind: Annotated[str, OneOf("x", "y")] = "x"
        free: int = -5  # declares nothing: never a problem

    assert declared_problems(Settings()) == []
    assert declared_problems(Settings(steps=0, kind="z")) == ["steps=0 must be at least 1", "kind='z' is not one of x, y"]


def test_every_problem_of_a_train_config_comes_in_one_message():
    cfg = TrainConfig(batch_size=0, dropout=1.5, optimizer="sgd", n_embd=33, n_head=2, device="cpu", keep_last=-1)
    with pytest.raises(UserError) as e:
        cfg.check()
    message = str(e.value)
    for phrase in ("batch_size=0 must be at least 1", "dropout=1.5 must be in [0, 1)", "keep_last=-1 must be at least 0",
                   "optimizer='sgd' is not one of adamw, muon", "n_embd=33 must be divisible by n_head=2"):
        assert phrase in message, (phrase, message)
    assert "\n" not in message
    assert TrainConfig(device="cpu").problems() == []  # the defaults are valid


def test_fp8_problems_name_each_cause(monkeypatch):
    assert StepConfig(device="cpu").problems() == []  # off: nothing to check
    assert StepConfig(device="cpu", fp8_recipe="columnwise").problems() == [
        "fp8_recipe='columnwise' is not one of tensorwise, rowwise"]
    assert StepConfig(device="cpu", fp8_layers="some").problems() == ["fp8_layers='some' is not one of auto, all"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # torchao not installed
    problems = config.fp8_problems("cpu", "float32")
    assert problems[1:] == [
        "fp8=True runs everything else in bf16 autocast, but dtype='float32': set dtype=bfloat16 (or auto)",
        "fp8=True needs torchao, which is not installed: pip install torchao"]
    assert problems[0].startswith("fp8=True needs an NVIDIA GPU of compute capability 8.9")
    assert StepConfig(device="cpu", fp8=True, dtype="float32").problems() == problems


def test_wandb_finds_the_key_where_wandb_login_writes_it_or_needs_none_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    no_wandb_login(monkeypatch, home)
    cfg = TrainConfig(wandb_log=True)
    assert "no netrc file" in wandb_problem(cfg)
    assert wandb_problem(TrainConfig(wandb_log=False)) is None
    (home / ".netrc").write_text("machine example.com\n  login user\n  password secret\n")  # another host's entry
    assert f"no entry for api.wandb.ai in {home / '.netrc'}" in wandb_problem(cfg)
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")  # `wandb login`'s
    assert wandb_problem(cfg) is None
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a self-hosted server: its own entry
    assert f"no entry for wandb.example.com in {home / '.netrc'}" in wandb_problem(cfg)
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        assert wandb_problem(cfg) is None
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert wandb_problem(cfg) is None
