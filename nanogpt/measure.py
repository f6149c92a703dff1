"""What bench.py and benchmarks/ measure with (the machine, peak memory, optimizer time, the profile, a step's matmul
floor); the training path never imports it."""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time

import torch

from nanogpt import files
from nanogpt.hardware import system_info
from nanogpt.device import DeviceClock, synchronize


def detect_allocator(maps: str | None = None, ld_preload: str | None = None) -> str:
    """The malloc this process uses (one mapped into it or in LD_PRELOAD, else the C library's): on the CPU an
    allocator change alone can be worth ~20%."""
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
    """Versions, hardware and load: other processes make CPU timings noisy."""
    info = system_info(device)
    if hasattr(os, "getloadavg"):
        info["load_1min"] = f"{os.getloadavg()[0]:.2f}/{os.cpu_count()}cpus"
    return info


def machine_line(device: str) -> str:
    return " ".join(f"{k}={v}" for k, v in machine_info(device).items())


def allocator_line(device: str) -> str:
    allocator = detect_allocator()
    if device == "cpu" and not allocator.startswith(("jemalloc", "tcmalloc", "mimalloc")):
        allocator += " (keep_freed_memory=True stops it returning freed buffers to the OS)"
    return f"allocator: {allocator}"


class OtherLoad:
    """The share of the CPUs other processes took while we measured (/proc/stat's busy time minus ours; None without
    it), to show beside CPU timings, which a busy machine makes slower and noisier."""

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
    """CPU seconds all cores spent busy since boot (/proc/stat's cpu line less idle and iowait)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _max_rss_kb() -> int:
    """Peak RSS in KiB from getrusage (macOS reports bytes), where there is no /proc."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


def _proc_status_kb(field: str) -> int | None:
    """A field of /proc/self/status (VmRSS, VmHWM) in KiB; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of the timed steps. CUDA: max_memory_allocated. CPU: peak RSS during them (VmHWM, reset through
    /proc/self/clear_refs) minus RSS before the first step: what training adds to the built model. Peak RSS never
    goes down within a process, so compare runs in fresh processes."""

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


def step_profiler(device: str) -> torch.profiler.profile:
    cuda = [torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else []
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, *cuda])


