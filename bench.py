"""
What a training step costs on this machine, and what each speed technique buys.

$ python bench.py                       # GPT-2 124M, batch 12 x 1024 on a GPU; on the CPU, config/bench_cpu.py
$ python bench.py config/bench_cpu.py --dtype=float32 --attention=math
$ python bench.py --profile=True        # also a chrome trace in results_dir and the table of the top ops
$ python bench.py --ablation=True       # every technique in a fresh process, one table (and JSON) to compare
$ python bench.py --numerics=True       # error of each attention path and dtype against float64
$ python bench.py --memory=True         # peak memory by sequence length, math attention vs SDPA

Config: train.py's keys with the same configurator (config files, then --key=value overrides), plus the bench
keys of BenchConfig below. On the CPU, when no config file is given, config/bench_cpu.py is loaded first (the
GPU default, GPT-2 124M at 12 x 1024 tokens, takes minutes per step on a few cores); a line says so.

One run times train.train_step, the real training step (forward, backward, clipping, AdamW, with gradient
accumulation), after warm-up steps that absorb one-off costs (allocations, kernel choice, torch.compile). Data
loading is not timed. Every run draws the same batches (fixed seed; random tokens with text-like Zipf
frequencies, or real_data=True) and starts from the same weights whatever the vocabulary padding, so the rows
of an ablation train the same model on the same data and their losses compare. On a shared CPU other processes
slow the steps down: each run says what share of the CPUs they took while it measured.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import dataio
from common import (
    Dist,
    UserError,
    autocast_context,
    exit_on_user_error,
    keep_freed_memory,
    resolve_device,
    dtype_reason,
    resolve_attention,
    resolve_dtype,
    run_info,
    run_peak_flops,
    set_deterministic,
    set_tf32,
    synchronize,
)
from configurator import configure
from model import GPT, GPTConfig, GPTError
from train import MODEL_KEYS, SCRATCH_GELU, TrainConfig, batch_generator, check_config, data_paths, get_batch, train_step

ROOT = os.path.dirname(os.path.abspath(__file__))
CPU_CONFIG = os.path.join(ROOT, "config", "bench_cpu.py")


@dataclass
class BenchConfig(TrainConfig):
    # a benchmark step is one optimizer step of batch_size x block_size tokens, as nanoGPT's bench.py
    gradient_accumulation_steps: int = 1
    # one run
    vocab_size: int = 50257  # random tokens come from this vocabulary (real_data: the dataset's meta.json)
    real_data: bool = False  # batches of data/<dataset>/train.bin (train.get_batch) instead of random tokens
    warmup_steps: int = 10  # untimed steps first
    timed_steps: int = 20
    profile: bool = False  # torch.profiler over the timed steps: a chrome trace in results_dir, the top ops
    results_dir: str = "bench_results"  # trace.json, ablation.json/.png, numerics.json, memory.json
    result_json: str = ""  # also write this run's figures to this file (each ablation row's process does)
    # studies
    ablation: bool = False
    studies: str = "attention,cumulative"  # the ablation's studies, comma-separated
    skip_rows: str = ""  # ablation rows to leave out, e.g. "compile" or "cumulative.compile" (see STUDIES)
    numerics: bool = False
    memory: bool = False
    memory_seq_lens: tuple[int, ...] = (256, 512, 1024, 2048)  # each is the block_size of one measurement
    memory_batch_size: int = 1
    find_max_batch: bool = False  # CUDA: the largest batch_size whose training step fits (binary search)
    memory_budget_gb: float | None = None  # find_max_batch's budget; None: the whole GPU


# ----------------------------------------------------------------------------------------------- config


def load_config(argv: list[str]) -> tuple[BenchConfig, list[str]]:
    """The config, and the argv that rebuilds it (with config/bench_cpu.py when it was loaded automatically)."""
    cfg = configure(BenchConfig(), argv)
    given_file = any(not a.startswith("--") for a in argv)
    if not given_file and resolve_device(cfg.device) == "cpu":
        print(f"device is cpu and no config file was given: loading {os.path.relpath(CPU_CONFIG)} (a CPU-sized "
              f"model; give a config file to choose another)")
        argv = [os.path.relpath(CPU_CONFIG), *argv]  # the overrides still win
        cfg = configure(BenchConfig(), argv)
    check_bench_config(cfg)
    return cfg, argv


def check_bench_config(cfg: BenchConfig) -> None:
    problems = []
    try:
        check_config(cfg, world_size=1)
    except UserError as e:
        problems.append(str(e))
    for key in ("timed_steps", "memory_batch_size", "vocab_size"):
        if getattr(cfg, key) < 1:
            problems.append(f"{key}={getattr(cfg, key)} must be at least 1")
    if cfg.warmup_steps < 0:
        problems.append(f"warmup_steps={cfg.warmup_steps} must be >= 0")
    if not cfg.memory_seq_lens or min(cfg.memory_seq_lens) < 1:
        problems.append(f"memory_seq_lens={cfg.memory_seq_lens} must be positive lengths, e.g. 256,512,1024")
    if cfg.memory_budget_gb is not None and cfg.memory_budget_gb <= 0:
        problems.append(f"memory_budget_gb={cfg.memory_budget_gb} must be positive (or None: the whole GPU)")
    try:
        selected_rows(cfg)
    except UserError as e:
        problems.append(str(e))
    if "RANK" in os.environ:
        problems.append("bench.py measures one process: run it with python, not torchrun")
    if problems:
        raise UserError("; ".join(problems))


def model_config(cfg: BenchConfig, **changes) -> GPTConfig:
    args = {k: getattr(cfg, k) for k in MODEL_KEYS}
    args.update(dropout=cfg.dropout, attention=cfg.attention, sdpa_backend=cfg.sdpa_backend,
                gelu=cfg.gelu or SCRATCH_GELU, fused_loss=cfg.fused_loss)
    args.update(changes)
    return GPTConfig(**args)


def override_args(overrides: dict) -> list[str]:
    """--key=value arguments that set `overrides` (strings quoted, so '--dtype=float32' stays a string)."""
    return [f"--{k}={v!r}" if isinstance(v, str) else f"--{k}={v}" for k, v in overrides.items()]


# ----------------------------------------------------------------------------------------------- the machine


def detect_allocator(maps: str | None = None, ld_preload: str | None = None) -> str:
    """
    The malloc this process uses: jemalloc, tcmalloc or mimalloc when one is mapped into it (LD_PRELOAD, or
    linked), else the C library's. On the CPU this matters: an allocator change alone can be worth ~20%.
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:  # not Linux: trust LD_PRELOAD
            maps = ""
    if ld_preload is None:
        ld_preload = os.environ.get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        libs = sorted({p for p in (maps + " " + ld_preload.replace(":", " ")).split() if f"lib{name}" in p})
        if libs:
            return f"{name} ({libs[0]})"
    return "glibc malloc" if platform.system() == "Linux" else "the system malloc"


