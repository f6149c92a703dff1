"""
What a training step costs on this machine: ms/iter, tokens/s, MFU, its matmul floor, the optimizer's share of it,
peak memory, and the warm-up's wall time (with compile=True, the compile's cost).

$ python bench.py                       # GPT-2 124M, batch 12 x 1024 on a GPU; on the CPU, config/bench_cpu.py
$ python bench.py config/bench_cpu.py --dtype=float32 --attention=math
$ python bench.py --profile=True        # then 5 steps under the profiler: a chrome trace, the top ops, GPU busy

The studies in benchmarks/ (ablation.py, numerics.py, memory.py, gpu.py) run bench.py in fresh processes and read
its --result_json. Config: nanogpt/config.py's StepConfig keys plus BenchConfig's, through the same configurator;
on the CPU without a config file, config/bench_cpu.py is loaded first (a line says so).

One run times step.train_step, the real training step, as train.py's loop runs it: after warm-up steps that absorb
one-off costs (allocation, kernel choice, compile), each step's batches are drawn on the host and the step queued while
the device still runs the one before; the step's figures are read one step late (step.OneStepLate), and nothing inside
the timed steps waits for the device (the steps' times are CUDA events on a GPU, the optimizer's too). Every run draws
the same batches and starts from the same weights whatever the vocabulary padding, so runs with different techniques
train the same model on the same data and their losses compare. On a shared CPU each run says what share of the CPUs
other processes took meanwhile. The studies in benchmarks/ build on this script, never the reverse.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from configurator import configure
from model import GPT
from nanogpt import dataio, files, float8
from nanogpt.config import AtLeast0, AtLeast1, Machine, StepConfig, check
from nanogpt.device import DeviceClock, autocast_context, resolve_device, set_tf32, synchronize
from nanogpt.distributed import Dist
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.hardware import check_attention_kernel, use_flash_impl
from nanogpt.measure import (OptimizerTimer, OtherLoad, PeakMemory, allocator_line, detect_allocator, gpu_busy_share,
                             is_result, machine_line, matmul_floor_or_why, step_profiler, write_json, write_profile)
from nanogpt.mfu import mfu_text, resolve_peak_flops
from nanogpt.optim import build_optimizer
from nanogpt.step import OneStepLate, batch_generator, get_batch, model_config, set_head_loss, setup_process, train_step
from nanogpt.text import plural

ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_CONFIG = os.path.join(ROOT, "config", "bench_cpu.py")
PROFILED_STEPS = 5  # --profile: steps under the profiler, after the timed ones


@dataclass
class BenchConfig(StepConfig):
    # a benchmark step is one optimizer step of batch_size x block_size tokens, as nanoGPT's bench.py
    gradient_accumulation_steps: AtLeast1[int] = 1
    vocab_size: AtLeast1[int] = 50257  # random tokens come from this vocabulary (real_data: the dataset's meta.json)
    real_data: bool = False  # batches of data/<dataset>/train.bin (step.get_batch) instead of random tokens
    warmup_steps: AtLeast0[int] = 10  # untimed steps first
    timed_steps: AtLeast1[int] = 20
    profile: bool = False  # also 5 steps under torch.profiler: a chrome trace in results_dir, top ops, GPU busy share
    results_dir: str = "bench_results"  # trace.json, and the studies' JSON and PNG files
    result_json: str = ""  # also write this run's figures to this file (the studies read it)


def load_config(argv: list[str], usage: str | None = None) -> tuple[BenchConfig, list[str]]:
    """The config, and the argv that rebuilds it (with config/bench_cpu.py when it was loaded automatically).
    `usage`: what --help prints above the keys (default: this module's docstring)."""
    cfg = configure(BenchConfig(), argv, usage)
    given_file = any(not a.startswith("--") for a in argv)
    if not given_file and resolve_device(cfg.device) == "cpu":
        print(f"device is cpu and no config file was given: loading {os.path.relpath(CPU_CONFIG)} (a CPU-sized "
              f"model; give a config file to choose another)")
        argv = [os.path.relpath(CPU_CONFIG), *argv]  # the overrides still win
        cfg = configure(BenchConfig(), argv)
    problems = cfg.problems(world_size=1)  # StepConfig's: the declared values (BenchConfig's too), the machine
    if "RANK" in os.environ:
        problems.append("bench.py measures one process: run it with python, not torchrun")
    if cfg.result_json and (why := files.target_problem(cfg.result_json)
                            or files.replaced_problem(cfg.result_json, is_result, "a bench.py result")):
        problems.append(f"result_json={cfg.result_json!r}: {why}")  # before minutes of timing
    if cfg.profile and os.path.lexists(cfg.results_dir) and not os.path.isdir(cfg.results_dir):
        problems.append(f"results_dir={cfg.results_dir!r} is {files.kind_of(cfg.results_dir)}, not a folder: give "
                        f"a folder for the profiler's trace")
    check(problems)
    return cfg, argv


# ----------------------------------------------------------------------------------------------- model and batches


def build_model(cfg: BenchConfig, machine: Machine, **changes) -> GPT:
    """The model of `cfg`, initialised from cfg.seed (the same weights whatever the vocabulary padding: model.py)."""
    torch.manual_seed(cfg.seed)
    return set_head_loss(GPT(dataclasses.replace(model_config(cfg, cfg.vocab_size, machine), **changes)), machine)


@functools.lru_cache(maxsize=4)
def zipf_probs(vocab_size: int) -> torch.Tensor:
    """P(token k) proportional to 1/(k + 1), as word frequencies in text."""
    p = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
    return p / p.sum()


def draw_batch(cfg: BenchConfig, gen: torch.Generator, data_path: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """
    x, y (B, T): windows of the dataset, or random tokens. The random tokens are independent draws with Zipf
    frequencies: the model can learn their distribution (the loss falls from ~ln(vocab_size) towards its
    entropy), so the loss after the steps shows whether a technique changed what training computes.
    """
    if data_path is not None:
        return get_batch(data_path, cfg.batch_size, cfg.block_size, gen)
    B, T = cfg.batch_size, cfg.block_size
    tokens = torch.multinomial(zipf_probs(cfg.vocab_size), B * (T + 1), replacement=True, generator=gen)
    tokens = tokens.view(B, T + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # targets: the next token


def step_batches(cfg: BenchConfig, step: int, data_path: str | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of one optimizer step: the same for every run with the same seed."""
    return [draw_batch(cfg, batch_generator(cfg.seed, "train", step, i), data_path)
            for i in range(cfg.gradient_accumulation_steps)]


@torch.no_grad()
def held_out_loss(model: GPT, cfg: BenchConfig, ctx, device: str, data_path: str | None) -> float:
    """The loss on a fixed batch no step trained on (random tokens of another stream, or val.bin's): what the
    steps left the model at."""
    val_path = None if data_path is None else os.path.join(os.path.dirname(data_path), "val.bin")
    x, y = draw_batch(cfg, batch_generator(cfg.seed, "eval_val", 0, 0), val_path)
    model.eval()
    with ctx:
        _, loss = model(x.to(device), y.to(device), return_logits=False)
    model.train()
    return loss.item()


def setup_run(cfg: BenchConfig) -> dict:
    """Device, precision, data, model and optimizer for one run: everything the timed loop needs."""
    machine = cfg.machine()  # what "auto" means here
    device, dtype = machine.device, machine.dtype
    setup_process(cfg, device)  # the seed, deterministic algorithms, malloc
    set_tf32(cfg.tf32 and device.startswith("cuda"))
    use_flash_impl(cfg.flash_impl)
    ctx = autocast_context(device, dtype)
    cfg = dataclasses.replace(cfg, attention=machine.attention)
    data_path = None
    if cfg.real_data:
        data_dir = dataio.dataset_dir(cfg.dataset, cfg.data_dir)
        cfg = dataclasses.replace(cfg, vocab_size=dataio.load_meta(data_dir)["vocab_size"])
        data_path = os.path.join(data_dir, "train.bin")
        dataio.open_tokens(data_path, vocab_size=cfg.vocab_size)  # a missing file or a bad id fails here
    model = build_model(cfg, machine).to(device)
    if cfg.fp8:  # load_config refused it where float8 matmuls cannot run
        print(float8.describe(model, cfg.fp8_recipe, cfg.fp8_layers))
        float8.convert_to_fp8(model, cfg.fp8_recipe, cfg.fp8_layers)
    check_attention_kernel(model, ctx, compile=cfg.compile)  # one line, not compile's trace
    optimizer = build_optimizer(model, cfg, device.split(":")[0], verbose=False)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=dtype == "float16")
    defaults = f"dtype={dtype} ({machine.dtype_why}); attention={machine.attention} ({machine.attention_why})"
    return dict(cfg=cfg, device=device, dtype=dtype, ctx=ctx, data_path=data_path, raw_model=model, defaults=defaults,
                model=torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
                if cfg.compile else model, optimizer=optimizer, scaler=scaler)


# ----------------------------------------------------------------------------------------------- the timed steps


def run_bench(cfg: BenchConfig) -> dict:
    """Warm-up steps, then timed steps of train_step as train.py's loop runs them (each step's figures read one step
    late, nothing waiting for the device inside the loop); returns the figures (and the profiler, if any)."""
    run = setup_run(cfg)
    cfg, device, raw_model = run["cfg"], run["device"], run["raw_model"]
    print_run_header(cfg, run)
    late = OneStepLate(device)

    def step(i: int) -> None:
        result = train_step(run["model"], run["optimizer"], run["scaler"], step_batches(cfg, i, run["data_path"]),
                            run["ctx"], cfg, Dist(device=device))
        late.push(i, result)

    memory = PeakMemory(device)
    optimizer_timer = OptimizerTimer(run["optimizer"], device)
    memory.before_first_step()
    initial_loss = held_out_loss(raw_model, cfg, run["ctx"], device, run["data_path"])  # after: its memory counts
    # Progress lines (a compiled warm-up takes a minute on a CPU): the studies read --result_json, not this text.
    if cfg.warmup_steps:
        print(f"warming up: {plural(cfg.warmup_steps, 'step')}{' (the first compiles the model)' if cfg.compile else ''}"
              f"...", flush=True)
    warmup_start = time.perf_counter()
    for i in range(cfg.warmup_steps):
        step(i)
    late.flush()
    synchronize(device)
    warmup_s = time.perf_counter() - warmup_start  # with compile=True: mostly the compile
    memory.before_timed_steps()
    print(f"timing {plural(cfg.timed_steps, 'step')}...", flush=True)
    optimizer_timer.timing = True
    clock = DeviceClock(device)  # the steps' boundaries on the device's timeline: no wait between them
    with OtherLoad() as others:
        marks = [clock.mark()]
        for i in range(cfg.warmup_steps, cfg.warmup_steps + cfg.timed_steps):
            step(i)
            marks.append(clock.mark())
        late.flush()
        synchronize(device)
    ms = [clock.ms(a, b) for a, b in zip(marks, marks[1:])]
    peak = memory.peak_mib()
    optimizer_timer.timing = False
    loss = held_out_loss(raw_model, cfg, run["ctx"], device, run["data_path"])  # after the timed steps, as every run
    prof = None
    if cfg.profile:  # steps of their own: the profiler's cost stays out of the timings
        print(f"profiling {plural(PROFILED_STEPS, 'more step')}...", flush=True)
        with step_profiler(device) as prof:
            first = cfg.warmup_steps + cfg.timed_steps
            for i in range(first, first + PROFILED_STEPS):
                step(i)
            late.flush()
            synchronize(device)
    print("measuring the matmul floor...", flush=True)
    optimizer_ms = {name: total / cfg.timed_steps for name, total in optimizer_timer.ms.items()}

    q1, median, q3 = (float(q) for q in np.percentile(ms, [25, 50, 75]))
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    peak_flops, peak_source = resolve_peak_flops(device, run["dtype"], cfg.peak_flops)
    mfu = raw_model.estimate_mfu(cfg.gradient_accumulation_steps * cfg.batch_size, median / 1000, peak_flops,
                                 cfg.block_size)
    floor_ms, n_matmuls, floor_why = matmul_floor_or_why(raw_model, step_batches(cfg, 0, run["data_path"]), run["ctx"], device)
    result = {
        "matmul_floor_ms": floor_ms, "matmuls": n_matmuls, "floor_multiple": median / floor_ms if floor_ms else None,
        "matmul_floor_missing": floor_why,
        "peak_flops": peak_flops, "peak_source": peak_source,
        "optimizer_ms": optimizer_ms, "optimizer_share": sum(optimizer_ms.values()) / (sum(ms) / len(ms)),
        "ms_median": median, "ms_mean": sum(ms) / len(ms), "ms_min": min(ms), "ms_max": max(ms), "ms_q1": q1, "ms_q3": q3, "ms": ms,
        "tokens_per_iter": tokens_per_iter, "tokens_per_s": tokens_per_iter / (median / 1000), "mfu": mfu,
        "peak_memory_mib": peak, "memory_measure": memory.measure,
        "loss": loss, "initial_loss": initial_loss, "warmup_s": warmup_s, "compiled": cfg.compile,
        "gpu_busy": gpu_busy_share(prof) if cfg.profile else None,
        "device": device, "dtype": dtype_label(run["dtype"]), "allocator": detect_allocator(),
        "threads": torch.get_num_threads(), "others_cpu": others.fraction,
    }
    return {"result": result, "profiler": prof, "cfg": cfg, "device": device}


def dtype_label(dtype: str) -> str:
    return "float32" if dtype == "float32" else f"{dtype} autocast"


# ----------------------------------------------------------------------------------------------- printed figures


def print_run_header(cfg: BenchConfig, run: dict) -> None:
    device, model = run["device"], run["raw_model"]
    mc = model.config
    tf32 = cfg.tf32 if device.startswith("cuda") else "n/a (CUDA only)"
    # unfused AdamW is PyTorch's foreach implementation where it has one (CUDA), else a loop over the tensors
    adamw = "foreach" if device.startswith("cuda") else "for-loop"
    adamw = "fused" if run["optimizer"].optimizers["adamw"].defaults.get("fused") else adamw
    print(f"machine: {machine_line(device)}")
    print(allocator_line(device))
    print(f"model: {plural(mc.n_layer, 'layer')}, {plural(mc.n_head, 'head')}, n_embd {mc.n_embd}, block "
          f"{mc.block_size}, vocab {mc.vocab_size} (padded to {mc.padded_vocab_size}), "
          f"{model.get_num_params() / 1e6:.2f}M params")
    print(f"settings: dtype={dtype_label(run['dtype'])}, attention={mc.attention}"
          f"{'/' + mc.sdpa_backend if mc.attention == 'sdpa' else ''}, compile={cfg.compile}, tf32={tf32}, "
          f"AdamW={adamw}, fused_loss={model.head_loss is not None}")
    print(f"defaults: {run['defaults']}")
    data = f"{run['data_path']} (real data)" if run["data_path"] else f"random tokens (seed {cfg.seed})"
    print(f"run: {plural(cfg.gradient_accumulation_steps, 'micro-step')} x {cfg.batch_size} x {cfg.block_size} "
          f"tokens = {cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size:,} tokens/iter; "
          f"{cfg.warmup_steps} warm-up + {plural(cfg.timed_steps, 'timed step')}; {data}", flush=True)


def print_result(r: dict) -> None:
    print(f"ms/iter: median {r['ms_median']:.2f} (mean {r['ms_mean']:.2f}, min {r['ms_min']:.2f}, IQR "
          f"{r['ms_q1']:.2f}-{r['ms_q3']:.2f}, max {r['ms_max']:.2f}) over {plural(len(r['ms']), 'timed step')}")
    print(f"tokens/s: {r['tokens_per_s']:,.0f} ({r['tokens_per_iter']:,} tokens/iter at the median)")
    if r["matmul_floor_ms"] is None:
        print(f"matmul floor: n/a ({r['matmul_floor_missing']})")
    else:
        print(f"matmul floor: {r['matmul_floor_ms']:.2f} ms ({plural(r['matmuls'], 'matmul')} of the step, alone back "
              f"to back in its dtypes); the step takes {r['floor_multiple']:.2f}x its floor")
    parts = ", ".join(f"{name} {t:.2f} ms" for name, t in r["optimizer_ms"].items())
    print(f"optimizer: {sum(r['optimizer_ms'].values()):.2f} ms per step ({parts}), {r['optimizer_share']:.1%} of "
          f"the mean step")
    if r["mfu"] is not None:
        print(f"MFU: {mfu_text(r['mfu'])} (peak {r['peak_flops'] / 1e12:.3f} TFLOP/s: {r['peak_source']})")
    else:
        print(f"MFU: n/a ({r['peak_source']})")
    if r.get("gpu_busy") is not None:
        print(f"GPU busy: {r['gpu_busy']:.1%} of the {plural(PROFILED_STEPS, 'profiled step')} (it waited for the host "
              f"{1 - r['gpu_busy']:.1%} of the time)")
    if r["warmup_s"]:
        print(f"warm-up: {r['warmup_s']:.1f} s{' (compile included)' if r['compiled'] else ''}")
    peak = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.1f} MiB"
    print(f"peak memory: {peak} ({r['memory_measure']})")
    print(f"loss: {r['loss']:.4f} after the timed steps, {r['initial_loss']:.4f} before the first step "
          f"(on a held-out batch)")
    if r["others_cpu"] is not None:
        print(f"other processes took {r['others_cpu']:.0%} of the CPUs during the timed steps"
              + (": the timings are slower and noisier than on a quiet machine" if r["others_cpu"] >= 0.1 else ""))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--ablation") for a in argv):  # benchmarks/ build on bench.py, never the reverse
        raise UserError("the ablation study is its own script: python benchmarks/ablation.py (same keys)")
    cfg, argv = load_config(argv)
    out = run_bench(cfg)
    print_result(out["result"])
    if cfg.profile:
        write_profile(out["profiler"], cfg.results_dir, out["device"])
    if cfg.result_json:
        write_json(cfg.result_json, {"config": asdict(cfg), **out["result"]}, fix="free disk space, or give another "
                   "--result_json")


if __name__ == "__main__":
    exit_on_user_error(main)
