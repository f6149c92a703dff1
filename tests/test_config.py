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
    assert declared_problems(Settings(steps=0, kind="z")) == ["steps=0 must be at least 1",
                                                              "kind='z' is not one of x, y"]


def test_every_problem_of_a_train_config_comes_in_one_message():
    cfg = TrainConfig(batch_size=0, dropout=1.5, optimizer="sgd", n_embd=33, n_head=2, device="cpu", keep_last=-1)
    with pytest.raises(UserError) as e:
        cfg.check()
    message = str(e.value)
    for phrase in ("batch_size=0 must be at least 1", "dropout=1.5 must be in [0, 1)",
                   "keep_last=-1 must be at least 0",
                   "optimizer='sgd' is not one of adamw, muon", "n_embd=33 must be divisible by n_head=2"):
        assert phrase in message, (phrase, message)
    assert "\n" not in message
    assert TrainConfig(device="cpu").problems() == []  # the defaults are valid


def test_micro_steps_must_split_evenly_over_the_ranks():
    """3 micro-steps on 2 ranks would train 2 (1 per rank) while logging 3 x batch_size x block_size tokens."""
    for steps, world, refused in [(3, 2, True), (1, 2, True), (5, 4, True), (4, 2, False), (3, 1, False)]:
        problems = TrainConfig(device="cpu", gradient_accumulation_steps=steps).problems(world)
        assert [p.startswith(f"gradient_accumulation_steps={steps} ") for p in problems] == [True] * refused, problems


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


def test_flash_impl_fa4_is_refused_in_one_line_where_it_cannot_run():
    """FlashAttention-4 (flash_impl='fa4') needs an H100/H200/B200-class GPU and the flash-attn-4 package: on this
    CPU, one phrase of the settings' one message, before anything runs."""
    (problem,) = TrainConfig(device="cpu", flash_impl="fa4").problems()
    assert problem.startswith("flash_impl='fa4' runs FlashAttention-4 on NVIDIA GPUs of compute capability 9.0")
    assert TrainConfig(device="cpu", flash_impl="fa3").problems() == [
        "flash_impl='fa3' is not one of default, fa4"]


def test_wandb_finds_the_key_where_wandb_login_writes_it_or_needs_none_offline(tmp_path, monkeypatch, wandb_settings):
    """wandb_problem asks wandb itself: its key in the netrc file `wandb login` writes or in WANDB_API_KEY, for the
    server it logs to (WANDB_BASE_URL); none needed offline; a key of the wrong form named."""
    wandb = pytest.importorskip("wandb")
    home = tmp_path / "home"
    no_wandb_login(monkeypatch, home)
    cfg = TrainConfig(wandb_log=True)
    assert "wandb has no API key for https://" in wandb_problem(cfg)
    assert wandb_problem(TrainConfig(wandb_log=False)) is None
    (home / ".netrc").write_text("machine example.com\n  login user\n  password secret\n")  # another host's entry
    assert "wandb has no API key for https://" in wandb_problem(cfg)
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")  # `wandb login`'s
    assert wandb_problem(cfg) is None
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a self-hosted server: its own entry
    wandb.teardown()  # wandb reads its settings once per process
    assert "wandb has no API key for https://wandb.example.com: run `wandb login` once" in wandb_problem(cfg)
    for mode in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", mode)
        wandb.teardown()
        assert wandb_problem(cfg) is None
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    wandb.teardown()
    assert wandb_problem(cfg) is None
    monkeypatch.setenv("WANDB_API_KEY", "0" * 5)
    assert wandb_problem(cfg).startswith("wandb_log=True but wandb cannot use its credentials (WANDB_API_KEY invalid")


# ----------------------------------------------------------------------------------------------- every numeric key


def numeric_keys(config_type) -> list[str]:
    """The keys of a config whose type is a number (int, float, optionally None or a bool too)."""
    import typing

    hints = typing.get_type_hints(config_type)
    numbers = {int, float}
    return [name for name, tp in hints.items()
            if tp in numbers or set(typing.get_args(tp)) - {type(None), bool} and
            set(typing.get_args(tp)) - {type(None), bool} <= numbers]