def machine_info(device: str) -> dict[str, str]:
    """Versions, hardware, and how busy the machine is: other processes make CPU timings noisy."""
    info = run_info(device)
    if hasattr(os, "getloadavg"):
        info["load_1min"] = f"{os.getloadavg()[0]:.2f}/{os.cpu_count()}cpus"
    return info


def machine_line(device: str) -> str:
    return " ".join(f"{k}={v}" for k, v in machine_info(device).items())


def allocator_line(device: str) -> str:
    allocator = detect_allocator()
    if device == "cpu" and not allocator.startswith(("jemalloc", "tcmalloc", "mimalloc")):
        allocator += " (keep_freed_memory=True stops it returning freed buffers to the OS, worth ~1.2x here)"
    return f"allocator: {allocator}"


class OtherLoad:
    """
    The share of the machine's CPU time that other processes took while we measured (Linux, /proc/stat): the
    machine's busy time minus this process's. A busy machine makes CPU timings slower and noisier, so the figure
    goes next to them. None where /proc/stat is missing.
    """

    def __init__(self):
        self.fraction: float | None = None

    def _sample(self) -> tuple[float | None, float, float]:
        return _machine_busy_s(), time.process_time(), time.perf_counter()

    def __enter__(self) -> "OtherLoad":
        self._start = self._sample()
        return self

    def __exit__(self, *exc) -> None:
        (busy0, own0, t0), (busy1, own1, t1) = self._start, self._sample()
        if busy0 is not None and busy1 is not None and t1 > t0:
            others = (busy1 - busy0) - (own1 - own0)
            self.fraction = min(1.0, max(0.0, others / ((t1 - t0) * (os.cpu_count() or 1))))