def write_profile(prof: torch.profiler.profile, results_dir: str, device: str) -> None:
    """results_dir/trace.json (chrome trace) and top_ops.txt (the 15 ops with the most self time)."""
    os.makedirs(results_dir, exist_ok=True)
    path = os.path.join(results_dir, "trace.json")
    prof.export_chrome_trace(path)
    sort_by = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=15)
    with open(os.path.join(results_dir, "top_ops.txt"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"profile: chrome trace of the profiled steps in {path} (open it in chrome://tracing or ui.perfetto.dev), "
          f"the table above in {os.path.join(results_dir, 'top_ops.txt')}")


def write_json(path: str, data: dict, fix: str = "free disk space, or give another path") -> None:
    """Written whole (a reader never sees half a file); a failure is one line."""
    files.write_text(path, json.dumps(data, indent=1), "the figures", fix)


def is_result(head: bytes) -> bool:
    """Whether a file holds bench.py's figures (a JSON object with a config), which a rerun may write over."""
    try:
        return isinstance(result := json.loads(head), dict) and isinstance(result.get("config"), dict)
    except (ValueError, RecursionError):
        return False


class OptimizerTimer:
    """Each optimizer's step time (the AdamW and Muon of an optim.Optimizers) while `timing`: DeviceClock marks
    around each step count a GPU's kernels, not their launch, without waiting inside the steps. Read `ms` after
    synchronizing."""

    def __init__(self, optimizers, device: str):
        self.clock, self.timing = DeviceClock(device), False
        self.marks: dict[str, list] = {name: [] for name in optimizers.optimizers}
        for name, opt in optimizers.optimizers.items():
            opt.step = self._timed(name, opt.step)

    def _timed(self, name: str, step):
        def timed_step(*args, **kwargs):
            if not self.timing:
                return step(*args, **kwargs)
            start = self.clock.mark()
            out = step(*args, **kwargs)
            self.marks[name].append((start, self.clock.mark()))
            return out
        return timed_step

    @property
    def ms(self) -> dict[str, float]:
        return {name: sum(self.clock.ms(a, b) for a, b in pairs) for name, pairs in self.marks.items()}


def busy_share(intervals: list[tuple[float, float]]) -> float | None:
    """The share of the span from the first start to the last end that some interval covers (None for none): on
    a profile's GPU kernels, how busy the GPU was; the rest it waited for the host."""
    if not intervals:
        return None
    intervals = sorted(intervals)
    covered, (start, end) = 0.0, intervals[0]
    for a, b in intervals[1:]:
        if a > end:
            covered, start = covered + end - start, a
        end = max(end, b)
    covered += end - start
    span = max(b for _, b in intervals) - intervals[0][0]
    return covered / span if span > 0 else 1.0


def gpu_busy_share(prof: torch.profiler.profile) -> float | None:
    """busy_share of a profile's device activity; None without any (a CPU profile)."""
    from torch.autograd import DeviceType

    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return busy_share(spans)


# The profiler's matmul ops: the function that replays each, and how many leading arguments are operands
MATMULS = {"aten::mm": (torch.mm, 2), "aten::bmm": (torch.bmm, 2), "aten::addmm": (torch.addmm, 3),
           "aten::addmm_": (torch.addmm, 3), "aten::baddbmm": (torch.baddbmm, 3), "aten::baddbmm_": (torch.baddbmm, 3)}
PROFILER_DTYPES = {"float": torch.float32, "c10::BFloat16": torch.bfloat16, "c10::Half": torch.float16,
                   "double": torch.float64}
SHARED_OPERAND_BYTES = 32 << 20  # larger than a CPU's or GPU's last-level cache: read from memory either way


def recorded_matmuls(run) -> list[tuple]:
    """run()'s matmuls as the profiler records them: (function, operand shapes, operand dtypes as autocast ran
    them). A ValueError for one that plain tensors cannot replay (float8's scaled matmuls)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    calls = []
    for e in prof.events():
        if e.name == "aten::_scaled_mm":
            raise ValueError("float8 matmuls run inside torchao's tensors, which the replay cannot make")
        if e.name in MATMULS:
            function, n = MATMULS[e.name]
            calls.append((function, [tuple(s) for s in e.input_shapes[:n]],
                          [PROFILER_DTYPES[d] for d in e.input_dtypes[:n]]))
    return calls


def matmul_floor(model, batches, ctx, device: str, repeats: int = 3) -> tuple[float, int]:
    """The step's matmul floor (ms, matmuls): its forwards' and backwards' matmuls (uncompiled, no optimizer step)
    replayed alone. A step only approaches it: the rest (softmax, norms, casts, AdamW) is overhead; kernels that do
    their matmuls inside (SDPA flash) are not in it."""
    def step() -> None:
        for x, y in batches:
            with ctx:
                _, loss = model(x.to(device), y.to(device), return_logits=False)  # as train_step
            loss.backward()

    floor = replayed_matmuls(step, device, repeats)
    model.zero_grad(set_to_none=True)
    return floor


def replayed_matmuls(run, device: str, repeats: int = 3) -> tuple[float, int]:
    """run()'s matmuls replayed back to back on random operands: the best of `repeats` in ms, and their number. Each
    call gets operands of its own, so none finds another's in cache, except those over SHARED_OPERAND_BYTES: one per
    shape and dtype, or every loss chunk's (vocab x C) head weight would be held at once (gigabytes for GPT-2)."""
    shared: dict = {}

    def fresh(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if (shape, dtype) in shared:
            return shared[shape, dtype]
        t = torch.randn(shape, device=device).to(dtype)
        if t.nbytes > SHARED_OPERAND_BYTES:
            shared[shape, dtype] = t
        return t

    calls = [(function, [fresh(s, d) for s, d in zip(shapes, dtypes)]) for function, shapes, dtypes in
             recorded_matmuls(run)]

    def seconds(replays: int) -> float:  # per replay of the whole sequence
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(replays):
            for function, operands in calls:
                function(*operands)
        synchronize(device)
        return (time.perf_counter() - t0) / replays

    seconds(1)  # a warm-up
    # a short sequence (a batch-1 step's: ~100 us) is timed over back-to-back replays that make ~10 ms, or one
    # interrupt, a clock's ramp or the timer's own cost would weigh on it as much as its matmuls
    replays = max(1, math.ceil(0.01 / max(seconds(1), 1e-6)))
    return min(seconds(replays) for _ in range(repeats)) * 1000, len(calls)


def matmul_floor_or_why(raw_model, batches, ctx, device: str) -> tuple[float | None, int | None, str | None]:
    """matmul_floor, or Nones and why: float8's matmuls cannot be replayed, and CUDA graphs keep their pool for the
    process (reduce-overhead at 64 x 1024 held 68 of an H100's 80 GB), which must not lose the timed steps' figures."""
    try:
        return (*matmul_floor(raw_model, batches, ctx, device), None)
    except ValueError as e:
        raw_model.zero_grad(set_to_none=True)
        return None, None, str(e)
    except torch.OutOfMemoryError:
        raw_model.zero_grad(set_to_none=True)
        return None, None, "the GPU had no memory left for the eager step it replays (CUDA graphs keep theirs)"
