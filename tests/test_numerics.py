"""benchmarks/numerics.py: each attention path's error against a float64 math-attention reference."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import bench
from benchmarks import numerics
from test_bench import TINY, bench_script, table_rows


@pytest.mark.slow
def test_numerics_errors_are_small_and_bf16_is_less_exact_than_float32(tmp_path):
    out = bench_script(f"--results_dir={tmp_path}", script="benchmarks/numerics.py")
    rows = table_rows(out, tuple(numerics.PATHS))
    assert [(r[0], r[1]) for r in rows] == [
        (p, d) for p in ("math", "math, plain loss", "sdpa/auto", "sdpa/math", "sdpa/flash") for d in ("float32", "bfloat16 autocast")
    ]
    saved = json.loads((tmp_path / "numerics.json").read_text())["rows"]
    for cells, r in zip(rows, saved):
        assert [float(c) for c in cells[2:5]] == pytest.approx(
            [r["attention_error"], r["token_loss_error"], r["loss_error"]], rel=1e-2)
    for f32, bf16 in zip(saved[::2], saved[1::2]):
        for key in ("attention_error", "token_loss_error"):  # the mean loss may cancel by chance: not compared
            assert 0 < f32[key] < 1e-5, f32
            assert 0 < bf16[key] < 5e-2, bf16
            assert bf16[key] > 10 * f32[key], (f32, bf16)
        assert 0 < f32["loss_error"] < 1e-5 and bf16["loss_error"] < 1e-2


def test_the_float64_reference_uses_math_attention_whatever_the_config(monkeypatch):
    """With attention=sdpa configured, no float64 tensor may reach F.scaled_dot_product_attention: the reference
    is the formula itself, not a kernel under test."""
    real_sdpa = F.scaled_dot_product_attention

    def sdpa_refusing_float64(q, *args, **kwargs):
        assert q.dtype != torch.float64, "the float64 reference ran SDPA"
        return real_sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa_refusing_float64)
    cfg, _ = bench.load_config([*TINY, "--attention=sdpa", "--block_size=16", "--batch_size=1"])
    rows = numerics.numerics_study(cfg, "cpu")
    assert len(rows) == 10 and all("reason" not in r for r in rows)
