"""train.py: learning, DDP, resume, compile, the LR schedule, and its user errors (the step itself: test_step.py)."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re

import pytest
import torch

from nanogpt import dataio, tokenizers
from nanogpt.device import set_deterministic
from nanogpt.checkpoint_file import load_checkpoint, model_from_checkpoint
from helpers import (HANG_S, config_args, hide_module, make_char_dataset, run_in_process, run_script,
                     tiny_config)
from model import GPT, GPTConfig
from nanogpt.config import TrainConfig
from train import get_lr, train
from nanogpt.step import batch_generator, get_batch
from nanogpt.errors import UserError


def params_of(path) -> dict[str, torch.Tensor]:
    return load_checkpoint(str(path))["model"]


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_tiny_run_learns_and_writes_checkpoint_and_metrics(data_dir, tmp_path):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=60, eval_interval=30, learning_rate=1e-2)
    result = train(cfg)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    evals = [r for r in records if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 30, 60]
    first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
    # starts near ln(vocab) (uniform guess), and learns the corpus' structure clearly
    meta = dataio.load_meta(data_dir)
    assert abs(first - math.log(meta["vocab_size"])) < 0.3
    assert last < first - 1.0, (first, last)
    steps = [r for r in records if "loss" in r]
    assert [r["iter"] for r in steps] == list(range(5, 61, 5))
    assert all(r["tok_s"] > 0 and r["ms"] > 0 for r in steps)
    # the checkpoint rebuilds the model alone, and it generates text in the dataset's alphabet
    ckpt = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["iter_num"] == 60 and ckpt["best_val_loss"] == pytest.approx(result["best_val_loss"])
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in ckpt["model"])
    model = model_from_checkpoint(ckpt)
    tok = tokenizers.get_tokenizer(meta)
    start = torch.tensor([tok.encode("The ")])
    out = model.generate(start, 40, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(0))
    text = tok.decode(out[0].tolist())
    assert text.startswith("The ") and len(text) == 44
    assert set(text) <= set(meta["itos"])


def test_lr_schedule_warmup_cosine_and_floor():
    cfg = TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    assert get_lr(0, cfg) == pytest.approx(1 / 11)  # the first step learns
    assert get_lr(9, cfg) == pytest.approx(10 / 11)
    assert get_lr(10, cfg) == pytest.approx(1.0)
    assert get_lr(60, cfg) == pytest.approx(0.55)  # half way down the cosine: (1 + 0.1) / 2
    assert get_lr(110, cfg) == pytest.approx(0.1) and get_lr(150, cfg) == pytest.approx(0.1)
    lrs = [get_lr(i, cfg) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert get_lr(5, dataclasses.replace(cfg, decay_lr=False)) == 1.0
    assert get_lr(150, dataclasses.replace(cfg, lr_decay_iters=None)) < 1.0  # defaults to max_iters


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_ddp_two_processes_equal_one_process_with_accumulation(data_dir, tmp_path, optimizer):
    """torchrun --nproc_per_node=2 (gloo, 2 micro-steps per rank: the first under no_sync) == 1 process with 4
    micro-steps, same data. With Muon every rank orthogonalises the same all-reduced gradient (rank 0 saves, the
    ranks' losses agree). Each rank does half the work of the one process's step: half its FLOPs (MFU x time), the
    same tokens per step in all (tokens/s x time)."""
    common = dict(gradient_accumulation_steps=4, max_iters=6, eval_interval=3, log_interval=1, dropout=0.0,
                  optimizer=optimizer, muon_ns_dtype="float32", peak_flops=1e15)
    single = tiny_config(data_dir, tmp_path / "single", **common)
    ddp = tiny_config(data_dir, tmp_path / "ddp", **common)
    train(single)
    r = run_script(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                    *config_args(ddp)], timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens per iteration: 512 (2 micro-steps x 2 ranks" in r.stdout
    diff = max_param_diff(params_of(tmp_path / "single" / "ckpt.pt"), params_of(tmp_path / "ddp" / "ckpt.pt"))
    assert diff < 1e-5, diff
    # rank 0 alone logs: one line per step, and the logged loss (mean over ranks) equals the single process'
    single_log = [json.loads(l) for l in open(tmp_path / "single" / "metrics.jsonl")]
    ddp_log = [json.loads(l) for l in open(tmp_path / "ddp" / "metrics.jsonl")]
    assert len(ddp_log) == len(single_log)
    for a, b in zip(single_log, ddp_log):
        for key in ("loss", "val_loss", "train_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-5), (key, a, b)
        if "loss" in a:  # a step's: MFU x time is a rank's FLOPs, tokens/s x time the tokens of all ranks
            assert b["mfu"] * b["ms"] == pytest.approx(a["mfu"] * a["ms"] / 2)
            tokens = 4 * 4 * 32  # gradient_accumulation_steps x batch_size x block_size
            assert a["tok_s"] * a["ms"] / 1000 == pytest.approx(tokens) == b["tok_s"] * b["ms"] / 1000


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(data_dir, tmp_path, optimizer):
    """2N iterations == N iterations + resume for N more: same loss and bitwise-equal parameters (CPU float32),
    with dropout on, so the restored RNG state matters too; the optimizer's state (Adam's moments, Muon's momentum)
    is bitwise the uninterrupted run's."""
    common = dict(max_iters=16, lr_decay_iters=16, eval_interval=8, dropout=0.1, gradient_accumulation_steps=2,
                  optimizer=optimizer)
    full = train(tiny_config(data_dir, tmp_path / "full", **common))
    train(tiny_config(data_dir, tmp_path / "split", **{**common, "max_iters": 8}))
    resumed = train(tiny_config(data_dir, tmp_path / "split", **common, init_from="resume"))
    assert resumed["iter_num"] == full["iter_num"] == 16
    assert resumed["last_loss"] == full["last_loss"]
    a, b = params_of(tmp_path / "full" / "ckpt.pt"), params_of(tmp_path / "split" / "ckpt.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    full_opt = load_checkpoint(str(tmp_path / "full" / "ckpt.pt"))["optimizer"]
    split_opt = load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))["optimizer"]
    states = [(full_opt["muon"]["state"], split_opt["muon"]["state"], "momentum_buffer")] if optimizer == "muon" else []
    adamw = (full_opt["adamw"], split_opt["adamw"]) if optimizer == "muon" else (full_opt, split_opt)
    states.append((adamw[0]["state"], adamw[1]["state"], "exp_avg_sq"))
    for full_state, split_state, key in states:
        assert full_state.keys() == split_state.keys() and len(full_state) > 0
        assert all(torch.equal(full_state[i][key], split_state[i][key]) for i in full_state)


