"""benchmarks/gpu.py on the CPU: its arguments, the MFU peak of every known device name, the refusal without a GPU,
the row bookkeeping (cumulative overrides, speed-ups, time budget) and the report it writes, on fake rows."""
from __future__ import annotations

import json
import os
import sys

import pytest

from nanogpt.errors import UserError
from helpers import ROOT, run_script
from test_hardware import DEVICE_PEAKS

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu  # noqa: E402


def test_arguments_are_checked_and_all_problems_named() -> None:
    args = gpu.parse_args([])
    assert args.parts == [p for p in gpu.PARTS if p != "nanogpt"] and args.results_dir == "gpu_results"
    assert args.peak_flops is None
    assert gpu.parse_args(["--parts=baby,headline"]).parts == ["headline", "baby"]  # always in the run's order
    with pytest.raises(UserError) as e:
        gpu.parse_args(["--parts=headline,speed", "--peak_flops=-1", "--budget_minutes=0"])
    message = str(e.value)
    assert "unknown part 'speed'" in message and "--peak_flops=-1.0 must be positive" in message
    assert "--budget_minutes=0.0 must be positive" in message


@pytest.mark.parametrize("name", DEVICE_PEAKS)
def test_peak_of_every_device_name(name: str) -> None:
    peak, source = gpu.device_peak(name, None)
    assert peak == DEVICE_PEAKS[name]
    if peak is None:
        assert f"unknown device {name!r}" in source and "--peak_flops" in source
    assert gpu.device_peak(name, 123e12) == (123e12, "--peak_flops=1.23e+14")  # the user's figure wins


@pytest.mark.slow
def test_without_a_gpu_it_refuses_in_one_line() -> None:
    r = run_script(["benchmarks/gpu.py", "--parts=headline"], timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "error: benchmarks/gpu.py measures a CUDA GPU and none is available here (torch.cuda.is_available() is "
        "False): run it on a machine with an NVIDIA GPU and a CUDA build of torch"
    ]


def _fake_bench(ms: dict):
    """A stand-in for run_bench: the row's ms/iter by its attention/backend, n/a for cudnn; records the args."""
    calls = []

    def run(args, tmp, timeout_s):
        calls.append(args)
        settings = dict(a[2:].split("=", 1) for a in args if "=" in a)
        key = settings.get("sdpa_backend", "'-'").strip("'") if settings["attention"] == "'sdpa'" else "math"
        if key == "cudnn":
            return {"status": "n/a", "reason": "sdpa_backend='cudnn' cannot run on cuda ...", "command": "x"}
        return {"status": "ok", "ms_median": ms[key], "tokens_per_s": 12288 / ms[key] * 1000, "wall_s": 1.0,
                "mfu": 0.4, "peak_memory_mib": 1000.0, "command": "x"}

    return run, calls


def test_rows_accumulate_compute_speedups_and_respect_the_budget(tmp_path, monkeypatch) -> None:
    run, calls = _fake_bench({"math": 143.0, "auto": 120.0, "efficient": 119.0, "flash": 100.0})
    monkeypatch.setattr(gpu, "run_bench", run)
    report = gpu.Report(str(tmp_path))
    rows = gpu.run_rows(gpu.CUMULATIVE, ["--device=cuda"], [], gpu.Budget(10), str(tmp_path), "cumulative", report,
                        cumulative=True)
    # the last row carries every change above it, on its command line too
    assert {"--dtype='bfloat16'", "--tf32=True", "--compile=True", "--sdpa_backend='flash'",
            "--vocab_padding_multiple=64"} <= set(calls[-1])
    last = rows[-1]["overrides"]
    assert last == {"dtype": "bfloat16", "tf32": True, "compile": True, "attention": "sdpa", "sdpa_backend": "flash",
                    "vocab_padding_multiple": 64}
    assert [r["speedup"] for r in rows][:4] == [1.0, 1.0, 1.0, 1.0]  # math rows all 143 ms in the fake
    assert rows[4]["speedup"] == pytest.approx(1.43)
    # a spent budget: no row runs, each says why
    calls.clear()
    budget = gpu.Budget(1)
    budget.deadline = 0
    rows = gpu.run_rows(gpu.ATTENTION, [], [], budget, str(tmp_path), "attention", report)
    assert calls == [] and {r["status"] for r in rows} == {"skipped"}
    assert all(r["speedup"] is None for r in rows)