def _machine_busy_s() -> float | None:
    """CPU seconds all cores spent busy since boot (everything in /proc/stat's cpu line but idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def load_note(fraction: float | None) -> str:
    """A warning when other processes took a noticeable share of the CPUs during a measurement."""
    if fraction is None or fraction < 0.1:
        return ""
    return f"busy machine: other processes took {fraction:.0%} of the CPUs"


def _max_rss_kb() -> int:
    """The process's peak RSS from getrusage (KiB; macOS reports bytes), where there is no /proc."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def _proc_status_kb(field: str) -> int | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in KiB; None where there is no /proc (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """
    Peak memory of the timed steps.
    CUDA: torch.cuda.max_memory_allocated (tensors; the caching allocator reserves a little more).
    CPU: how far the process's resident set grows: its peak during the timed steps (VmHWM, reset before them
    through /proc/self/clear_refs) minus its size before the first step. So it counts what training adds to the
    built model (activations, gradients, optimizer state, what the allocator keeps), and only peak RSS can be
    read on the CPU, which never goes down within a process: compare runs in fresh processes.
    """

    def __init__(self, device: str):
        self.device = device
        self.base_kb = 0
        self.reset_ok = False
        self.measure = "n/a"

    def before_first_step(self) -> None:
        if self.device == "cpu":
            rss = _proc_status_kb("VmRSS")
            self.base_kb = rss if rss is not None else _max_rss_kb()  # no /proc: the peak so far stands in

    def before_timed_steps(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # 5: reset the peak RSS (VmHWM) to the current RSS (Linux 4.0+)
                self.reset_ok = True
            except OSError:
                self.reset_ok = False

    def peak_mib(self) -> float | None:
        if self.device.startswith("cuda"):
            self.measure = "CUDA: torch.cuda.max_memory_allocated during the timed steps"
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.device != "cpu":
            self.measure = f"n/a: no peak-memory counter on {self.device}"
            return None
        hwm = _proc_status_kb("VmHWM")
        if hwm is None:
            hwm = _max_rss_kb()
            self.measure = "CPU: growth of peak RSS (getrusage ru_maxrss) from before the first step"
        elif self.reset_ok:
            self.measure = "CPU: peak RSS (VmHWM) during the timed steps minus RSS before the first step"
        else:
            self.measure = "CPU: peak RSS (VmHWM) of the process minus RSS before the first step"
        return max(0, hwm - self.base_kb) / 1024


# ----------------------------------------------------------------------------------------------- one run


def build_model(cfg: BenchConfig, **changes) -> GPT:
    """
    The model of `cfg`, initialised from cfg.seed. A padded vocabulary would draw more random numbers and so
    give different weights; instead the unpadded model is initialised and copied in, with zero padding rows
    (never looked up, and masked out of the loss), so runs with and without padding train the same model.
    """
    config = model_config(cfg, **changes)
    torch.manual_seed(cfg.seed)
    model = GPT(dataclasses.replace(config, vocab_padding_multiple=1))
    if config.padded_vocab_size == config.vocab_size:
        model.config = config
        return model
    padded = GPT(config)
    with torch.no_grad():
        target = padded.state_dict()
        for name, w in model.state_dict().items():
            if target[name].shape != w.shape:  # the token embedding, tied to the head: (padded_vocab, C)
                target[name].zero_()
            target[name][: w.size(0)].copy_(w)
    return padded


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
        _, loss = model(x.to(device), y.to(device))
    model.train()
    return loss.item()


def spread(ms: list[float]) -> dict[str, float]:
    q1, median, q3 = np.percentile(ms, [25, 50, 75])
    return {"ms_median": float(median), "ms_min": min(ms), "ms_max": max(ms), "ms_q1": float(q1), "ms_q3": float(q3)}


def profiler_for(device: str, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def setup_run(cfg: BenchConfig) -> dict:
    """Device, precision, data and model for one run; everything the timed loop needs."""
    device = resolve_device(cfg.device)
    device_type = device.split(":")[0]
    dtype = resolve_dtype(cfg.dtype, device)
    if device_type == "cuda":
        set_tf32(cfg.tf32)
    if device_type == "cpu":
        keep_freed_memory(cfg.keep_freed_memory)
    set_deterministic(cfg.deterministic)
    data_path = None
    if cfg.real_data:
        data_dir = data_paths(cfg)
        cfg = dataclasses.replace(cfg, vocab_size=dataio.load_meta(data_dir)["vocab_size"])
        data_path = os.path.join(data_dir, "train.bin")
        dataio.open_tokens(data_path, vocab_size=cfg.vocab_size)  # a missing file or a bad id fails here
    model = build_model(cfg).to(device)
    model.check_attention_kernel(autocast_context(device, dtype), compile=cfg.compile)  # one line, not compile's trace
    optimizer = model.configure_optimizers(
        cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), device_type, fused=cfg.fused_adamw, verbose=False
    )
    return dict(
        cfg=cfg, device=device, dtype=dtype, data_path=data_path, raw_model=model, optimizer=optimizer,
        model=torch.compile(model) if cfg.compile else model,
        scaler=torch.amp.GradScaler(device_type, enabled=(dtype == "float16")),
        ctx=autocast_context(device, dtype),
    )


def run_bench(cfg: BenchConfig) -> dict:
    """Warm-up steps, then timed steps of train_step; returns the figures (and the profiler, if any)."""
    run = setup_run(cfg)
    cfg, device, raw_model = run["cfg"], run["device"], run["raw_model"]
    dist = Dist(device=device)
    print_run_header(cfg, run)

    def step(i: int) -> float:
        return train_step(run["model"], run["optimizer"], run["scaler"], step_batches(cfg, i, run["data_path"]),
                          run["ctx"], cfg, dist)[0]

    memory = PeakMemory(device)
    memory.before_first_step()
    initial_loss = held_out_loss(raw_model, cfg, run["ctx"], device, run["data_path"])  # after: its memory counts
    for i in range(cfg.warmup_steps):
        step(i)
    memory.before_timed_steps()
    ms = []
    with OtherLoad() as others, profiler_for(device, cfg.profile) as prof:
        for i in range(cfg.warmup_steps, cfg.warmup_steps + cfg.timed_steps):
            synchronize(device)
            t0 = time.perf_counter()
            step(i)
            synchronize(device)
            ms.append((time.perf_counter() - t0) * 1000)
    peak = memory.peak_mib()

    figures = spread(ms)
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    dt = figures["ms_median"] / 1000
    peak_flops, peak_source = run_peak_flops(device, run["dtype"], cfg.peak_flops)
    mfu = raw_model.estimate_mfu(cfg.gradient_accumulation_steps * cfg.batch_size, dt, peak_flops, cfg.block_size)
    floor_ms, n_matmuls = matmul_floor(raw_model, step_batches(cfg, 0, run["data_path"]), run["ctx"], device)
    result = {
        "matmul_floor_ms": floor_ms,
        "matmuls": n_matmuls,
        "floor_multiple": figures["ms_median"] / floor_ms,
        "peak_flops": peak_flops,
        "peak_source": peak_source,
        **figures,
        "ms": ms,
        "tokens_per_iter": tokens_per_iter,
        "tokens_per_s": tokens_per_iter / dt,
        "mfu": mfu,
        "peak_memory_mib": peak,
        "memory_measure": memory.measure,
        "loss": held_out_loss(raw_model, cfg, run["ctx"], device, run["data_path"]),
        "initial_loss": initial_loss,
        "device": device,
        "dtype": dtype_label(run["dtype"]),
        "allocator": detect_allocator(),
        "threads": torch.get_num_threads(),
        "others_cpu": others.fraction,
    }
    return {"result": result, "profiler": prof, "cfg": cfg}


class MatmulRecorder(TorchDispatchMode):
    """Records every matmul a forward and backward runs, below autocast (so in the dtype it really ran in)."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default)

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []  # (op, [(shape, stride-free dtype) of each tensor argument], kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.calls.append((func, [(tuple(a.shape), a.dtype) for a in args], dict(kwargs or {})))
        return func(*args, **(kwargs or {}))


