"""nanogpt/measure.py: what bench.py measures with (the studies in benchmarks/ too)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import benchmarks
from nanogpt import measure


def test_allocator_is_read_from_the_mapped_libraries_or_ld_preload():
    maps = "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n"
    assert measure.detect_allocator(maps=maps, ld_preload="") == "jemalloc (/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)"
    assert measure.detect_allocator(maps="", ld_preload="/opt/libtcmalloc_minimal.so.4") == (
        "tcmalloc (/opt/libtcmalloc_minimal.so.4)")
    assert measure.detect_allocator(maps="7f00-7f10 r-xp 0 0 0 /usr/lib/libc.so.6\n", ld_preload="") in (
        "glibc malloc", "the system malloc")


@pytest.mark.parametrize("machine_busy_s, own_s, expected", [(2.0, 0.5, 0.375), (0.5, 0.5, 0.0), (1.0, 0.0, 0.25)])
def test_other_load_is_the_share_of_the_cpus_that_other_processes_took(monkeypatch, machine_busy_s, own_s, expected):
    """Injected /proc/stat and clock readings over one second on 4 CPUs (4 CPU-seconds): the machine was busy for
    machine_busy_s, this process for own_s, so the others took (machine_busy_s - own_s) / 4."""
    readings = iter([(100.0, 10.0, 50.0), (100.0 + machine_busy_s, 10.0 + own_s, 51.0)])
    monkeypatch.setattr(measure.OtherLoad, "_sample", lambda self: next(readings))
    monkeypatch.setattr(measure.os, "cpu_count", lambda: 4)
    with measure.OtherLoad() as load:
        pass
    assert load.fraction == pytest.approx(expected)
    assert (benchmarks.load_note(load.fraction) != "") == (expected >= 0.1)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (pip install "
                    "torchao): float8 layers cannot be made")
def test_the_matmul_floor_of_a_float8_model_is_named_missing_with_its_reason():
    """A float8 layer's matmuls are scaled matmuls on float8 data inside torchao's tensors, which a replay on plain
    tensors cannot make: the floor says so instead of timing something else."""
    import torch

    from nanogpt import float8
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=100))
    float8.convert_to_fp8(model, "tensorwise", "all")
    x = torch.randint(0, 100, (2, 16))
    ms, n, why = measure.matmul_floor_or_why(model, [(x, x)], torch.autocast("cpu", dtype=torch.bfloat16), "cpu")
    assert ms is None and n is None and "float8" in why


def test_a_short_sequence_of_matmuls_is_timed_over_many_replays(monkeypatch):
    """A batch-1 step's matmuls take ~100 us: one replay per timing would be as much the timer and the interrupts
    as the matmuls (the batch-1 floor moved by 2.6x between runs so). Each timing replays the sequence until ~10 ms
    have passed: a 2 us sequence, thousands of times; a 30 ms one, once."""
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    replays = []

    def replay_of(seconds: float):
        def mm(a, b):  # the recorded op, replayed: the clock moves by `seconds` per replay of the sequence
            clock[0] += seconds
            replays.append(seconds)
            return a @ b

        recorded = [(mm, [(2, 2), (2, 2)], [torch.float32, torch.float32])]  # as the profiler describes it
        monkeypatch.setattr(measure, "recorded_matmuls", lambda run: recorded)
        return measure.replayed_matmuls(lambda: None, "cpu", repeats=2)

    ms, n = replay_of(2e-6)
    assert n == 1 and ms == pytest.approx(2e-3)
    assert replays.count(2e-6) == 1 + 1 + 2 * 5000  # a warm-up, the probe, then 2 timings of 10 ms
    ms, n = replay_of(0.03)
    assert ms == pytest.approx(30) and replays.count(0.03) == 1 + 1 + 2


def test_busy_share_is_the_union_of_the_intervals_over_their_span():
    # kernels at 0-2, 1-3 (overlapping), 5-6, 6-10: busy 3 + 5 of the 10 from the first start to the last end
    assert measure.busy_share([(5, 6), (0, 2), (1, 3), (6, 10)]) == pytest.approx(0.8)
    assert measure.busy_share([(0, 4), (1, 2)]) == 1.0  # one kernel inside another counts once
    assert measure.busy_share([]) is None


def test_a_cpu_profile_has_no_device_activity_to_measure():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8).sum()
    assert measure.gpu_busy_share(prof) is None


def test_the_device_clock_on_the_cpu_reads_the_host_clock(monkeypatch):
    now = iter([1.0, 1.25])
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(now))
    clock = measure.DeviceClock("cpu")
    a, b = clock.mark(), clock.mark()
    assert clock.ms(a, b) == pytest.approx(250.0)
