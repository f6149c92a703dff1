"""benchmarks/__init__.py: what the studies share (their keys beside bench.py's)."""
from __future__ import annotations

import benchmarks
from bench import BenchConfig


def test_a_study_takes_its_own_keys_and_passes_the_rest_to_bench():
    from benchmarks.ablation import AblationConfig

    own, rest = benchmarks.study_config(AblationConfig(), ["config/bench_cpu.py", "--studies=attention", "--batch_size=2"],
                                     BenchConfig())
    assert own.studies == "attention" and rest == ["config/bench_cpu.py", "--batch_size=2"]