def test_best_val_loss_is_never_overwritten_by_a_worse_value(data_dir, tmp_path):
    out = tmp_path / "out"
    first = train(tiny_config(data_dir, out, max_iters=10, eval_interval=10, learning_rate=1e-2))
    # resume with a learning rate so high that the val loss gets worse; always_save_checkpoint still saves
    worse = train(tiny_config(data_dir, out, max_iters=20, eval_interval=10, learning_rate=5.0, warmup_iters=0,
                              grad_clip=0.0, decay_lr=False, init_from="resume"))
    assert worse["val_loss"] > first["val_loss"] + 0.5  # the case the test is about did happen
    ckpt = load_checkpoint(str(out / "ckpt.pt"))
    assert ckpt["iter_num"] == 20
    assert ckpt["best_val_loss"] == worse["best_val_loss"] == first["val_loss"]


@pytest.mark.slow
def test_compiled_run_matches_eager_and_saves_plain_state(data_dir, tmp_path, capsys):
    common = dict(max_iters=6, eval_interval=3)
    eager = train(tiny_config(data_dir, tmp_path / "eager", **common))
    assert "compiling the model..." not in capsys.readouterr().out
    compiled = train(tiny_config(data_dir, tmp_path / "compiled", compile=True, **common))
    assert "compiling the model..." in capsys.readouterr().out
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4)
    state = params_of(tmp_path / "compiled" / "ckpt.pt")
    assert not any("_orig_mod" in k for k in state)
    assert max_param_diff(state, params_of(tmp_path / "eager" / "ckpt.pt")) < 1e-4


