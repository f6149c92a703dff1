"""
bench.py in tiny configs on the CPU: one run's figures and its JSON, the profile, config errors. Timings on a shared
machine are noisy, so no test checks how fast anything is: the figures are checked against a clock the test
controls and FLOPs counted by PyTorch's FlopCounterMode.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import bench
from nanogpt import measure
from nanogpt.measure import matmul_floor
from nanogpt.mfu import PEAK_CACHE
from nanogpt.errors import UserError
from helpers import HANG_S, make_char_dataset, run_script
from model import GPT, GPTConfig

# No config file: on the CPU bench.py loads config/bench_cpu.py first, and these overrides replace its sizes.
TINY = [
    "--device=cpu", "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=2",
    "--vocab_size=300", "--warmup_steps=1", "--timed_steps=3", "--compile=False", "--dtype=float32",
]
# One thread: a tiny model gains nothing from two, and two threads of a shared machine make the timings erratic.
# The studies' rows must inherit it (the same environment for every row).
ENV = {"OMP_NUM_THREADS": "1"}


def bench_script(*args: str, script: str = "bench.py", timeout: float = HANG_S) -> str:
    r = run_script([script, *TINY, *args], timeout=timeout, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def table_rows(out: str, first_cells: tuple[str, ...]) -> list[list[str]]:
    """The cells of the Markdown table rows whose first cell is one of `first_cells`."""
    rows = []
    for line in out.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] in first_cells:
                rows.append(cells)
    return rows


def number(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


@pytest.mark.slow
def test_a_run_prints_its_figures_and_writes_the_same_to_its_json(tmp_path):
    out = bench_script(f"--result_json={tmp_path / 'run.json'}")
    assert "device is cpu and no config file was given: loading config/bench_cpu.py" in out
    assert "allocator: glibc malloc" in out or re.search(r"allocator: (jemalloc|tcmalloc|mimalloc)", out)
    assert "2 layers, 2 heads, n_embd 64, block 64, vocab 300 (padded to 320)" in out  # overrides beat the file
    assert "1 micro-step x 2 x 64 tokens = 128 tokens/iter; 1 warm-up + 3 timed steps; random tokens" in out
    assert ", fused_loss=True" in out  # the CPU's default loss, handed to the model
    # progress while it works, before the figures (a compiled CPU run is silent for a minute otherwise)
    lines = out.splitlines()
    progress = [line for line in lines if line.endswith("...")]
    assert progress == ["warming up: 1 step...", "timing 3 steps...", "measuring the matmul floor..."]
    assert lines.index(progress[-1]) < next(i for i, line in enumerate(lines) if line.startswith("ms/iter:"))
    saved = json.loads((tmp_path / "run.json").read_text())
    ms = re.search(r"ms/iter: median ([\d.]+) \(mean ([\d.]+), min ([\d.]+), IQR ([\d.]+)-([\d.]+), max ([\d.]+)\) "
                   r"over 3", out)
    assert ms and [float(v) for v in ms.groups()] == pytest.approx(
        [saved[k] for k in ("ms_median", "ms_mean", "ms_min", "ms_q1", "ms_q3", "ms_max")], abs=0.01)
    assert f"tokens/s: {saved['tokens_per_s']:,.0f} (128 tokens/iter" in out
    # on the CPU the MFU divides by the CPU's own measured matmul peak in the run's dtype
    assert f"measured float32 matmul peak of this CPU ({PEAK_CACHE}))" in out and saved["mfu"] > 0
    # the floor line, and the step's multiple of it as the JSON has it
    floor = re.search(r"matmul floor: ([\d.]+) ms \((\d+) matmuls of the step.*takes ([\d.]+)x its floor", out)
    assert float(floor.group(1)) == pytest.approx(saved["matmul_floor_ms"], abs=0.006) and int(floor.group(2)) > 0
    assert float(floor.group(3)) == pytest.approx(saved["ms_median"] / saved["matmul_floor_ms"], abs=0.006)
    peak = re.search(r"peak memory: ([\d.]+) MiB \((.+)\)", out)
    assert float(peak.group(1)) == pytest.approx(saved["peak_memory_mib"], abs=0.05) and saved["peak_memory_mib"] > 0
    assert "VmHWM" in peak.group(2) and "before the first step" in peak.group(2)
    # random tokens: the untrained model's loss is about ln(vocabulary)
    assert f"loss: {saved['loss']:.4f} after the timed steps, {saved['initial_loss']:.4f} before" in out
    assert abs(saved["initial_loss"] - math.log(300)) < 0.5 and saved["loss"] < saved["initial_loss"]
    assert saved["config"]["n_embd"] == 64 and saved["threads"] == 1 and len(saved["ms"]) == 3
    assert f"other processes took {saved['others_cpu']:.0%} of the CPUs during the timed steps" in out
    assert "max_iters" not in saved["config"]  # BenchConfig carries the keys of a step, not of a training run


class FakeClock:
    """perf_counter for bench.py: time moves only when a step runs, by the step's given duration."""

    def __init__(self, step_ms: list[float]):
        self.now, self.step_ms = 0.0, iter(step_ms)

    def __call__(self) -> float:
        return self.now

    def advance(self) -> None:
        self.now += next(self.step_ms) / 1000