def matmul_floor(model: GPT, batches, ctx, device: str, repeats: int = 3) -> tuple[float, int]:
    """
    The step's matmul floor: every matmul of its forwards and backwards (recorded on the uncompiled model, no
    optimizer step), run alone back to back on fresh tensors of the same shapes and dtypes; the best of `repeats`,
    in ms, and the number of matmuls. A step can only approach it: everything else (softmax, norms, GELU, casts,
    AdamW) is overhead on top. Kernels that do their matmuls inside (SDPA flash) are not in it.
    """
    recorder = MatmulRecorder()
    with recorder:
        for x, y in batches:
            with ctx:
                _, loss = model(x.to(device), y.to(device))
            loss.backward()
    model.zero_grad(set_to_none=True)
    calls = [(op, [torch.randn(shape, device=device).to(dtype) for shape, dtype in args], kw)
             for op, args, kw in recorder.calls]
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        synchronize(device)
        t0 = time.perf_counter()
        for op, args, kw in calls:
            op(*args, **kw)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1000, len(calls)


def dtype_label(dtype: str) -> str:
    return "float32" if dtype == "float32" else f"{dtype} autocast"


def print_run_header(cfg: BenchConfig, run: dict) -> None:
    device, model = run["device"], run["raw_model"]
    mc = model.config
    tf32 = cfg.tf32 if device.startswith("cuda") else "n/a (CUDA only)"
    # unfused AdamW is PyTorch's foreach implementation where it has one (CUDA), else a loop over the tensors
    adamw = "foreach" if device.startswith("cuda") else "for-loop"
    adamw = "fused" if run["optimizer"].defaults.get("fused") else adamw
    print(f"machine: {machine_line(device)}")
    print(allocator_line(device))
    print(f"model: {mc.n_layer} layers, {mc.n_head} heads, n_embd {mc.n_embd}, block {mc.block_size}, vocab "
          f"{mc.vocab_size} (padded to {mc.padded_vocab_size}), {model.get_num_params() / 1e6:.2f}M params")
    print(f"settings: dtype={dtype_label(run['dtype'])}, attention={mc.attention}"
          f"{'/' + mc.sdpa_backend if mc.attention == 'sdpa' else ''}, compile={cfg.compile}, tf32={tf32}, "
          f"AdamW={adamw}, fused_loss={mc.fused_loss}")
    data = f"{run['data_path']} (real data)" if run["data_path"] else f"random tokens (seed {cfg.seed})"
    print(f"run: {cfg.gradient_accumulation_steps} micro-steps x {cfg.batch_size} x {cfg.block_size} tokens = "
          f"{cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size:,} tokens/iter; "
          f"{cfg.warmup_steps} warm-up + {cfg.timed_steps} timed steps; {data}", flush=True)


def print_result(r: dict, profiling: bool) -> None:
    note = " (under the profiler: includes its overhead)" if profiling else ""
    print(f"ms/iter: median {r['ms_median']:.2f} (min {r['ms_min']:.2f}, IQR {r['ms_q1']:.2f}-{r['ms_q3']:.2f}, "
          f"max {r['ms_max']:.2f}) over {len(r['ms'])} timed steps{note}")
    print(f"tokens/s: {r['tokens_per_s']:,.0f} ({r['tokens_per_iter']:,} tokens/iter at the median)")
    print(f"matmul floor: {r['matmul_floor_ms']:.2f} ms ({r['matmuls']} matmuls of the step, alone back to back "
          f"in its dtypes); the step takes {r['floor_multiple']:.2f}x its floor")
    if r["mfu"] is not None:
        print(f"MFU: {r['mfu'] * 100:.2f}% (peak {r['peak_flops'] / 1e12:.3f} TFLOP/s: {r['peak_source']})")
    elif r["device"] == "cpu":
        print("MFU: n/a (give --peak_flops)")
    else:
        print("MFU: n/a (unknown device peak: give --peak_flops)")
    peak = "n/a" if r["peak_memory_mib"] is None else f"{r['peak_memory_mib']:.1f} MiB"
    print(f"peak memory: {peak} ({r['memory_measure']})")
    print(f"loss: {r['loss']:.4f} after the timed steps, {r['initial_loss']:.4f} before the first step "
          f"(on a held-out batch)")
    if r["others_cpu"] is not None:
        print(f"other processes took {r['others_cpu']:.0%} of the CPUs during the timed steps"
              + (": the timings are slower and noisier than on a quiet machine" if r["others_cpu"] >= 0.1 else ""))