def test_every_numeric_setting_declares_its_range():
    """Each number a user sets says beside its type what it may be (so that none is accepted out of range)."""
    import bench
    import hellaswag
    import sample

    for config_type in (TrainConfig, bench.BenchConfig, sample.SampleConfig, hellaswag.HellaSwagConfig):
        declared = config.declarations(config_type())
        assert [k for k in numeric_keys(config_type) if not isinstance(declared.get(k, (None,))[0], Range)] == [], \
            config_type.__name__


# Every numeric setting of every command as its user knows it (the README, --help): values refused and values
# accepted (the bounds themselves among them), written here by hand, never read from the declarations the checks use.
# key: (refused, accepted) or (refused, accepted, the other settings it is given with).
NAN, INF = float("nan"), float("inf")
STEP_SETTINGS = {  # train.py's and bench.py's (config.StepConfig)
    "gradient_accumulation_steps": ([0, -1], [1, 40]), "batch_size": ([0, -1], [1, 12]),
    "block_size": ([0, -1], [1, 1024]), "n_layer": ([0, -1], [1, 12]), "n_head": ([0, -1], [1, 12]),
    "n_embd": ([0, -1], [1, 768], {"n_head": 1}), "dropout": ([-0.1, 1.0, 1.5, NAN], [0.0, 0.1, 0.999]),
    "vocab_padding_multiple": ([0, -1, 2**16 + 1], [1, 64, 2**16]), "muon_learning_rate": ([0.0, -0.02], [1e-9, 0.02]),
    "muon_weight_decay": ([-0.1, INF], [0.0, 0.1]), "muon_momentum": ([-0.1, 1.0], [0.0, 0.95]),
    "learning_rate": ([-6e-4, INF], [0.0, 6e-4]), "weight_decay": ([-0.1], [0.0, 0.1]),
    "beta1": ([-0.1, 1.0], [0.0, 0.9]), "beta2": ([-0.1, 1.0], [0.0, 0.95]), "grad_clip": ([-1.0], [0.0, 1.0]),
    "peak_flops": ([0.0, -1.0, NAN], [None, 1.0, 312e12]), "seed": ([-1, 2**32], [0, 1337, 2**32 - 1]),
}
COMMAND_SETTINGS = {
    "train.py": {**STEP_SETTINGS, "eval_interval": ([0, -1], [1, 2000]), "log_interval": ([0, -1], [1, 10]),
                 "eval_iters": ([0, -1], [1, 200]), "keep_last": ([-1], [0, 3]),
                 "checkpoint_interval": ([-1], [0, 100]), "checkpoint_minutes": ([-1.0, NAN], [0.0, 30.0]),
                 "max_iters": ([-1], [0, 600000]), "hellaswag_interval": ([-1, 1, 2001], [0, 4000]),
                 "warmup_iters": ([-1], [0, 2000]),
                 "lr_decay_iters": ([-1], [None, 0, 600000]), "min_lr": ([-6e-5], [0.0, 6e-5]),
                 "max_nonfinite_skips": ([-1], [0, 5]), "activation_checkpointing": ([-1, 13], [False, True, 0, 12])},
    "bench.py": {**STEP_SETTINGS, "vocab_size": ([0, -1], [1, 50257]), "warmup_steps": ([-1], [0, 10]),
                 "timed_steps": ([0, -1], [1, 20])},
    "sample.py": {"num_samples": ([0, -1], [1, 10]), "batch_size": ([0, -1], [None, 1, 8]),
                  "max_new_tokens": ([0, -1], [1, 500]), "temperature": ([-0.1, NAN], [0.0, 0.8, 2.0]),
                  "top_k": ([0, -1], [None, 1, 200]), "top_p": ([0.0, -0.1, 1.01], [None, 1e-6, 0.9, 1.0]),
                  "seed": ([-1, 2**32], [0, 2**32 - 1])},
    "hellaswag.py": {"max_examples": ([-1], [0, 10])},
    "export.py": {},
}


