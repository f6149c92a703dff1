"""benchmarks/measure.py: what bench.py and the studies share."""
from __future__ import annotations

import pytest

from bench import BenchConfig
from benchmarks import measure


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
    assert (measure.load_note(load.fraction) != "") == (expected >= 0.1)


def test_a_study_takes_its_own_keys_and_passes_the_rest_to_bench():
    from benchmarks.ablation import AblationConfig

    own, rest = measure.study_config(AblationConfig(), ["config/bench_cpu.py", "--studies=attention", "--batch_size=2"],
                                     BenchConfig())
    assert own.studies == "attention" and rest == ["config/bench_cpu.py", "--batch_size=2"]