def write_profile(prof, cfg: BenchConfig, device: str) -> None:
    os.makedirs(cfg.results_dir, exist_ok=True)
    path = os.path.join(cfg.results_dir, "trace.json")
    prof.export_chrome_trace(path)
    sort_by = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=15))
    print(f"profile: chrome trace of the timed steps in {path} (open it in chrome://tracing or ui.perfetto.dev)")


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------- CUDA: largest batch


def largest_batch(cfg: BenchConfig) -> dict:
    """
    CUDA only: the largest batch_size whose training step (forward, backward, AdamW) fits in memory_budget_gb
    (default: the whole GPU): batch sizes double until one runs out of memory, then a binary search.
    """
    device = resolve_device(cfg.device)
    if not device.startswith("cuda"):
        raise UserError(f"find_max_batch needs CUDA (the device is {device}): on the CPU, memory is not the limit")
    run = setup_run(cfg)
    cfg = run["cfg"]
    total = torch.cuda.get_device_properties(device).total_memory
    if cfg.memory_budget_gb is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_budget_gb * 2**30 / total), device)

    def fits(batch_size: int) -> bool:
        trial = dataclasses.replace(cfg, batch_size=batch_size, gradient_accumulation_steps=1)
        try:
            train_step(run["model"], run["optimizer"], run["scaler"], step_batches(trial, 0, run["data_path"]),
                       run["ctx"], trial, Dist(device=device))
            return True
        except torch.cuda.OutOfMemoryError:
            return False
        finally:
            run["optimizer"].zero_grad(set_to_none=True)
            torch.cuda.empty_cache()

    lo, hi = 0, 1  # lo: the largest size that fitted (0: none), hi: the next size to try
    while hi <= 65536 and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    budget = f"{cfg.memory_budget_gb} GiB" if cfg.memory_budget_gb is not None else f"{total / 2**30:.1f} GiB (all)"
    print(f"largest batch that fits: {lo} (block {cfg.block_size}, budget {budget})")
    return {"max_batch": lo, "budget": budget}


# ----------------------------------------------------------------------------------------------- ablation


@dataclass(frozen=True)
class Row:
    study: str
    name: str  # the id for skip_rows and the JSON
    label: str  # what the table shows
    overrides: dict  # config keys set on top of the user's config (cumulative: this row's change)
    cuda_only: str | None = None  # why the row means nothing on another device


def _sdpa(backend: str, vocab_padding_multiple: int = 1) -> dict:
    return {"attention": "sdpa", "sdpa_backend": backend, "vocab_padding_multiple": vocab_padding_multiple}


STUDIES: dict[str, list[Row]] = {
    # each row against the user's config, from nanoGPT's attention (explicit math, no vocabulary padding)
    "attention": [
        Row("attention", "math", "math attention (nanoGPT)", {"attention": "math", "vocab_padding_multiple": 1}),
        Row("attention", "sdpa-math", "SDPA math kernel", _sdpa("math")),
        Row("attention", "efficient", "SDPA memory-efficient kernel", _sdpa("efficient")),
        Row("attention", "flash", "SDPA flash kernel", _sdpa("flash")),
        Row("attention", "flash+pad", "flash + padded vocab (64)", _sdpa("flash", vocab_padding_multiple=64)),
    ],
    # each row adds its change to the rows above it, so the last one has every technique
    "cumulative": [
        Row("cumulative", "float32", "float32 (math, no TF32/compile/padding, unfused AdamW)",
            {"dtype": "float32", "tf32": False, "compile": False, "attention": "math", "vocab_padding_multiple": 1,
             "fused_adamw": False, "keep_freed_memory": False, "fused_loss": False}),
        Row("cumulative", "tf32", "+ TF32 matmuls", {"tf32": True}, cuda_only="TF32 is CUDA-only"),
        Row("cumulative", "bf16", "+ bf16 autocast", {"dtype": "bfloat16"}),
        Row("cumulative", "compile", "+ torch.compile", {"compile": True}),
        Row("cumulative", "flash", "+ SDPA flash", {"attention": "sdpa", "sdpa_backend": "flash"}),
        Row("cumulative", "padded", "+ padded vocab (64)", {"vocab_padding_multiple": 64}),
        Row("cumulative", "fused", "+ fused AdamW", {"fused_adamw": True}),
        Row("cumulative", "malloc", "+ glibc malloc keeps freed memory", {"keep_freed_memory": True}),
        Row("cumulative", "fused_loss", "+ fused chunked linear + cross-entropy", {"fused_loss": True}),
    ],
}
CUMULATIVE = {"cumulative"}