@pytest.mark.slow
def test_figures_follow_the_step_times_and_the_counted_flops(tmp_path, monkeypatch, capsys):
    """In-process run with a clock the test controls: the timed steps take 30, 10, 50, 20, 40 ms. The MFU's
    expected value comes from FLOPs that PyTorch's FlopCounterMode counts in one real training step."""
    data_dir = tmp_path / "tinychar"
    meta = make_char_dataset(data_dir)
    cfg, _ = bench.load_config([*TINY, "--real_data=True", f"--data_dir={data_dir}", "--gradient_accumulation_steps=2",
                                "--warmup_steps=0", "--timed_steps=5", "--peak_flops=1e12"])
    # math attention: the counter sees its matmuls (it has no formula for the CPU's fused SDPA kernel)
    run = bench.setup_run(dataclasses.replace(cfg, attention="math"))
    batches = bench.step_batches(run["cfg"], 0, run["data_path"])
    with FlopCounterMode(display=False) as counter:
        bench.train_step(run["model"], run["optimizer"], run["scaler"], batches, run["ctx"], cfg, bench.Dist())
    flops_per_step = counter.get_total_flops()

    clock = FakeClock([30, 10, 50, 20, 40])
    real_step = bench.train_step
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    monkeypatch.setattr(bench, "train_step", lambda *a: (clock.advance(), real_step(*a))[1])
    monkeypatch.setattr(measure, "matmul_floor", lambda *a, **k: (7.5, 21))  # the fake clock cannot time it
    r = bench.run_bench(cfg)["result"]
    assert r["ms"] == pytest.approx([30, 10, 50, 20, 40])
    assert (r["ms_min"], r["ms_q1"], r["ms_median"], r["ms_q3"], r["ms_max"]) == pytest.approx((10, 20, 30, 40, 50))
    assert r["tokens_per_iter"] == 2 * 2 * 64 and r["tokens_per_s"] == pytest.approx(256 / 0.030)
    # the model's 6N + 12·L·C·T per token estimate against the counted matmuls (LayerNorm weights aside)
    assert r["mfu"] == pytest.approx(flops_per_step / 0.030 / 1e12, rel=0.02)
    assert r["floor_multiple"] == pytest.approx(30 / 7.5) and r["peak_source"] == "--peak_flops"
    assert r["loss"] < r["initial_loss"] - 0.05  # real text is learnable, even in 5 steps
    assert r["warmup_s"] == 0 and f"vocab {meta['vocab_size']} (padded to 64)" in capsys.readouterr().out


def test_the_warm_up_time_is_the_warm_up_steps_own(monkeypatch, capsys):
    """The compile modes' cost is their compile time: bench.py reports the warm-up steps' wall time (the first
    compiles), apart from the timed steps' (fake clock: warm-up steps of 900 and 40 ms, timed ones of 10 ms)."""
    cfg, _ = bench.load_config([*TINY, "--warmup_steps=2", "--timed_steps=3", "--peak_flops=1e12"])
    clock = FakeClock([900, 40, 10, 10, 10])
    real_step = bench.train_step
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    monkeypatch.setattr(bench, "train_step", lambda *a: (clock.advance(), real_step(*a))[1])
    monkeypatch.setattr(measure, "matmul_floor", lambda *a, **k: (7.5, 21))
    r = bench.run_bench(cfg)["result"]
    assert r["warmup_s"] == pytest.approx(0.94) and r["ms"] == pytest.approx([10, 10, 10])
    bench.print_result(r)
    assert "warm-up: 0.9 s\n" in capsys.readouterr().out  # compile=False: nothing compiled