def test_report_writes_json_and_markdown_tables(tmp_path, monkeypatch) -> None:
    run, _ = _fake_bench({"math": 143.0, "auto": 120.0, "efficient": 119.0, "flash": 100.0})
    monkeypatch.setattr(gpu, "run_bench", run)
    report = gpu.Report(str(tmp_path / "results"))
    report.machine = {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "cuda": "12.8",
                      "peak_source": "989 TFLOP/s dense bf16"}
    report.parts["headline"] = run(["--attention='sdpa'", "--sdpa_backend='flash'"], None, 0)
    gpu.run_rows([r for r in gpu.ATTENTION if r[0] != "sdpa-math"], [], [], gpu.Budget(10), "", "attention", report)
    report.parts["largest"] = {"rows": [{"path": "math", "reference": 24, "status": "ok", "max_batch": 31,
                                         "budget": "79.1 GiB (all)"},
                                        {"path": "sdpa", "reference": 39, "status": "failed", "reason": "exit 1: boom"}]}
    report.parts["baby"] = {"status": "ok", "seconds": 151.2, "iter": 2750, "val_loss": 1.4689, "note": ""}
    report.write()
    data = json.load(open(tmp_path / "results" / "gpu.json"))
    assert data["machine"]["device_name"] == "NVIDIA H100 80GB HBM3" and len(data["attention"]["rows"]) == 6
    md = open(tmp_path / "results" / "gpu.md").read()
    assert "| 100.0 | 122,880 | 40.0% | 1000 |  |" in md  # the headline
    assert "| math attention (nanoGPT's) | 143.0 | 1.00x | 143 |  |" in md
    assert "| SDPA flash kernel | 100.0 | 1.43x | 113 |  |" in md
    assert "| SDPA cuDNN kernel | - | - | - | n/a: sdpa_backend='cudnn' cannot run on cuda ... |" in md
    assert "| math | 31 | 24 | 79.1 GiB (all) |" in md and "| sdpa | - | 39 | failed: exit 1: boom |" in md
    assert "| 151 | 2750 | 1.4689 | ~180 s |  |" in md


def test_the_recipe_rows_change_one_key_each_and_report_floor_loss_and_speedup(tmp_path, monkeypatch) -> None:
    calls = []

    def run(args, tmp, timeout_s):
        calls.append(args)
        fp8 = "--fp8=True" in args
        return {"status": "ok", "ms_median": 100.0 if fp8 else 140.0, "tokens_per_s": 65536 / (0.1 if fp8 else 0.14),
                "wall_s": 1.0, "mfu": 0.4, "peak_memory_mib": 30000.0, "floor_multiple": 1.5, "loss": 7.0,
                "command": "x"}

    monkeypatch.setattr(gpu, "run_bench", run)
    report = gpu.Report(str(tmp_path / "results"))
    report.machine = {"device_name": "NVIDIA H100 80GB HBM3"}
    gpu.run_rows(gpu.RECIPE, gpu.RECIPE_BENCH, [], gpu.Budget(10), "", "recipe", report)
    assert [sorted(set(a) - set(gpu.RECIPE_BENCH)) for a in calls] == [
        [], ["--compile_mode='max-autotune-no-cudagraphs'"], ["--compile_mode='max-autotune'"],
        ["--fp8=True", "--fp8_recipe='tensorwise'"], ["--fp8=True", "--fp8_layers='all'", "--fp8_recipe='tensorwise'"],
        ["--fp8=True", "--fp8_layers='all'", "--fp8_recipe='rowwise'"]]
    assert "--batch_size=64" in calls[0]
    md = gpu.markdown(report.machine, report.parts)
    assert "| fp8=True, tensorwise (fp8_layers=auto) | 100.0 | 655,360 | 40.0% | 1.50x | 30000 | 7.0000 | 1.40x |  |" in md


FAKE_NANOGPT_BENCH = """
import sys
open("argv.txt", "a").write(" ".join(sys.argv[1:]) + "\\n")
if "--batch_size=64" in sys.argv:
    raise SystemExit("CUDA out of memory")
print("Compiling model...")
print("19/20 loss: 10.9")
print("time per iteration: 29.5000ms, MFU: 40.00%")
"""