def problems_of(command: str, settings: dict) -> list[str]:
    """The phrases of the command's own check of these settings (device=cpu): [] where it accepts them."""
    import bench
    import hellaswag
    import sample

    try:
        if command == "train.py":
            return TrainConfig(device="cpu", **settings).problems()
        if command == "bench.py":
            return bench.BenchConfig(device="cpu", **settings).problems()
        if command == "sample.py":
            sample.check_config(sample.SampleConfig(device="cpu", **settings))
        if command == "hellaswag.py":  # main's check; then the examples file, which is not there (no download)
            hellaswag.main([*(f"--{k}={v!r}" for k, v in settings.items()), "--device=cpu", "--path=/no/hellaswag"])
    except UserError as e:
        return [] if str(e).startswith("hellaswag path '/no/hellaswag'") else str(e).split("; ")
    return []


@pytest.mark.parametrize("command", COMMAND_SETTINGS)
def test_every_numeric_setting_refuses_and_accepts_the_values_its_user_expects(command):
    """Each value the table refuses is refused by the command's check, in phrases that all name the key; each it
    accepts passes. The table covers every numeric setting: a new one must be added to it. (The out-of-range test
    draws its values from the declarations, so it never saw vocab_padding_multiple's range widened to take 0, which
    then ends in a ValueError, nor a closed bound made open, which refuses seed=2**32-1 and top_p=1.0.)"""
    import bench
    import export
    import hellaswag
    import sample

    config_type = {"train.py": TrainConfig, "bench.py": bench.BenchConfig, "sample.py": sample.SampleConfig,
                   "hellaswag.py": hellaswag.HellaSwagConfig, "export.py": export.ExportConfig}[command]
    settings = COMMAND_SETTINGS[command]
    assert sorted(settings) == sorted(numeric_keys(config_type))
    for key, (refused, accepted, *context) in settings.items():
        for value in refused:
            problems = problems_of(command, {**(context[0] if context else {}), key: value})
            assert problems and all(p.startswith(f"{key}=") for p in problems), (key, value, problems)
        for value in accepted:
            assert problems_of(command, {**(context[0] if context else {}), key: value}) == [], (key, value)


def out_of_range(meta: Range, integer: bool):
    """A strategy of values outside `meta`: below its low end, above its high end, and (floats) nan and inf."""
    import math

    from hypothesis import strategies as st

    options = []
    if meta.low is not None:
        if integer:
            options.append(st.integers(max_value=math.ceil(meta.low) - (0 if meta.low_open else 1), min_value=-10**12))
        else:
            options.append(st.floats(max_value=meta.low, exclude_max=not meta.low_open, min_value=-1e300))
    if meta.high is not None:
        if integer:
            options.append(st.integers(min_value=math.floor(meta.high) + (0 if meta.high_open else 1),
                                       max_value=10**20))
        else:
            options.append(st.floats(min_value=meta.high, exclude_min=not meta.high_open, max_value=1e300))
    if not integer:
        options.append(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    return st.one_of(options)


@pytest.mark.slow
def test_an_out_of_range_value_of_any_numeric_setting_is_one_line_and_changes_nothing(data_dir, tmp_path, capsys):
    """Bug: --max_nonfinite_skips=-1 stopped the first step over finite figures (after the start was accepted);
    --keep_last=-1, --warmup_iters=-5 and --min_lr=-1 passed silently; --seed=-1 was a traceback from numpy after the
    run in out_dir had been moved aside. Now any numeric key given a value outside its declared range (drawn by
    hypothesis) is one line naming it, exit status 2, and out_dir byte for byte as it was."""
    import typing

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from helpers import config_args, folder_state, run_in_process, tiny_config
    from train import train

    out = tmp_path / "out"
    train(tiny_config(data_dir, out, max_iters=2, eval_interval=2))
    before = folder_state(out)
    args = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=4))]
    hints = typing.get_type_hints(TrainConfig)
    ranges = {k: meta for k, (meta, _) in config.declarations(TrainConfig()).items() if isinstance(meta, Range)}
    cases = st.sampled_from(sorted(ranges)).flatmap(
        lambda k: st.tuples(st.just(k), out_of_range(ranges[k], int in (hints[k], *typing.get_args(hints[k]))
                                                     and float not in (hints[k], *typing.get_args(hints[k])))))

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cases)
    def one_bad_key(case):
        key, value = case
        r = run_in_process([*args, f"--{key}={value!r}"], capsys)
        assert r.returncode == 2, (key, value, r.stderr[-2000:])
        (line,) = r.stderr.splitlines()
        assert line.startswith("error: ") and f"{key}" in line, (key, value, line)
        assert folder_state(out) == before, (key, value)

    one_bad_key()
    for key, value in (("max_nonfinite_skips", -1), ("keep_last", -1), ("warmup_iters", -5), ("min_lr", -1.0),
                       ("seed", -1)):  # the reported ones, each certainly tried
        r = run_in_process([*args, f"--{key}={value}"], capsys)
        assert r.returncode == 2 and f"{key}={value} must be " in r.stderr, (key, r.stderr)