@pytest.mark.slow
def test_the_optimizers_share_of_the_step_is_each_optimizers_own_time(monkeypatch, capsys):
    """With Muon, AdamW's step takes 2 ms and Muon's 5 ms on the test's clock, inside steps of 30 + 7 and 10 + 7 ms:
    bench reports each optimizer's time per step and their share of the mean step, 7 / 27."""
    cfg, _ = bench.load_config([*TINY, "--optimizer=muon", "--warmup_steps=0", "--timed_steps=2", "--peak_flops=1e12"])
    clock = FakeClock([30, 10])
    real_step = bench.train_step
    monkeypatch.setattr(bench.time, "perf_counter", clock)
    monkeypatch.setattr(bench, "train_step", lambda *a: (clock.advance(), real_step(*a))[1])
    monkeypatch.setattr(measure, "matmul_floor", lambda *a, **k: (7.5, 21))
    real_setup = bench.setup_run

    def setup_with_slow_optimizers(cfg):
        run = real_setup(cfg)
        for name, opt in run["optimizer"].optimizers.items():
            def slow_step(*a, _step=opt.step, _ms={"adamw": 2, "muon": 5}[name], **k):
                clock.now += _ms / 1000
                return _step(*a, **k)
            opt.step = slow_step
        return run

    monkeypatch.setattr(bench, "setup_run", setup_with_slow_optimizers)
    r = bench.run_bench(cfg)["result"]
    assert r["ms"] == pytest.approx([37, 17])
    assert r["optimizer_ms"] == pytest.approx({"adamw": 2.0, "muon": 5.0})
    assert r["optimizer_share"] == pytest.approx(7 / 27)
    bench.print_result(r)
    out = capsys.readouterr().out
    assert "optimizer: 7.00 ms per step (muon 5.00 ms, adamw 2.00 ms), 25.9% of the mean step" in out


@pytest.mark.slow
def test_profile_writes_a_chrome_trace_and_prints_the_top_ops(tmp_path):
    out = bench_script("--profile=True", f"--results_dir={tmp_path}")
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "aten::mm" in names and any(n.startswith("Optimizer.step") for n in names)
    assert "Self CPU" in out and "aten::mm" in out
    assert "profiling 5 more steps..." in out  # after the timed steps: the profiler's cost stays out of the timings
    assert f"chrome trace of the profiled steps in {tmp_path / 'trace.json'}" in out


def test_config_errors_are_listed_in_one_message():
    with pytest.raises(UserError) as e:
        bench.load_config(["--device=cpu", "--timed_steps=0", "--warmup_steps=-1", "--batch_size=0"])
    message = str(e.value)
    assert "timed_steps=0 must be at least 1" in message and "warmup_steps=-1 must be at least 0" in message
    assert "batch_size=0 must be at least 1" in message
    with pytest.raises(UserError, match="^max_iters is train.py's setting, not this command's"):
        bench.load_config(["--device=cpu", "--max_iters=5"])  # a training run's key, not a benchmark's


def test_a_result_json_that_cannot_be_written_is_refused_before_the_timing(tmp_path):
    """Bug: --result_json under a file was a traceback after the whole benchmark had run."""
    (tmp_path / "afile").write_text("mine\n")
    for path, why in [(tmp_path / "afile" / "x.json", f"{tmp_path / 'afile'} is a file, not a folder"),
                      (tmp_path, f"{tmp_path} is a folder, not a file")]:
        with pytest.raises(UserError, match=f"^result_json='{path}': {why}$"):
            bench.load_config(["--device=cpu", f"--result_json={path}"])
    cfg, _ = bench.load_config(["--device=cpu", f"--result_json={tmp_path / 'new' / 'x.json'}"])  # made on write
    assert cfg.result_json == str(tmp_path / "new" / "x.json")