@pytest.fixture()
def restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.slow
@pytest.mark.usefixtures("restore_determinism")
def test_deterministic_makes_compiled_steps_bitwise_repeatable(data_dir, tmp_path):
    # Without it, torch.compile's CPU embedding backward accumulates with atomic adds: the same step's gradient
    # differs in its last bits from call to call (measured on this model: 6 different sums in 6 calls).
    for flag in (True, False):  # train() sets the mode from the config
        train(tiny_config(data_dir, tmp_path / f"det{flag}", max_iters=1, eval_interval=1, eval_iters=1,
                          deterministic=flag))
        assert torch.are_deterministic_algorithms_enabled() is flag
    set_deterministic(True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=1, n_head=2, n_embd=64, attention="math"))
    compiled = torch.compile(model)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 65, (16, 64), generator=gen), torch.randint(0, 65, (16, 64), generator=gen)
    grads = []
    for _ in range(4):
        model.zero_grad()
        compiled(x, y)[1].backward()
        grads.append(model.transformer.wte.weight.grad.clone())
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


@pytest.mark.slow
def test_bf16_autocast_run_tracks_float32(data_dir, tmp_path):
    def run(name: str, **changes) -> tuple[dict, set]:
        """The run's figures, and the dtypes every Linear layer's output had during it."""
        dtypes = set()
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: dtypes.add(out.dtype) if isinstance(module, torch.nn.Linear) else None)
        try:
            return train(tiny_config(data_dir, tmp_path / name, max_iters=30, eval_interval=30, learning_rate=1e-2,
                                     **changes)), dtypes
        finally:
            hook.remove()

    f32, f32_dtypes = run("f32")
    bf16, bf16_dtypes = run("bf16", dtype="bfloat16")
    assert f32_dtypes == {torch.float32} and bf16_dtypes == {torch.bfloat16}  # autocast ran every matmul in bf16
    assert bf16["val_loss"] == pytest.approx(f32["val_loss"], abs=0.05)


@pytest.mark.slow
def test_missing_train_bin_is_a_one_line_error_naming_prepare(tmp_path):
    d = tmp_path / "shakespeare_char"
    make_char_dataset(d)
    os.remove(d / "train.bin")
    r = run_script(["train.py", *config_args(tiny_config(d, tmp_path / "out"))])
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: missing {d / 'train.bin'}: run `python data/shakespeare_char/prepare.py` first"
    ]


def test_a_split_too_short_for_block_size_fails_before_the_model_is_compiled(tmp_path, monkeypatch, capsys):
    """The error came after ~30 s of compiling: now before the model is built (init_model would fail the test)."""
    from nanogpt import start

    d = tmp_path / "small"
    make_char_dataset(d, n_chars=5000)  # val.bin: the last 10%, 500 tokens
    monkeypatch.setattr(start, "init_model", lambda *a: pytest.fail("the model was built before the check"))
    r = run_in_process(["train.py", *config_args(tiny_config(d, tmp_path / "out", compile=True, block_size=600))],
                       capsys)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"error: the val split ({d / 'val.bin'}) has 500 tokens, too few for block_size=600 (a window is block_size "
        f"+ 1 tokens): use --block_size=499 or smaller, or more data"]
    x, y = get_batch(dataio.open_split(d, "val"), 1, 499, batch_generator(0, "eval_val", 0, 0))  # 499 does fit
    assert x.shape == y.shape == (1, 499) and torch.equal(x[0, 1:], y[0, :-1])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lerning_rate=0.1"], "unknown config key 'lerning_rate' (did you mean 'learning_rate'?)"),
        (["--batch_size=big"], "batch_size: expected int, got str 'big'"),
        (["config/no_such_file.py"], "config file not found: 'config/no_such_file.py'"),
        (["--init_from=gpt3"], "init_from='gpt3' is not one of scratch, resume"),
        (["--attention=fast"], "attention='fast' is not one of auto, math, sdpa"),
        (["--gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 must be at least 1"),
        (["--optimizer=sgd"], "optimizer='sgd' is not one of adamw, muon"),
        (["--optimizer=muon", "--parallelism=fsdp"], "optimizer='muon' needs whole matrices, and parallelism='fsdp'"),
    ],
)
def test_bad_input_gets_a_one_line_error(data_dir, tmp_path, args, message, capsys):
    r = run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "out")), *args], capsys)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def wandb_run(data_dir, tmp_path, monkeypatch, capsys):
    """train.py --wandb_log=True, in this process, stopped with a test failure if it gets as far as the model."""
    from nanogpt import start

    monkeypatch.setattr(start, "init_model", lambda *a: pytest.fail("the model was built before wandb's check"))
    return run_in_process(["train.py", *config_args(tiny_config(data_dir, tmp_path / "out")), "--wandb_log=True"],
                          capsys)