@pytest.mark.parametrize("script", ["sample.py", "bench.py"])
def test_a_negative_seed_is_one_line_in_every_command(script, tmp_path, capsys):
    """Bug: --seed=-1 was a traceback from numpy's SeedSequence in sample.py and bench.py."""
    from helpers import run_in_process

    r = run_in_process([script, "--seed=-1", "--device=cpu", f"--out_dir={tmp_path}"] if script == "sample.py"
                       else [script, "--seed=-1", "--device=cpu"], capsys)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: ") and "seed=-1 must be in [0, 4294967295]" in line, line


@pytest.mark.parametrize("script", ["train.py", "sample.py", "hellaswag.py"])
def test_an_empty_out_dir_is_refused_before_anything_is_written(script, data_dir, tmp_path, capsys, monkeypatch):
    """Bug: `--out_dir=$OUT` with OUT unset gave out_dir='': the run wrote its checkpoint, run.json and metrics into
    the current folder, and a second such run overwrote the first's checkpoint (os.path.isdir('') is False, so
    nothing was moved aside). Now it is one line, exit status 2, and the current folder stays as it was."""
    from helpers import config_args, folder_state, run_in_process, tiny_config
    from train import train

    monkeypatch.chdir(tmp_path)
    train(tiny_config(data_dir, ".", max_iters=2, eval_interval=2))  # a run in the current folder, given as '.'
    before = folder_state(tmp_path)
    args = config_args(tiny_config(data_dir, "", max_iters=4)) if script == "train.py" else ["--device=cpu"]
    r = run_in_process([script, *[a for a in args if not a.startswith("--out_dir")], "--out_dir="], capsys)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: out_dir='' names no folder (give a folder: '.' for the current one)"], r.stderr[-2000:]
    assert folder_state(tmp_path) == before


def test_an_sdpa_kernel_for_the_math_attention_is_refused_in_training_as_in_sampling():
    """Bug: train.py took --sdpa_backend=cudnn --attention=math silently (the kernel choice did nothing); sample.py
    refused it."""
    problems = TrainConfig(attention="math", sdpa_backend="cudnn", device="cpu").problems()
    assert problems == ["sdpa_backend='cudnn' chooses a kernel of attention=sdpa, not of math: use --attention=sdpa "
                        "(or auto), or drop sdpa_backend"]
    assert TrainConfig(attention="math", device="cpu").problems() == []  # sdpa_backend's default: "auto"
    assert TrainConfig(attention="sdpa", sdpa_backend="math", device="cpu").problems() == []