def test_padding_rows_do_not_change_the_initial_weights():
    """Runs with and without vocabulary padding train the same model: the same weights, zero padding rows."""
    cfg, _ = bench.load_config(TINY)
    plain = bench.build_model(cfg, cfg.machine(), vocab_padding_multiple=1).state_dict()
    padded = bench.build_model(cfg, cfg.machine(), vocab_padding_multiple=64).state_dict()
    for name, w in plain.items():
        assert torch.equal(padded[name][: w.size(0)], w), name
    assert padded["transformer.wte.weight"].shape == (320, 64) and not padded["transformer.wte.weight"][300:].any()


def readme_commands(scripts: tuple[str, ...]) -> list[tuple[str, str, list[str]]]:
    """(line, script, arguments) of every `python SCRIPT ...` command in the sh code blocks of README.md and
    docs/*.md, one per `&&`-joined command of a line."""
    from helpers import doc_shell_lines

    commands = []
    for line, words in doc_shell_lines():
        while words:
            end = words.index("&&") if "&&" in words else len(words)
            command, words = words[:end], words[end + 1:]
            if len(command) >= 2 and command[0] == "python" and command[1] in scripts:
                commands.append((line, command[1], command[2:]))
    return commands


STUDIES = ("bench.py", "benchmarks/ablation.py", "benchmarks/numerics.py", "benchmarks/memory.py",
           "benchmarks/gpu.py")


def test_every_readme_bench_and_study_command_is_a_valid_config(tmp_path):
    """Every bench.py and study command of the README and docs/ parses: bench.py's keys (and a study's own), and the
    argparse studies' arguments. A --nanogpt=PATH (the user's checkout of nanoGPT) is given a folder with nanoGPT's
    file names."""
    from benchmarks import ablation, gpu, memory
    from benchmarks import study_config
    from configurator import configure

    commands = readme_commands(STUDIES)
    assert {script for _, script, _ in commands} == set(STUDIES)
    for line, script, args in commands:
        try:
            if script == "benchmarks/gpu.py":
                for name in ("bench.py", "model.py", "configurator.py"):
                    (tmp_path / name).touch()
                gpu.parse_args([f"--nanogpt={tmp_path}" if a.startswith("--nanogpt=") else a for a in args])
                continue
            if script == "benchmarks/ablation.py":
                own, args = study_config(ablation.AblationConfig(), args, bench.BenchConfig())
                ablation.selected_rows(own, "cpu")
            elif script == "benchmarks/memory.py":
                own, args = study_config(memory.MemoryConfig(), args, bench.BenchConfig())
            if "--device=cuda" in args:  # a GPU command: its keys and values, not this machine's devices
                configure(bench.BenchConfig(), args)
                continue
            bench.load_config(args)
        except UserError as e:
            pytest.fail(f"README/docs command `{line}`: {e}")
        except SystemExit as e:  # argparse's usage error
            pytest.fail(f"README/docs command `{line}`: argparse exited with {e.code}")


def test_matmul_floor_replays_every_matmul_of_the_forward_and_backward():
    """One layer, math attention, plain loss: the forward has 5 linears (q/k/v, attention output, MLP in and out,
    head) and 2 attention products; the backward two matmuls for each of those 7 (gradient of input and of weight
    or of the other operand): 21, counted by hand from the model's structure."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, attention="math"))
    x = torch.randint(0, 50, (2, 16))
    ms, n = matmul_floor(model, [(x, x)], torch.autocast("cpu", enabled=False), "cpu", repeats=1)
    assert n == 21 and ms > 0
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind for the timed steps
    _, n_two = matmul_floor(model, [(x, x), (x, x)], torch.autocast("cpu", enabled=False), "cpu", repeats=1)
    assert n_two == 42  # every micro-batch of the step


def test_matmul_floor_counts_the_fused_losss_in_place_and_out_matmuls(monkeypatch):
    """The fused loss writes its head products with mm(out=) and accumulates the head's weight gradient with
    addmm_: 3 matmuls per chunk, in place of the plain head's 3. 32 tokens in chunks of 8 rows: 4 chunks, so
    18 matmuls for the layer (as above, less the head) + 12 for the head; the floor's replay keeps their layouts."""
    from nanogpt import fused_loss

    monkeypatch.setattr(fused_loss.fused_linear_cross_entropy, "__defaults__", (8,))
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=32, attention="math"))
    model.head_loss = fused_loss.fused_linear_cross_entropy
    x = torch.randint(0, 50, (2, 16))
    _, n = matmul_floor(model, [(x, x)], torch.autocast("cpu", enabled=False), "cpu", repeats=1)
    assert n == 18 + 4 * 3