def _fake_nanogpt(tmp_path):
    path = tmp_path / "nanoGPT"
    path.mkdir()
    (path / "bench.py").write_text(FAKE_NANOGPT_BENCH)
    (path / "model.py").write_text("")
    (path / "configurator.py").write_text("")
    return path


def test_nanogpts_bench_runs_in_its_checkout_and_its_time_is_read(tmp_path) -> None:
    path = _fake_nanogpt(tmp_path)
    r = gpu.nanogpt_bench(str(path), 12, False, timeout_s=60)
    assert r["status"] == "ok" and r["ms_mean"] == 29.5 and r["tokens_per_s"] == pytest.approx(12 * 1024 / 0.0295)
    failed = gpu.nanogpt_bench(str(path), 64, True, timeout_s=60)
    assert failed["status"] == "failed" and "CUDA out of memory" in failed["reason"]
    assert (path / "argv.txt").read_text().splitlines() == [
        f"--real_data=False --batch_size={b} --block_size=1024 --bias={bias} --dtype=bfloat16 --compile=True"
        for b, bias in ((12, False), (64, True))]


def test_nanogpt_alone_is_the_default_part_with_a_checkout_and_a_folder_without_one_is_refused(tmp_path) -> None:
    path = _fake_nanogpt(tmp_path)
    assert gpu.parse_args([f"--nanogpt={path}"]).parts == ["nanogpt"]
    assert gpu.parse_args([f"--nanogpt={path}", "--parts=nanogpt,headline"]).parts == ["nanogpt", "headline"]
    with pytest.raises(UserError, match="has no bench.py, model.py, configurator.py: give the folder of a checkout"):
        gpu.parse_args([f"--nanogpt={tmp_path}"])
    with pytest.raises(UserError, match="the nanogpt part needs --nanogpt=PATH"):
        gpu.parse_args(["--parts=nanogpt"])


def test_side_by_side_alternates_the_two_and_reports_the_ratio_of_the_medians(tmp_path, monkeypatch) -> None:
    order = []
    times = {("nanoGPT", 12): [29.0, 30.0], ("ours", 12): [25.0, 26.0], ("nanoGPT", 64): [138.0, 140.0],
             ("ours", 64): [130.0, 128.0]}

    def fake(who, batch):
        order.append((who, batch))
        ms = times[who, batch].pop(0)
        return {"status": "ok", "ms_mean": ms, "tokens_per_s": batch * 1024 / ms * 1000, "command": who}

    monkeypatch.setattr(gpu, "nanogpt_bench", lambda path, batch, bias, timeout_s: fake("nanoGPT", batch))
    ours_args = []
    monkeypatch.setattr(gpu, "run_bench", lambda args, tmp, timeout_s: (ours_args.append(args), fake(
        "ours", int(next(a for a in args if a.startswith("--batch_size="))[13:])))[1])
    args = gpu.parse_args([f"--nanogpt={_fake_nanogpt(tmp_path)}", "--ours=--compile_mode='reduce-overhead'"])
    report = gpu.Report(str(tmp_path / "results"))
    part = gpu.side_by_side(args, ["--device=cuda"], gpu.Budget(10), str(tmp_path), report)
    assert order == [("nanoGPT", 12), ("ours", 12), ("nanoGPT", 64), ("ours", 64),
                     ("ours", 12), ("nanoGPT", 12), ("ours", 64), ("nanoGPT", 64)]
    assert {"--bias=True", "--batch_size=64", "--compile_mode=reduce-overhead", "--timed_steps=20"} <= set(ours_args[1])
    s12, s64 = part["summary"]
    assert s12["ratio"] == pytest.approx(29.5 / 25.5) and s64["ratio"] == pytest.approx(139.0 / 129.0)
    assert s64["tokens_per_s"]["ours"] == pytest.approx(65536 / 0.129)
    md = gpu.markdown({"device_name": "H100"}, report.parts)
    assert "with --compile_mode=reduce-overhead" in md
    assert "| 12 x 1024 | 29.0, 30.0 | 25.0, 26.0 | 416,542 | 481,882 | 1.157x |" in md