def selected_rows(cfg: BenchConfig) -> list[Row]:
    """The rows of cfg.studies without cfg.skip_rows, with their full overrides. A skipped cumulative row's change
    is left out of the rows below it too (skip_rows=compile: the cumulative study without compile)."""
    studies = [s.strip() for s in cfg.studies.split(",") if s.strip()]
    skips = {s.strip() for s in cfg.skip_rows.split(",") if s.strip()}
    known = {n for rows in STUDIES.values() for r in rows for n in (r.name, f"{r.study}.{r.name}")}
    problems = [f"unknown study {s!r} (studies: {', '.join(STUDIES)})" for s in studies if s not in STUDIES]
    problems += [f"unknown row {s!r} in skip_rows (rows: {', '.join(sorted(known))})" for s in sorted(skips - known)]
    if not studies:
        problems.append("studies is empty: give one or more of " + ", ".join(STUDIES))
    if problems:
        raise UserError("; ".join(problems))
    selected = []
    for study in studies:
        accumulated: dict = {}
        for row in STUDIES[study]:
            if row.name in skips or f"{study}.{row.name}" in skips:
                continue
            if study in CUMULATIVE:
                accumulated = {**accumulated, **row.overrides}
                row = dataclasses.replace(row, overrides=accumulated)
            selected.append(row)
    return selected


CHILD_ARGS = ["--ablation=False", "--numerics=False", "--memory=False", "--profile=False", "--find_max_batch=False"]