def no_wandb_login(monkeypatch, home) -> None:
    """An environment where wandb has no key: a HOME without a netrc file or wandb's settings, no key in the
    environment, online; and wandb's settings, which it reads once per process, read anew (wandb.teardown)."""
    import wandb

    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL", "NETRC",
                "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    wandb.teardown()


def test_wandb_log_without_wandb_installed_is_one_line_before_the_model(data_dir, tmp_path, monkeypatch, capsys):
    hide_module(monkeypatch, "wandb")
    r = wandb_run(data_dir, tmp_path, monkeypatch, capsys)
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "error: wandb_log=True needs wandb, which is not installed: pip install wandb (or --wandb_log=False)"]


def test_wandb_log_without_a_login_names_wandb_login_and_offline_mode(data_dir, tmp_path, monkeypatch, capsys,
                                                                      wandb_settings):
    no_wandb_login(monkeypatch, tmp_path / "home")
    r = wandb_run(data_dir, tmp_path, monkeypatch, capsys)
    assert r.returncode == 2
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: wandb_log=True but wandb has no API key for https://") and line.endswith(
        ": run `wandb login` once, or log offline with WANDB_MODE=offline (upload later with `wandb sync`), or set "
        "--wandb_log=False"), line


def test_the_log_lists_the_settings_that_differ_from_the_defaults_and_counts_in_words(data_dir, tmp_path, capsys):
    train(tiny_config(data_dir, tmp_path / "out", max_iters=0, eval_iters=1))
    out = capsys.readouterr().out
    assert not re.search(r"^\w+ = ", out, re.M)  # not a line per key (~50 of them)
    assert out.startswith("config (differs from the defaults): ")
    config = out[:out.index("\npython=")]  # the next line: versions and hardware
    items = re.split(r",\s+(?=\w+=)", config.removeprefix("config (differs from the defaults): "))
    # what tiny_config sets but wandb_log=False (the default), and max_iters and eval_iters (set here); not
    # attention (set by no one, resolved from "auto" for the log's next lines)
    assert {item.split("=")[0] for item in items} == {
        "dataset", "data_dir", "out_dir", "n_layer", "n_head", "n_embd", "block_size", "batch_size",
        "gradient_accumulation_steps", "max_iters", "eval_interval", "eval_iters", "log_interval", "warmup_iters",
        "learning_rate", "min_lr", "compile", "device", "dtype", "report"}
    assert "n_layer=2" in items and f"data_dir={str(data_dir)!r}" in items
    assert "tokens per iteration: 128 (1 micro-step x 1 rank x 4 x 32)" in out


def test_none_default_can_be_overridden_on_the_command_line(data_dir, tmp_path):
    from configurator import configure

    cfg = configure(TrainConfig(), ["--lr_decay_iters=500", "--data_dir=" + str(data_dir)])
    assert cfg.lr_decay_iters == 500 and cfg.data_dir == str(data_dir)


def readme_train_commands() -> list[tuple[str, list[str], int]]:
    """(line, train.py arguments, world size) of every `python train.py` / `torchrun ... train.py` command in the
    sh code blocks of README.md and docs/*.md."""
    import re

    from helpers import doc_shell_lines

    commands = []
    for line, words in doc_shell_lines():
        for i, word in enumerate(words):
            if word == "train.py" and i > 0 and (words[i - 1] == "python" or words[0] == "torchrun"):
                args = list(itertools.takewhile(lambda w: w != "&&", words[i + 1:]))
                flags = dict(re.findall(r"--(nnodes|nproc_per_node)=(\d+)", " ".join(words[:i])))
                world_size = int(flags.get("nnodes", 1)) * int(flags.get("nproc_per_node", 1))
                commands.append((line, args, world_size))
    return commands


