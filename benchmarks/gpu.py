"""
The GPU benchmarks in one run, each row a fresh `python bench.py ... --result_json=FILE` (bench.py's command line and
JSON are the interface); on one H100 about 11 minutes with torch.compile's cache cold. docs/gpu.md has the results.

    python data/shakespeare_char/prepare.py     # once, for the baby GPT's time to loss
    python benchmarks/gpu.py                    # everything; results in gpu_results/ (gpu.json, gpu.md)
    python benchmarks/gpu.py --parts=headline,largest --results_dir=/tmp/r --peak_flops=989e12

Parts (in this order; --parts picks some), beside nanoGPT's published A100 figures where there are some:
  recipe     GPT-2 124M at the FineWeb recipe's shape per GPU (64 x 1024, bias): tokens/s, MFU, the multiple of the
             matmul floor, peak memory, a profile; then a row per speed key (max-autotune, CUDA graphs, fp8)
  headline   GPT-2 124M at nanoGPT's bench settings (12 x 1024, bf16, compile, SDPA, padded vocabulary): ms/iter,
             tokens/s and MFU against the GPU's dense bf16 peak (mfu.PEAK_FLOPS by name, else --peak_flops)
  attention  math attention -> SDPA (auto) -> each SDPA kernel -> flash with the padded vocabulary
  cumulative float32 -> + TF32 -> + bf16 -> + compile -> + flash -> + padded vocabulary
  largest    the largest micro-batch at block 1024, math attention vs SDPA (benchmarks/memory.py --find_max_batch)
  baby       the baby GPT (config/train_shakespeare_char.py): wall time until its val loss reaches 1.47

nanoGPT side by side (--nanogpt=PATH, a checkout of karpathy/nanoGPT; then only this part runs, unless --parts names
others): its `bench.py --real_data=False` and ours at the same settings in alternating fresh processes, at 12 x 1024
and 64 x 1024 with biases, --rounds times: ms/iter, tokens/s and the ratio of the medians.

    python benchmarks/gpu.py --nanogpt=../nanoGPT --rounds=2
    python benchmarks/gpu.py --nanogpt=../nanoGPT --ours="--compile_mode='max-autotune'"   # a setting of ours

A row the GPU cannot run shows bench.py's one-line reason. The results are rewritten after each row; --budget_minutes
(default 25) stops starting new rows (the rest are "skipped"). Exit status: 0; 2 for a usage error (e.g. no GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import override_args, sdpa  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from nanogpt.mfu import PEAK_FLOPS, gpu_peak_flops  # noqa: E402
from nanogpt.metrics import read_records  # noqa: E402

PARTS = ("nanogpt", "recipe", "headline", "attention", "cumulative", "largest", "baby")
# config/train_gpt2_fineweb.py per GPU, one micro-step; each RECIPE row changes one key of it
RECIPE_BENCH = ["--batch_size=64", "--bias=True", "--attention='sdpa'", "--sdpa_backend='flash'"]
RECIPE = [
    ("bf16", "bf16, compile (the recipe)", {}, None),
    ("autotune", "compile_mode=max-autotune-no-cudagraphs", {"compile_mode": "max-autotune-no-cudagraphs"}, None),
    ("cudagraphs", "compile_mode=max-autotune (+ CUDA graphs)", {"compile_mode": "max-autotune"}, None),
    ("fp8", "fp8=True, tensorwise (fp8_layers=auto)", {"fp8": True, "fp8_recipe": "tensorwise"}, None),
    ("fp8-all", "fp8=True, tensorwise, every layer", {"fp8": True, "fp8_recipe": "tensorwise", "fp8_layers": "all"},
     None),
    ("fp8-rowwise-all", "fp8=True, rowwise, every layer",
     {"fp8": True, "fp8_recipe": "rowwise", "fp8_layers": "all"}, None),
]
# nanoGPT's bench settings: GPT-2 124M (bench.py's defaults), batch 12 x 1024, bf16 autocast, compiled
BENCH = ["--device=cuda", "--batch_size=12", "--block_size=1024", "--gradient_accumulation_steps=1",
         "--dtype='bfloat16'", "--compile=True"]

# (name, label, bench.py overrides, nanoGPT's published A100 figure or None)
ATTENTION = [
    ("math", "math attention (nanoGPT's)", {"attention": "math", "vocab_padding_multiple": 1}, 143.0),
    ("sdpa", "SDPA (auto kernel)", sdpa("auto"), None),
    ("sdpa-math", "SDPA math kernel", sdpa("math"), None),
    ("efficient", "SDPA memory-efficient kernel", sdpa("efficient"), None),
    ("cudnn", "SDPA cuDNN kernel", sdpa("cudnn"), None),
    ("flash", "SDPA flash kernel", sdpa("flash"), 113.0),
    ("flash+pad", "flash + padded vocab (64)", sdpa("flash", 64), 87.0),
]
ATTENTION_NOTE = ("nanoGPT's published A100 sequence is 143 -> 134 -> 119 -> 113 -> 87 ms/iter; the rows of 143 "
                  "(math), 113 (flash) and 87 (flash + padding) are named there, the intermediate 134 and 119 are not")
# each row adds its change to the ones above; published: tokens/s of a 124M step of 16 x 1024 on one A100
CUMULATIVE = [
    ("float32", "float32 (math, no TF32/compile/padding)",
     {"dtype": "float32", "tf32": False, "compile": False, "attention": "math", "vocab_padding_multiple": 1}, 16_000),
    ("tf32", "+ TF32 matmuls", {"tf32": True}, 49_000),
    ("bf16", "+ bf16 autocast", {"dtype": "bfloat16"}, 54_500),
    ("compile", "+ torch.compile", {"compile": True}, 126_000),
    ("flash", "+ SDPA flash", {"attention": "sdpa", "sdpa_backend": "flash"}, 170_000),
    ("padded", "+ padded vocab (64)", {"vocab_padding_multiple": 64}, 175_000),
]
# nanoGPT's bench.py beside ours: (label, batch size, biases), block 1024; nanoGPT times 20 steps after 10 burn-in
SIDE_BY_SIDE = [("12 x 1024", 12, False), ("64 x 1024, bias", 64, True)]
SIDE_BY_SIDE_STEPS = ["--warmup_steps=10", "--timed_steps=20"]
LARGEST = [("math", {"attention": "math"}, 24), ("sdpa", {"attention": "sdpa", "sdpa_backend": "auto"}, 39)]
BABY_TARGET, BABY_REFERENCE_S = 1.47, 180.0
SKIPPED = {"status": "skipped", "reason": "time budget spent (--budget_minutes)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=None, help=f"comma-separated, of: {', '.join(PARTS)} (default: all but nanogpt; "
                                                "with --nanogpt, nanogpt alone)")
    p.add_argument("--nanogpt", default=None, metavar="PATH",
                   help="a checkout of karpathy/nanoGPT: its bench.py side by side with this project's")
    p.add_argument("--rounds", type=int, default=2, help="--nanogpt: the alternations of the two (fresh processes)")
    p.add_argument("--ours", default="", help="--nanogpt: more bench.py keys for this project's runs, e.g. "
                                              "\"--compile_mode='max-autotune'\"")
    p.add_argument("--results_dir", default="gpu_results", help="where gpu.json and gpu.md go")
    p.add_argument("--peak_flops", type=float, default=None,
                   help="the GPU's dense bf16 peak FLOP/s for MFU (default: mfu.PEAK_FLOPS by device name)")
    p.add_argument("--budget_minutes", type=float, default=25.0, help="start no new row after this")
    p.add_argument("--warmup_steps", type=int, default=5,
                   help="bench.py's untimed steps per row (compile happens here)")
    p.add_argument("--timed_steps", type=int, default=15, help="bench.py's timed steps per row")
    p.add_argument("--baby_max_minutes", type=float, default=8.0, help="stop the baby GPT after this, reached or not")
    args = p.parse_args(argv)
    if args.parts is None:
        args.parts = "nanogpt" if args.nanogpt else ",".join(p for p in PARTS if p != "nanogpt")
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    problems = [f"unknown part {s!r} (parts: {', '.join(PARTS)})" for s in parts if s not in PARTS]
    if not parts:
        problems.append(f"--parts is empty: give one or more of {', '.join(PARTS)}")
    if args.peak_flops is not None and args.peak_flops <= 0:
        problems.append(f"--peak_flops={args.peak_flops} must be positive, e.g. 989e12")
    for key in ("budget_minutes", "baby_max_minutes"):
        if getattr(args, key) <= 0:
            problems.append(f"--{key}={getattr(args, key)} must be positive")
    if "nanogpt" in parts:
        problems += nanogpt_problems(args.nanogpt)
    if args.rounds < 1:
        problems.append(f"--rounds={args.rounds} must be at least 1")
    if args.warmup_steps < 1 or args.timed_steps < 1:
        problems.append("--warmup_steps and --timed_steps must be at least 1 (compile happens in the warm-up)")
    if problems:
        raise UserError("; ".join(problems))
    args.parts = [p for p in PARTS if p in parts]
    return args


def device_peak(device_name: str, peak_flops: float | None) -> tuple[float | None, str]:
    """The peak FLOP/s for MFU and where it comes from: --peak_flops, the table, or unknown."""
    if peak_flops is not None:
        return peak_flops, f"--peak_flops={peak_flops:.4g}"
    peak = gpu_peak_flops(device_name)
    if peak is None:
        return None, (f"unknown device {device_name!r}: not in mfu.PEAK_FLOPS ({', '.join(PEAK_FLOPS)}); "
                      f"give --peak_flops for MFU")
    return peak, f"{peak / 1e12:.0f} TFLOP/s dense bf16 ({device_name}, mfu.PEAK_FLOPS)"


def require_gpu() -> str:
    import torch

    if not torch.cuda.is_available():
        raise UserError("benchmarks/gpu.py measures a CUDA GPU and none is available here (torch.cuda.is_available() "
                        "is False): run it on a machine with an NVIDIA GPU and a CUDA build of torch")
    return torch.cuda.get_device_name(0)


def run_bench(args: list[str], tmp: str, timeout_s: float, script: str = "bench.py") -> dict:
    """One `python bench.py ARGS --result_json=...` (or `script`, which takes bench.py's keys) in a fresh process:
    its JSON, or status n/a (the one-line error, exit 2) or failed (anything else), with the reason."""
    path = os.path.join(tmp, f"row{time.monotonic_ns()}.json")
    cmd = [sys.executable, script, *args, f"--result_json={path}"]
    command = "python " + " ".join(cmd[1:-1])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s", "command": command}
    wall_s = round(time.perf_counter() - t0, 1)
    if proc.returncode == 0:
        with open(path) as f:
            result = json.load(f)
        result.pop("config", None)
        return {"status": "ok", "command": command, "wall_s": wall_s, **result}
    lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
    errors = [line[len("error: "):] for line in lines if line.startswith("error: ")]
    if proc.returncode == 2 and errors:
        return {"status": "n/a", "reason": errors[-1], "command": command}
    return {"status": "failed", "reason": f"exit {proc.returncode}: {lines[-1][:300]}", "command": command}


@dataclass
class Report:
    """Everything measured so far, rewritten to results_dir (gpu.json, gpu.md) after every row."""
    results_dir: str
    machine: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)

    def write(self) -> None:
        os.makedirs(self.results_dir, exist_ok=True)
        for name, text in (("gpu.json", json.dumps({"machine": self.machine, **self.parts}, indent=1)),
                           ("gpu.md", markdown(self.machine, self.parts))):
            tmp = os.path.join(self.results_dir, f".{name}.tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(self.results_dir, name))


class Budget:
    def __init__(self, minutes: float):
        self.deadline = time.monotonic() + 60 * minutes
        self.t0 = time.monotonic()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def timeout_s(self) -> float:  # for a row: what is left, but at least a minute
        return max(60.0, self.left_s())

    def elapsed(self) -> str:
        return f"{(time.monotonic() - self.t0) / 60:.1f} min"


def progress(budget: Budget, msg: str) -> None:
    print(f"[{budget.elapsed()}] {msg}", flush=True)


def row_summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']}: {r['reason']}"
    if "max_batch" in r:
        return f"largest batch {r['max_batch']}"
    return f"{r['ms_median']:.1f} ms/iter, {r['tokens_per_s']:,.0f} tokens/s ({r['wall_s']:.0f} s in all)"


def run_rows(rows: list[tuple], base: list[str], steps: list[str], budget: Budget, tmp: str, part: str,
             report: Report, cumulative: bool = False) -> list[dict]:
    out, accumulated = [], {}
    report.parts[part] = {"rows": out}
    for i, (name, label, overrides, reference) in enumerate(rows):
        accumulated = {**accumulated, **overrides} if cumulative else overrides
        entry = {"name": name, "label": label, "overrides": dict(accumulated), "reference": reference}
        if budget.left_s() <= 0:
            entry.update(SKIPPED)
        else:
            progress(budget, f"{part} {i + 1}/{len(rows)}: {label} ...")
            entry.update(run_bench([*base, *steps, *override_args(accumulated)], tmp, timeout_s=budget.timeout_s()))
        out.append(entry)
        progress(budget, f"{part} {i + 1}/{len(rows)}: {label}: {row_summary(entry)}")
        report.write()
    first = out[0]
    for r in out:
        ok = r["status"] == "ok" and first["status"] == "ok"
        r["speedup"] = first["ms_median"] / r["ms_median"] if ok else None
    report.write()
    return out


def nanogpt_problems(path: str | None) -> list[str]:
    if path is None:
        return ["the nanogpt part needs --nanogpt=PATH, a checkout of karpathy/nanoGPT (git clone "
                "https://github.com/karpathy/nanoGPT)"]
    missing = [f for f in ("bench.py", "model.py", "configurator.py") if not os.path.isfile(os.path.join(path, f))]
    if missing:
        return [f"--nanogpt={path!r} has no {', '.join(missing)}: give the folder of a checkout of karpathy/nanoGPT "
                f"(git clone https://github.com/karpathy/nanoGPT)"]
    return []


def nanogpt_bench(path: str, batch: int, bias: bool, timeout_s: float) -> dict:
    """nanoGPT's `python bench.py --real_data=False` (block 1024, bf16, compiled) in its checkout: the ms/iter it
    prints (the mean of its 20 timed steps)."""
    args = ["--real_data=False", f"--batch_size={batch}", "--block_size=1024", f"--bias={bias}", "--dtype=bfloat16",
            "--compile=True"]
    command = f"cd {path} && python bench.py {' '.join(args)}"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "bench.py", *args], cwd=path, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout_s:.0f} s", "command": command}
    found = re.search(r"time per iteration: ([0-9.]+)ms", proc.stdout)
    if proc.returncode != 0 or found is None:
        last = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "reason": f"exit {proc.returncode}: {last[:300]}", "command": command}
    ms = float(found.group(1))
    return {"status": "ok", "command": command, "wall_s": round(time.perf_counter() - t0, 1), "ms_mean": ms,
            "tokens_per_s": batch * 1024 / (ms / 1000)}


def side_by_side(args, base: list[str], budget: Budget, tmp: str, report: Report) -> dict:
    """nanoGPT's bench.py and ours at each SIDE_BY_SIDE shape, --rounds times, who goes first alternating."""
    ours_extra = shlex.split(args.ours)
    part = report.parts["nanogpt"] = {"rows": [], "ours_extra": ours_extra, "nanogpt": os.path.abspath(args.nanogpt)}
    for round_ in range(args.rounds):
        for label, batch, bias in SIDE_BY_SIDE:
            runs = [("nanoGPT", lambda: nanogpt_bench(args.nanogpt, batch, bias, budget.timeout_s())),
                    ("ours", lambda: run_bench([*base, f"--batch_size={batch}", f"--bias={bias}", *SIDE_BY_SIDE_STEPS,
                                                *ours_extra], tmp, timeout_s=budget.timeout_s()))]
            for who, run in runs if round_ % 2 == 0 else runs[::-1]:
                if budget.left_s() <= 0:
                    entry = dict(SKIPPED)
                else:
                    progress(budget, f"round {round_ + 1}/{args.rounds}, {label}: {who} ...")
                    entry = run()
                part["rows"].append({"shape": label, "who": who, "round": round_ + 1, **entry})
                progress(budget, f"round {round_ + 1}/{args.rounds}, {label}: {who}: " + (
                    f"{entry['ms_mean']:.1f} ms/iter, {entry['tokens_per_s']:,.0f} tokens/s"
                    if entry["status"] == "ok" else f"{entry['status']}: {entry['reason']}"))
                report.write()
    part["summary"] = side_by_side_summary(part["rows"])
    report.write()
    return part


def side_by_side_summary(rows: list[dict]) -> list[dict]:
    """Per shape: each side's ms/iter, their medians, tokens/s at them, and nanoGPT's median over ours (above 1: ours
    is faster)."""
    out = []
    for label, batch, _ in SIDE_BY_SIDE:
        ms = {who: [r["ms_mean"] for r in rows if r["shape"] == label and r["who"] == who and r["status"] == "ok"]
              for who in ("nanoGPT", "ours")}
        med = {who: statistics.median(v) if v else None for who, v in ms.items()}
        ratio = med["nanoGPT"] / med["ours"] if med["nanoGPT"] and med["ours"] else None
        out.append({"shape": label, "ms": ms, "median_ms": med, "ratio": ratio,
                    "tokens_per_s": {who: batch * 1024 / (m / 1000) if m else None for who, m in med.items()}})
    return out


def baby_gpt(results_dir: str, budget: Budget, max_minutes: float) -> dict:
    """train.py config/train_shakespeare_char.py until an eval's val loss is <= 1.47 (then SIGTERM), or max_minutes.
    The time is the run's elapsed_s at that eval: compile and the evals count, as in nanoGPT's ~3 minutes."""
    data_dir = os.path.join(ROOT, "data", "shakespeare_char")
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(os.path.join(data_dir, "train.bin")) or not os.path.exists(meta_path):
        return {"status": "n/a", "reason": "no data/shakespeare_char: run python data/shakespeare_char/prepare.py "
                                           "(offline: --input PATH to tiny shakespeare's input.txt)"}
    with open(meta_path) as f:
        meta = json.load(f)
    note = "" if meta.get("vocab_size") == 65 else (
        f"the data is not tiny shakespeare ({meta.get('source', '?')}, {meta.get('vocab_size')} characters): "
        f"the 1.47 target is tiny shakespeare's")
    out_dir = os.path.abspath(os.path.join(results_dir, "baby_gpt"))  # train.py runs in the repo root
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--out_dir={out_dir!r}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60 * min(max_minutes, max(1.0, budget.left_s() / 60))
    reached, evals = None, []
    while proc.poll() is None and time.monotonic() < deadline and reached is None:
        time.sleep(2)
        if os.path.exists(metrics):
            evals = [r for r in read_records(metrics) if "val_loss" in r]
            reached = next((r for r in evals if r["val_loss"] <= BABY_TARGET), None)
            if evals:
                progress(budget, f"baby GPT: iter {evals[-1]['iter']}, val loss {evals[-1]['val_loss']:.4f}")
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # a graceful stop: checkpoint, exit
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    best = min(evals, key=lambda r: r["val_loss"]) if evals else None
    result = {"command": "python " + " ".join(cmd[1:]), "target": BABY_TARGET, "reference_s": BABY_REFERENCE_S,
              "evals": evals, "note": note}
    if reached is not None:
        return {**result, "status": "ok", "seconds": reached["elapsed_s"], "iter": reached["iter"],
                "val_loss": reached["val_loss"]}
    if not evals:
        return {**result, "status": "failed", "reason": (err.strip().splitlines() or ["no eval"])[-1][:300]}
    return {**result, "status": "not reached", "reason": f"best val loss {best['val_loss']:.4f} at iter "
            f"{best['iter']} ({best['elapsed_s']:.0f} s)", "seconds": None}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ms(r: dict) -> str:
    return f"{r['ms_median']:.1f}" if r.get("status") == "ok" else "-"


def _note(r: dict) -> str:
    return "" if r.get("status") == "ok" else f"{r['status']}: {r.get('reason', '')}"


def markdown(machine: dict, parts: dict) -> str:
    out = [f"GPU benchmarks on {machine.get('device_name', '?')} (torch {machine.get('torch', '?')}, CUDA "
           f"{machine.get('cuda', '?')}); MFU peak: {machine.get('peak_source', '?')}"]
    if "nanogpt" in parts and "summary" in parts["nanogpt"]:
        p = parts["nanogpt"]

        def runs(v: list[float]) -> str:
            return ", ".join(f"{x:.1f}" for x in v) or "-"

        rows = [[s["shape"], runs(s["ms"]["nanoGPT"]), runs(s["ms"]["ours"]),
                 *(f"{s['tokens_per_s'][w]:,.0f}" if s["tokens_per_s"][w] else "-" for w in ("nanoGPT", "ours")),
                 f"{s['ratio']:.3f}x" if s["ratio"] else "-"] for s in p["summary"]]
        extra = f" with {' '.join(p['ours_extra'])}" if p["ours_extra"] else ""
        out += ["", f"nanoGPT's bench.py --real_data=False beside this project's bench.py{extra} (GPT-2 124M, bf16, "
                "compiled, fused AdamW; ms/iter: each run's mean over its 20 timed steps, fresh processes "
                "alternating; tokens/s and the ratio at the medians):", "",
                _table(["shape", "nanoGPT ms/iter", "ours ms/iter", "nanoGPT tokens/s", "ours tokens/s",
                        "speed-up (nanoGPT's time / ours)"], rows)]
    if "recipe" in parts:
        rows = [[r["label"], _ms(r), f"{r['tokens_per_s']:,.0f}" if r.get("status") == "ok" else "-",
                 f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "-",
                 f"{r['floor_multiple']:.2f}x" if r.get("floor_multiple") else "-",
                 f"{r['peak_memory_mib']:.0f}" if r.get("peak_memory_mib") is not None else "-",
                 f"{r['loss']:.4f}" if r.get("loss") is not None else "-",
                 f"{r['speedup']:.2f}x" if r.get("speedup") else "-", _note(r)] for r in parts["recipe"]["rows"]]
        out += ["", "GPT-2 124M at the FineWeb recipe's shape (64 x 1024 per GPU, bf16, compile, flash, padded "
                "vocabulary), each row a fresh process; llm.c: ~470k tokens/s per H100:", "",
                _table(["row", "ms/iter", "tokens/s", "MFU", "x matmul floor", "peak MiB", "loss after", "speed-up",
                        "note"], rows)]
    if "headline" in parts:
        r = parts["headline"]
        mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "n/a (unknown peak: --peak_flops)"
        out += ["", "GPT-2 124M, batch 12 x 1024, bf16 autocast, torch.compile, SDPA, padded vocabulary:", "",
                _table(["ms/iter", "tokens/s", "MFU", "peak MiB", "note"],
                       [[_ms(r), f"{r['tokens_per_s']:,.0f}" if r.get("status") == "ok" else "-",
                         mfu if r.get("status") == "ok" else "-",
                         f"{r['peak_memory_mib']:.0f}" if r.get("peak_memory_mib") is not None else "-", _note(r)]])]
    if "attention" in parts:
        rows = [[r["label"], _ms(r), f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
                 f"{r['reference']:.0f}" if r["reference"] else "-", _note(r)] for r in parts["attention"]["rows"]]
        out += ["", "Attention (GPT-2 124M, 12 x 1024, bf16, compile), each row a fresh process:", "",
                _table(["row", "ms/iter", "speed-up", "A100 published ms/iter", "note"], rows), "",
                ATTENTION_NOTE + "."]
    if "cumulative" in parts:
        rows = [[r["label"], _ms(r), f"{r['tokens_per_s']:,.0f}" if r.get("status") == "ok" else "-",
                 f"{r['speedup']:.2f}x" if r.get("speedup") else "-", f"{r['reference']:,}", _note(r)]
                for r in parts["cumulative"]["rows"]]
        out += ["", "Cumulative (GPT-2 124M, 12 x 1024), each row adds its change to the rows above:", "",
                _table(["row", "ms/iter", "tokens/s", "speed-up", "A100 published tokens/s (16 x 1024)", "note"], rows)]
    if "largest" in parts:
        rows = [[r["path"], str(r["max_batch"]) if r.get("status") == "ok" else "-", str(r["reference"]),
                 r.get("budget", "") if r.get("status") == "ok" else _note(r)] for r in parts["largest"]["rows"]]
        out += ["", "Largest micro-batch at block 1024 (GPT-2 124M, bf16, eager):", "",
                _table(["attention", "largest batch", "A100 80GB published", "note"], rows)]
    if "baby" in parts:
        r = parts["baby"]
        seconds = f"{r['seconds']:.0f}" if r.get("seconds") is not None else "-"
        note = "; ".join(x for x in (r.get("reason", "") if r["status"] != "ok" else "", r.get("note", "")) if x)
        out += ["", f"Baby GPT (config/train_shakespeare_char.py), time to val loss {BABY_TARGET}:", "",
                _table(["seconds", "iter", "val loss", "nanoGPT on an A100", "note"],
                       [[seconds, str(r.get("iter", "-")), f"{r['val_loss']:.4f}" if "val_loss" in r else "-",
                         f"~{BABY_REFERENCE_S:.0f} s", note]])]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device_name = require_gpu()
    import torch

    peak, peak_source = device_peak(device_name, args.peak_flops)
    report = Report(args.results_dir)
    report.machine = {"device_name": device_name, "torch": torch.__version__, "cuda": str(torch.version.cuda),
                      "peak_flops": peak, "peak_source": peak_source, "parts": args.parts}
    budget = Budget(args.budget_minutes)
    progress(budget, f"{device_name}; MFU peak: {peak_source}; parts: {', '.join(args.parts)}; results in "
                     f"{args.results_dir}")
    steps = [f"--warmup_steps={args.warmup_steps}", f"--timed_steps={args.timed_steps}"]
    base = BENCH + ([f"--peak_flops={peak}"] if peak is not None else [])
    with tempfile.TemporaryDirectory() as tmp:
        if "nanogpt" in args.parts:
            side_by_side(args, base, budget, tmp, report)
        if "recipe" in args.parts:
            run_rows(RECIPE, [*base, *RECIPE_BENCH], steps, budget, tmp, "recipe", report)
            if budget.left_s() > 0:  # the recipe again, then steps under torch.profiler (top kernels, GPU busy)
                folder = os.path.join(os.path.abspath(args.results_dir), "profile")
                progress(budget, f"recipe under the profiler (top kernels, trace in {folder}) ...")
                report.parts["recipe"]["profile"] = run_bench(
                    [*base, *RECIPE_BENCH, *steps, "--profile=True", f"--results_dir={folder}"], tmp,
                    timeout_s=budget.timeout_s())
                report.parts["recipe"]["profile"]["folder"] = folder
                report.write()
        if "headline" in args.parts:
            progress(budget, "headline: GPT-2 124M, 12 x 1024, bf16, compile ...")
            report.parts["headline"] = run_bench([*base, *steps], tmp, timeout_s=budget.timeout_s())
            progress(budget, f"headline: {row_summary(report.parts['headline'])}")
            report.write()
        if "attention" in args.parts:
            run_rows(ATTENTION, base, steps, budget, tmp, "attention", report)
        if "cumulative" in args.parts:
            run_rows(CUMULATIVE, base, steps, budget, tmp, "cumulative", report, cumulative=True)
        if "largest" in args.parts:
            rows = []
            report.parts["largest"] = {"rows": rows}
            for path, overrides, reference in LARGEST:
                entry = {"path": path, "reference": reference}
                if budget.left_s() <= 0:
                    entry.update(SKIPPED)
                else:
                    progress(budget, f"largest batch, {path} attention ...")
                    entry.update(run_bench([*BENCH, "--compile=False", "--find_max_batch=True",
                                            *override_args(overrides)], tmp, timeout_s=budget.timeout_s(),
                                           script="benchmarks/memory.py"))
                rows.append(entry)
                progress(budget, f"largest batch, {path}: {row_summary(entry)}")
                report.write()
        if "baby" in args.parts:
            if budget.left_s() <= 0:
                report.parts["baby"] = dict(SKIPPED)
            else:
                progress(budget, f"baby GPT until val loss {BABY_TARGET} ...")
                report.parts["baby"] = baby_gpt(args.results_dir, budget, args.baby_max_minutes)
            r = report.parts["baby"]
            progress(budget, "baby GPT: " + (f"val {r['val_loss']:.4f} at iter {r['iter']} after {r['seconds']:.0f} s"
                                             if r["status"] == "ok" else f"{r['status']}: {r['reason']}"))
            report.write()
    print(markdown(report.machine, report.parts))
    progress(budget, f"written: {os.path.join(args.results_dir, 'gpu.json')} and gpu.md")


if __name__ == "__main__":
    exit_on_user_error(main)