def run_child(argv: list[str], overrides: dict, result_path: str) -> dict:
    """
    One bench run in a fresh process, with the same interpreter and environment (so the same allocator and
    threads): the user's argv, then `overrides`. Its figures, or status "n/a" with the reason when the run
    stops with a user error (a kernel the device lacks: the model's GPTError), or "failed" for a crash.
    """
    # CHILD_ARGS first: a row may set one of them (the memory study's find_max_batch)
    cmd = [sys.executable, os.path.join(ROOT, "bench.py"), *argv, *CHILD_ARGS, *override_args(overrides),
           f"--result_json={result_path}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall_s = round(time.perf_counter() - t0, 1)  # the whole process: start-up, model, compile, steps
    command = " ".join(["python bench.py", *argv, *override_args(overrides)])
    if proc.returncode == 0:
        with open(result_path) as f:
            result = json.load(f)
        result.pop("config", None)  # the command rebuilds it
        return {"status": "ok", "command": command, "wall_s": wall_s, **result}
    lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
    errors = [line for line in lines if line.startswith("error: ")]
    if proc.returncode == 2 and errors:
        return {"status": "n/a", "reason": errors[-1][len("error: "):], "command": command}
    print(f"  {command} failed:\n    " + "\n    ".join(lines[-8:]), file=sys.stderr)
    return {"status": "failed", "reason": f"failed (exit {proc.returncode}): {lines[-1]}", "command": command}


def run_ablation(cfg: BenchConfig, argv: list[str], device: str) -> list[dict]:
    rows = selected_rows(cfg)
    print(f"machine: {machine_line(device)}")
    print(allocator_line(device))
    print(f"ablation: {len(rows)} rows, each in a fresh process (same environment, so the same allocator)", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(rows):
            entry = {"study": row.study, "name": row.name, "label": row.label, "overrides": row.overrides}
            if row.cuda_only and not device.startswith("cuda"):
                entry.update(status="n/a", reason=row.cuda_only)
            else:
                entry.update(run_child(argv, row.overrides, os.path.join(tmp, f"row{i}.json")))
            results.append(entry)
            done = entry.get("reason", "")
            if entry["status"] == "ok":
                done = f"{entry['ms_median']:.1f} ms/iter ({entry['wall_s']:.0f} s in all)"
                done += f"; {load_note(entry['others_cpu'])}" if load_note(entry["others_cpu"]) else ""
            print(f"  [{row.study} {i + 1}/{len(rows)}] {row.label}: {done}", flush=True)
    add_speedups(results)
    return results


def add_speedups(results: list[dict]) -> None:
    """Speed-up against the first row of each study (None when either did not run)."""
    first: dict[str, dict] = {}
    for r in results:
        base = first.setdefault(r["study"], r)
        ok = r["status"] == "ok" and base["status"] == "ok"
        r["speedup"] = base["ms_median"] / r["ms_median"] if ok else None


def markdown_table(header: list[str], rows: list[list[str]], align: str) -> str:
    """A Markdown table (pastes into the README as it is); align: one 'l' or 'r' per column."""
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if a == "r" else ":" + "-" * (w + 1) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def ablation_table(results: list[dict]) -> str:
    header = ["study", "row", "dtype", "ms/iter", "min-max", "tokens/s", "speed-up", "peak MiB", "loss", "note"]
    rows = []
    for r in results:
        if r["status"] != "ok":
            rows.append([r["study"], r["label"], *["-"] * 7, r["reason"]])
            continue
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        peak = f"{r['peak_memory_mib']:.0f}" if r["peak_memory_mib"] is not None else "-"
        rows.append([r["study"], r["label"], r["dtype"], f"{r['ms_median']:.1f}",
                     f"{r['ms_min']:.0f}-{r['ms_max']:.0f}", f"{r['tokens_per_s']:,.0f}", speedup, peak,
                     f"{r['loss']:.4f}", load_note(r["others_cpu"])])
    return markdown_table(header, rows, "lllrrrrrrl")


def plot_ablation(results: list[dict], path: str) -> str | None:
    """A bar chart of tokens/s per row, when matplotlib is installed (else nothing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    studies = list(dict.fromkeys(r["study"] for r in results))
    fig, axes = plt.subplots(len(studies), 1, figsize=(8, 1 + 0.45 * len(results)), squeeze=False)
    for ax, study in zip(axes[:, 0], studies):
        rows = [r for r in results if r["study"] == study]
        values = [r["tokens_per_s"] if r["status"] == "ok" else 0 for r in rows]
        ax.barh([r["label"] for r in rows], values)
        for y, r in enumerate(rows):
            if r["status"] != "ok":
                ax.text(0, y, "  " + r["reason"][:60], va="center", fontsize=7)
        ax.invert_yaxis()
        ax.set_title(study)
        ax.set_xlabel("tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report_ablation(cfg: BenchConfig, argv: list[str], device: str, results: list[dict]) -> None:
    print(ablation_table(results))
    print("loss: on a held-out batch after the timed steps; every row trains the same weights on the same random "
          "tokens, so float32 rows agree to rounding and bf16 rows to about the 3rd decimal")
    measures = {r["memory_measure"] for r in results if r["status"] == "ok"}
    if measures:
        print(f"peak memory: {'; '.join(sorted(measures))}")
    path = os.path.join(cfg.results_dir, "ablation.json")
    write_json(path, {"machine": {**machine_info(device), "allocator": detect_allocator()}, "argv": argv,
                      "rows": results})
    png = plot_ablation(results, os.path.join(cfg.results_dir, "ablation.png"))
    print(f"ablation: written to {path}" + (f" and {png}" if png else ""))


# ----------------------------------------------------------------------------------------------- numerics

NUMERICS_PATHS = {
    "math": dict(attention="math"),
    "sdpa/auto": dict(attention="sdpa", sdpa_backend="auto"),
    "sdpa/math": dict(attention="sdpa", sdpa_backend="math"),
    "sdpa/flash": dict(attention="sdpa", sdpa_backend="flash"),
}
NUMERICS_DTYPES = ("float32", "bfloat16")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def token_losses(model: GPT, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss of every position (B*T,); its mean is the model's loss. Compared position by position, errors
    cannot cancel out in the mean by chance."""
    logits, _ = model(idx)  # (B, T, vocab_size)
    # in the model's precision: under autocast cross_entropy runs in float32, as the model's own loss does
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


@torch.no_grad()
def numerics_study(cfg: BenchConfig, device: str) -> list[dict]:
    """
    For each attention path and dtype, the relative error of one attention module's output and of the model's
    loss (per position, and the mean) against a float64 copy of the same weights (math attention), same inputs.
    """
    base = build_model(cfg, dropout=0.0).to(device).eval()
    reference = copy.deepcopy(base).double()
    gen = torch.Generator().manual_seed(cfg.seed)
    # the input of the first attention module: LayerNorm'd activations, i.e. about unit variance
    x = torch.randn(cfg.batch_size, cfg.block_size, cfg.n_embd, generator=gen).to(device)  # (B, T, C)
    idx, targets = (t.to(device) for t in draw_batch(cfg, batch_generator(cfg.seed, "eval_val", 0, 0), None))
    attn_ref = reference.transformer.h[0].attn(x.double())  # (B, T, C)
    losses_ref = token_losses(reference, idx, targets)  # (B*T,)
    del reference
    rows = []
    for path, changes in NUMERICS_PATHS.items():
        model = GPT(dataclasses.replace(base.config, **changes)).to(device).eval()
        model.load_state_dict(base.state_dict())
        for dtype in NUMERICS_DTYPES:
            row = {"path": path, "dtype": dtype_label(dtype)}
            try:
                with autocast_context(device, dtype):
                    attn = model.transformer.h[0].attn(x)
                    losses = token_losses(model, idx, targets)
                row["attention_error"] = relative_error(attn, attn_ref)
                row["token_loss_error"] = relative_error(losses, losses_ref)
                row["loss_error"] = relative_error(losses.mean(), losses_ref.mean())
            except GPTError as e:  # e.g. flash with float32 on a GPU
                row["reason"] = str(e)
            rows.append(row)
    return rows


def report_numerics(cfg: BenchConfig, rows: list[dict]) -> None:
    print(f"numerics: relative error against float64 (same weights, math attention): the output of layer 0's "
          f"attention on random (B={cfg.batch_size}, T={cfg.block_size}, C={cfg.n_embd}) inputs, and the model's "
          f"loss on random tokens, position by position and its mean")
    keys = ("attention_error", "token_loss_error", "loss_error")
    table = [[r["path"], r["dtype"], *((f"{r[k]:.2e}" for k in keys) if "reason" not in r else ("-",) * 3),
              r.get("reason", "")] for r in rows]
    header = ["path", "dtype", "attention output", "loss per position", "mean loss", "note"]
    print(markdown_table(header, table, "llrrrl"))
    path = os.path.join(cfg.results_dir, "numerics.json")
    write_json(path, {"rows": rows})
    print(f"numerics: written to {path}")


# ----------------------------------------------------------------------------------------------- memory study

MEMORY_PATHS = {"math": dict(attention="math"), "sdpa/auto": dict(attention="sdpa", sdpa_backend="auto")}


def memory_study(cfg: BenchConfig, argv: list[str], device: str) -> dict:
    """
    Peak memory of one training step (forward, backward, AdamW; eager) at each sequence length, per attention
    path, each point in a fresh process (on the CPU only peak RSS can be read, and it never goes down); on CUDA,
    also the largest batch that fits at block_size.
    """
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for path, changes in MEMORY_PATHS.items():
            for T in cfg.memory_seq_lens:
                overrides = {**changes, "block_size": T, "batch_size": cfg.memory_batch_size,
                             "gradient_accumulation_steps": 1, "warmup_steps": 0, "timed_steps": 1, "compile": False}
                r = run_child(argv, overrides, os.path.join(tmp, f"mem{len(points)}.json"))
                points.append({"path": path, "seq_len": T, **r})
                done = f"{r['peak_memory_mib']:.1f} MiB" if r["status"] == "ok" else r["reason"]
                print(f"  [memory] {path} T={T}: {done}", flush=True)
        largest = []
        for path, changes in MEMORY_PATHS.items():
            if device.startswith("cuda"):
                r = run_child(argv, {**changes, "find_max_batch": True}, os.path.join(tmp, f"max{path[:4]}.json"))
            else:
                r = {"status": "n/a", "reason": "CUDA only"}
            largest.append({"path": path, **r})
    return {"points": points, "largest_batch": largest}


def report_memory(cfg: BenchConfig, study: dict) -> None:
    lens = list(cfg.memory_seq_lens)
    peak = {(p["path"], p["seq_len"]): p.get("peak_memory_mib") for p in study["points"]}  # None: not measured
    rows = [[path, *(f"{peak[path, T]:.0f}" if peak[path, T] is not None else "n/a" for T in lens)]
            for path in MEMORY_PATHS]
    # what the (B, nh, T, T) attention matrices of the math path cost: grows with T^2 where the rest grows with T
    rows.append(["math - sdpa", *(f"{peak['math', T] - peak['sdpa/auto', T]:.0f}"
                                  if None not in (peak["math", T], peak["sdpa/auto", T]) else "n/a" for T in lens)])
    print(f"memory: peak MiB of one training step (forward, backward, AdamW; eager), batch {cfg.memory_batch_size}, "
          f"by sequence length, each in a fresh process")
    print(markdown_table(["path", *(f"T={T}" for T in lens)], rows, "l" + "r" * len(lens)))
    measures = {p["memory_measure"] for p in study["points"] if p["status"] == "ok"}
    print(f"peak memory: {'; '.join(sorted(measures)) or 'n/a'}")
    for reason in dict.fromkeys(p["reason"] for p in study["points"] if p["status"] != "ok"):
        print(f"  not measured: {reason}")
    longest_math, longest_sdpa = peak["math", lens[-1]], peak["sdpa/auto", lens[-1]]
    if longest_math is not None and longest_sdpa:
        study["ratio"] = longest_math / longest_sdpa
        print(f"math/SDPA peak memory at T={lens[-1]}: {study['ratio']:.2f}x")

    print(f"largest batch at block_size={cfg.block_size}:")
    rows = [[r["path"], str(r["max_batch"]), r["budget"]] if r["status"] == "ok" else [r["path"], "-", r["reason"]]
            for r in study["largest_batch"]]
    print(markdown_table(["path", "largest batch", "note"], rows, "lrl"))
    path = os.path.join(cfg.results_dir, "memory.json")
    write_json(path, {"batch_size": cfg.memory_batch_size, **study})
    print(f"memory: written to {path}")


# ----------------------------------------------------------------------------------------------- main


def bench_once(cfg: BenchConfig, device: str) -> dict:
    out = run_bench(cfg)
    print_result(out["result"], cfg.profile)
    if cfg.profile:
        write_profile(out["profiler"], cfg, device)
    return out["result"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg, argv = load_config(argv)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    attention, attention_why = resolve_attention(cfg.attention, device, dtype)
    print(f"defaults: dtype={dtype} ({dtype_reason(cfg.dtype, device)}); attention={attention} ({attention_why})")
    cfg = dataclasses.replace(cfg, attention=attention)
    if cfg.ablation or cfg.numerics or cfg.memory:  # studies: any of them, in this order
        if cfg.ablation:
            report_ablation(cfg, argv, device, run_ablation(cfg, argv, device))
        if cfg.numerics:
            report_numerics(cfg, numerics_study(cfg, device))
        if cfg.memory:
            report_memory(cfg, memory_study(cfg, argv, device))
        return
    result = largest_batch(cfg) if cfg.find_max_batch else bench_once(cfg, device)
    if cfg.result_json:
        write_json(cfg.result_json, {"config": asdict(cfg), **result})


if __name__ == "__main__":
    exit_on_user_error(main)