def test_every_readme_train_command_is_a_valid_config_for_its_world_size():
    from configurator import configure
    pass

    commands = readme_train_commands()
    assert len(commands) >= 7  # quickstart, one GPU, overrides, 8 GPUs, CPU DDP, two multi-node lines
    optimizers = {a for _, args, _ in commands for a in args if a.startswith("--optimizer=")}
    assert optimizers >= {"--optimizer=adamw", "--optimizer=muon"}  # the measured AdamW/Muon runs (docs/performance.md)
    for line, args, world_size in commands:
        cfg = configure(TrainConfig(), args)
        try:
            cfg.check(world_size)
        except UserError as e:
            pytest.fail(f"README/docs command `{line}`: {e}")


def test_resume_at_or_past_max_iters_evaluates_in_one_line_and_saves_nothing(data_dir, tmp_path, capsys):
    """Bug: a checkpoint at iter 15 resumed with max_iters=12 (15 not a multiple of eval_interval) ended in
    UnboundLocalError ('losses')."""
    out = tmp_path / "out"
    train(tiny_config(data_dir, out, max_iters=15, eval_interval=10))
    before = (out / "ckpt.pt").read_bytes()
    capsys.readouterr()
    for max_iters in (12, 15):
        result = train(tiny_config(data_dir, out, max_iters=max_iters, eval_interval=10, init_from="resume"))
        assert result["iter_num"] == 15 and math.isfinite(result["val_loss"])
        lines = [ln for ln in capsys.readouterr().out.splitlines() if "nothing to train" in ln]
        assert lines == [f"nothing to train: the checkpoint is at iter 15 and max_iters={max_iters}; "
                         f"evaluating it only (raise max_iters to train on)"]
    assert (out / "ckpt.pt").read_bytes() == before


def test_a_run_with_no_attention_or_dtype_key_takes_the_fast_path_for_this_cpu(data_dir, tmp_path, capsys):
    """dtype and attention left at 'auto': bf16 + math attention on a CPU with bf16 in hardware, float32 + SDPA on
    one without (this AMD EPYC: AVX2 only, where emulated bf16 is slower than float32); the line says why."""
    flags = open("/proc/cpuinfo").read().split()
    native_bf16 = "avx512_bf16" in flags or "amx_tile" in flags
    out = train(tiny_config(data_dir, tmp_path / "out", max_iters=2, eval_interval=2, dtype="auto"))
    printed = capsys.readouterr().out
    dtype, attention = ("bfloat16", "math") if native_bf16 else ("float32", "sdpa")
    assert out["model"].config.attention == attention
    assert f"defaults: dtype={dtype} (auto: this CPU has " in printed and f"attention={attention} (auto: " in printed
    saved = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)
    assert saved["model_args"]["attention"] == attention and saved["config"]["attention"] == "auto"  # as the user left
    # it: resolved again where the run resumes
    explicit = train(tiny_config(data_dir, tmp_path / "x", max_iters=0, dtype="auto", attention="math"))
    assert explicit["model"].config.attention == "math" and "attention=math (set explicitly)" in capsys.readouterr().out


def test_cpu_run_logs_mfu_against_the_given_or_measured_peak(data_dir, tmp_path, capsys):
    cfg = tiny_config(data_dir, tmp_path / "out", max_iters=3, eval_interval=100, log_interval=1, peak_flops=1e12)
    out = train(cfg)
    assert "MFU peak: 1.000 TFLOP/s (--peak_flops)" in capsys.readouterr().out
    flops_per_iter = out["model"].flops_per_token(32) * 32 * cfg.batch_size  # PaLM's 6N + attention, per token
    for record in (json.loads(l) for l in open(tmp_path / "out" / "metrics.jsonl")):
        if "mfu" in record:
            assert record["mfu"] == pytest.approx(flops_per_iter / (record["ms"] / 1000) / 1e12, rel=1e-9)


