"""
Peak memory of one training step by sequence length, math attention against SDPA, each point a bench.py run in a
fresh process; on CUDA also the largest batch that fits at block_size (a search in a fresh process per path).

$ python benchmarks/memory.py                                   # bench.py's config (CPU: config/bench_cpu.py)
$ python benchmarks/memory.py --memory_seq_lens=256,512,1024,2048 --memory_batch_size=1
$ python benchmarks/memory.py --memory_budget_gb=20             # CUDA: the largest batch within 20 GiB

On the CPU only peak RSS can be read, and it never goes down within a process: hence a process per point. Prints
Markdown tables, writes results_dir/memory.json and memory.png (peak MiB against sequence length).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import bench  # noqa: E402
from benchmarks import markdown_table, run_child, study_config  # noqa: E402
from nanogpt.config import AtLeast1, Positive, check, declared_problems  # noqa: E402
from nanogpt.device import resolve_device  # noqa: E402
from nanogpt.distributed import Dist  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from nanogpt.measure import write_json  # noqa: E402
from nanogpt.optional import pyplot  # noqa: E402
from nanogpt.step import train_step  # noqa: E402

PATHS = {"math": dict(attention="math"), "sdpa/auto": dict(attention="sdpa", sdpa_backend="auto")}
MAX_BATCH = 65536  # the search's cap
CHART = "benchmarks/memory.py (for memory.png)"  # what needs matplotlib, for its error


@dataclass
class MemoryConfig:
    memory_seq_lens: tuple[int, ...] = (256, 512, 1024, 2048)  # each is the block_size of one measurement
    memory_batch_size: AtLeast1[int] = 1
    memory_budget_gb: Positive[float | None] = None  # the largest-batch search's budget; None: the whole GPU
    find_max_batch: bool = False  # this process runs one largest-batch search (the study starts it, per path)


def child_runs(own: MemoryConfig) -> list[dict]:
    """Every child process of the study; all eager: compiling would add its own memory and minutes per point."""
    runs = []
    for path, changes in PATHS.items():
        for T in own.memory_seq_lens:
            runs.append(dict(kind="point", path=path, seq_len=T, script="bench.py", overrides={
                **changes, "block_size": T, "batch_size": own.memory_batch_size, "gradient_accumulation_steps": 1,
                "warmup_steps": 0, "timed_steps": 1, "compile": False}))
    for path, changes in PATHS.items():
        budget = {} if own.memory_budget_gb is None else {"memory_budget_gb": own.memory_budget_gb}
        runs.append(dict(kind="largest_batch", path=path, seq_len=None, script="benchmarks/memory.py",
                         overrides={**changes, "find_max_batch": True, "compile": False, **budget}))
    return runs


def memory_study(own: MemoryConfig, argv: list[str], device: str) -> dict:
    points, largest = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, run in enumerate(child_runs(own)):
            if run["kind"] == "largest_batch" and not device.startswith("cuda"):
                largest.append({"path": run["path"], "status": "n/a", "reason": "CUDA only"})
                continue
            r = run_child(argv, run["overrides"], os.path.join(tmp, f"run{i}.json"), script=run["script"])
            if run["kind"] == "point":
                points.append({"path": run["path"], "seq_len": run["seq_len"], **r})
                done = f"{r['peak_memory_mib']:.1f} MiB" if r["status"] == "ok" else r["reason"]
                print(f"  [memory] {run['path']} T={run['seq_len']}: {done}", flush=True)
            else:
                largest.append({"path": run["path"], **r})
    return {"points": points, "largest_batch": largest}


def largest_fitting(fits: Callable[[int], bool], cap: int = MAX_BATCH) -> int:
    """The largest size in [1, cap] that fits (0: none), if every size below one that fits fits too: sizes double
    until one does not, then a binary search."""
    lo, hi = 0, 1  # lo: the largest size that fitted (0: none), hi: the next size to try
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)  # cap fitted: nothing above it is tried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def step_fits(run: dict, cfg: bench.BenchConfig, batch_size: int) -> bool:
    trial = dataclasses.replace(cfg, batch_size=batch_size, gradient_accumulation_steps=1)
    device = run["device"]
    # A fresh scaler per trial: an out-of-memory error raised after scaler.unscale_ would leave a shared one
    # "already unscaled", and the next trial would fail on that instead of on memory.
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=run["scaler"].is_enabled())
    try:
        train_step(run["model"], run["optimizer"], scaler, bench.step_batches(trial, 0, run["data_path"]),
                   run["ctx"], trial, Dist(device=device))
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        run["optimizer"].zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def largest_batch(cfg: bench.BenchConfig, budget_gb: float | None) -> dict:
    """CUDA only: the largest batch_size whose training step fits in budget_gb (None: the whole GPU)."""
    device = resolve_device(cfg.device)
    if not device.startswith("cuda"):
        raise UserError(f"find_max_batch needs CUDA (the device is {device}): on the CPU, memory is not the limit")
    run = bench.setup_run(cfg)
    total = torch.cuda.get_device_properties(device).total_memory
    if budget_gb is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gb * 2**30 / total), device)
    found = largest_fitting(lambda b: step_fits(run, run["cfg"], b))
    budget = f"{budget_gb} GiB" if budget_gb is not None else f"{total / 2**30:.1f} GiB (all)"
    print(f"largest batch that fits: {found} (block {cfg.block_size}, budget {budget})")
    return {"max_batch": found, "budget": budget}


def plot_memory(study: dict, path: str) -> str:
    plt = pyplot(CHART)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in PATHS:
        ok = [p for p in study["points"] if p["path"] == name and p["status"] == "ok"]
        ax.plot([p["seq_len"] for p in ok], [p["peak_memory_mib"] for p in ok], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (block_size)")
    ax.set_ylabel("peak memory of one step (MiB)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(own: MemoryConfig, cfg: bench.BenchConfig, study: dict) -> None:
    lens = list(own.memory_seq_lens)
    peak = {(p["path"], p["seq_len"]): p.get("peak_memory_mib") for p in study["points"]}  # None: not measured
    rows = [[path, *(f"{peak[path, T]:.0f}" if peak[path, T] is not None else "n/a" for T in lens)] for path in PATHS]
    # what the (B, nh, T, T) attention matrices of the math path cost: grows with T^2 where the rest grows with T
    rows.append(["math - sdpa", *(f"{peak['math', T] - peak['sdpa/auto', T]:.0f}"
                                  if None not in (peak["math", T], peak["sdpa/auto", T]) else "n/a" for T in lens)])
    print(f"memory: peak MiB of one training step (forward, backward, AdamW; eager), batch {own.memory_batch_size}, "
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
    write_json(path, {"batch_size": own.memory_batch_size, **study})
    png = plot_memory(study, os.path.join(cfg.results_dir, "memory.png"))
    print(f"memory: written to {path} and {png}")


def main(argv: list[str] | None = None) -> None:
    own, argv = study_config(MemoryConfig(), sys.argv[1:] if argv is None else argv, bench.BenchConfig())
    problems = declared_problems(own)
    if not own.memory_seq_lens or min(own.memory_seq_lens) < 1:
        problems.append(f"memory_seq_lens={own.memory_seq_lens} must be positive lengths, e.g. 256,512,1024")
    check(problems)
    cfg, argv = bench.load_config(argv)
    if own.find_max_batch:  # one search, in the process the study started for it
        result = largest_batch(cfg, own.memory_budget_gb)
        if cfg.result_json:
            write_json(cfg.result_json, result)
        return
    pyplot(CHART)  # a missing matplotlib fails now, not after the measurements
    report(own, cfg, memory_study(own, argv, resolve_device(cfg.device)))


if __name__ == "__main__":
    exit_on_user_error(main)