def test_floor_operands_are_fresh_per_call_except_large_ones(monkeypatch):
    """Small operands are new tensors per replayed call (no call finds another's in cache); those over
    SHARED_OPERAND_BYTES are one per shape and dtype (GPT-2's 48 loss chunks would otherwise hold gigabytes)."""
    from nanogpt import measure

    seen = []

    def mm(a, b):
        seen.append((a, b))
        return a @ b

    recorded = [(mm, [(4, 8), (8, 2)], [torch.bfloat16, torch.bfloat16])] * 2
    monkeypatch.setattr(measure, "recorded_matmuls", lambda run: recorded)
    measure.replayed_matmuls(lambda: None, "cpu", repeats=1)
    assert seen[0][0] is not seen[1][0] and seen[0][1].dtype == torch.bfloat16 and seen[0][0].float().std() > 0.5
    monkeypatch.setattr(measure, "SHARED_OPERAND_BYTES", 32)  # 4 x 8 bf16 = 64 bytes: shared now; 8 x 2 bf16 not
    seen.clear()
    measure.replayed_matmuls(lambda: None, "cpu", repeats=1)
    assert seen[0][0] is seen[1][0] and seen[0][1] is not seen[1][1]


@pytest.mark.slow
def test_the_profiled_steps_come_after_the_loss_so_it_is_the_same_with_or_without_them(tmp_path):
    """--profile runs 5 more steps under the profiler after the timed ones; the held-out loss is taken before them,
    so a profiled run reports the loss every run reports, after the timed steps."""
    losses = []
    for profile in (False, True):
        cfg, _ = bench.load_config([*TINY, "--warmup_steps=1", "--timed_steps=2", f"--profile={profile}",
                                    f"--results_dir={tmp_path}"])
        losses.append(bench.run_bench(cfg)["result"]["loss"])
    assert losses[0] == losses[1]


def test_a_floor_that_runs_out_of_gpu_memory_loses_no_timed_figure(tmp_path, monkeypatch, capsys):
    """Seen on an H100: compile_mode=reduce-overhead at 64 x 1024 timed its 20 steps, then the matmul floor's eager
    step ran out of the memory the CUDA graphs kept, and the row was lost in a traceback."""
    def out_of_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.28 GiB.")

    monkeypatch.setattr(measure, "matmul_floor", out_of_memory)
    bench.main([*TINY, "--peak_flops=1e12", f"--result_json={tmp_path / 'run.json'}"])
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "run.json").read_text())
    assert len(saved["ms"]) == 3 and saved["tokens_per_s"] > 0 and saved["matmul_floor_ms"] is None
    assert saved["floor_multiple"] is None and "ms/iter: median" in out and "tokens/s:" in out
    assert "matmul floor: n/a (the GPU had no memory left for the eager step it replays (CUDA graphs keep theirs))" in out


def test_a_file_of_another_kind_is_never_written_over_and_a_results_dir_that_is_a_file_is_refused(tmp_path):
    """A review's reproduction: --result_json=RUN/ckpt.pt replaced the run's checkpoint with JSON, exit 0; and
    --profile with results_dir naming a file ended in FileExistsError after the whole benchmark. Both are refused
    before the timing; an earlier result of bench.py's is written over as before."""
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04 a checkpoint")
    with pytest.raises(UserError, match=re.escape(f"result_json='{tmp_path / 'ckpt.pt'}': {tmp_path / 'ckpt.pt'} exists "
                                                  f"and is not a bench.py result: it is not written over")):
        bench.load_config(["--device=cpu", f"--result_json={tmp_path / 'ckpt.pt'}"])
    (tmp_path / "old.json").write_text(json.dumps({"config": {"batch_size": 4}, "ms_per_iter": 9.0}))
    bench.load_config(["--device=cpu", f"--result_json={tmp_path / 'old.json'}"])  # a rerun's: accepted
    with pytest.raises(UserError, match=re.escape(f"results_dir='{tmp_path / 'ckpt.pt'}' is a file, not a folder")):
        bench.load_config(["--device=cpu", "--profile=True", f"--results_dir={tmp_path / 'ckpt.pt'}"])
    assert (tmp_path / "ckpt.pt").read_bytes() == b"PK\x03\x04 a checkpoint"