def test_a_resume_announces_only_the_settings_the_user_changed(data_dir, tmp_path, capsys):
    """Bug: `--init_from=resume --out_dir=X --max_iters=8` after a CPU run announced `device: 'cpu' -> 'auto'` (and the
    backend), keys nobody gave; the resolved attention was stored as if the user had chosen a kernel."""
    from helpers import run_in_process

    out = tmp_path / "out"
    first = ["train.py", *config_args(tiny_config(data_dir, out, max_iters=4, eval_interval=4, attention="auto"))]
    assert run_in_process(first, capsys).returncode == 0
    r = run_in_process(["train.py", "--init_from=resume", f"--out_dir={out}", "--max_iters=8"], capsys)
    assert r.returncode == 0
    assert [line for line in r.stdout.splitlines() if "changed setting" in line] == [
        "resuming with a changed setting (it applies from here on): max_iters: 4 -> 8"]


def test_a_step_that_fails_leaves_the_step_before_logged(data_dir, tmp_path, monkeypatch):
    """Each step's figures are read one step late, so the step before a failing one (out of memory, a second Ctrl-C)
    was not yet logged when it failed: its line is written before the error goes on, as a loop reading each step at
    once would have written it (log_interval=1: iters 1-3 logged, the 4th step fails)."""
    import train as train_module
    from nanogpt.metrics import read_records

    real_step, calls = train_module.train_step, []

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("CUDA out of memory (the test's)")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", step)
    with pytest.raises(RuntimeError, match="the test's"):
        train(tiny_config(data_dir, tmp_path / "out", max_iters=6, eval_interval=100, log_interval=1))
    records = [r for r in read_records(str(tmp_path / "out" / "metrics.jsonl")) if "loss" in r and "ms" in r]
    assert [r["iter"] for r in records] == [1, 2, 3]


def test_each_logged_step_time_is_that_steps_own_the_last_one_too(data_dir, tmp_path, monkeypatch):
    """train.py logs each step's time as step.OneStepLate measures it, from the end of the step before to its own
    end: on a clock the test moves by 40 ms in each step and by 1 s in each eval, every logged step took 40 ms, the
    one after an eval (which is not part of it) and the last (read at the final eval) included."""
    from nanogpt import measure
    import train as train_module
    from nanogpt.metrics import read_records

    now = {"t": 0.0}
    monkeypatch.setattr(measure.time, "perf_counter", lambda: now["t"])
    real_step, real_eval = train_module.train_step, train_module.estimate_loss

    def step(*args, **kwargs):
        now["t"] += 0.040
        return real_step(*args, **kwargs)

    def evaluate(*args, **kwargs):
        now["t"] += 1.0
        return real_eval(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_step", step)
    monkeypatch.setattr(train_module, "estimate_loss", evaluate)
    train(tiny_config(data_dir, tmp_path / "out", max_iters=6, eval_interval=3, log_interval=1, peak_flops=1e12))
    records = [r for r in read_records(str(tmp_path / "out" / "metrics.jsonl")) if "ms" in r]
    assert [r["iter"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["ms"] for r in records] == pytest.approx([40.0] * 6)
    assert records[-1]["tok_s"] == pytest.approx(4 * 32 / 0.040)  # 1 micro-step x 4 x 32 tokens


def test_vocab_padding_does_not_change_the_run(data_dir, tmp_path):
    """vocab_padding_multiple is a speed switch: the unpadded run's first logged figures (the eval at iter 0, the
    first step's loss) are the padded run's too."""
    from nanogpt.metrics import read_records

    firsts = []
    for multiple in (1, 64):
        out = tmp_path / f"pad{multiple}"
        train(tiny_config(data_dir, out, max_iters=1, eval_interval=1, log_interval=1, vocab_padding_multiple=multiple))
        records = read_records(str(out / "metrics.jsonl"))
        firsts.append((next(r["val_loss"] for r in records if "val_loss" in r),
                       next(r["loss"] for r in records if "ms" in r)))
    assert firsts[1] == pytest.approx(firsts[0], abs=1e-6, rel=0)
