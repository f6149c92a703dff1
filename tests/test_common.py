"""common.py: the malloc setting, the dtype, attention and loss defaults, the CPU's peak FLOP/s for MFU, and
optional packages (the one-line error wrapper is errors.py's: tests/test_errors.py)."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from nanogpt import hardware, mfu, optional, text
from nanogpt.device import dtype_reason, resolve_attention, resolve_dtype, resolve_fused_loss, synchronize
from nanogpt.errors import UserError
from helpers import run_script

# Allocate 24 MiB in 256 KiB blocks (each above glibc's default mmap threshold), touch them, free them, and print
# how much resident memory the free gave back to the OS.
FREE_PROBE = """
import ctypes, sys
sys.path.insert(0, ".")
from nanogpt.device import keep_freed_memory
applied = keep_freed_memory(sys.argv[1] == "on", sys.argv[2])
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def rss_kb():
    return int(open("/proc/self/statm").read().split()[1]) * 4
blocks = [libc.malloc(256 << 10) for _ in range(96)]
for b in blocks:
    ctypes.memset(b, 1, 256 << 10)
before = rss_kb()
for b in blocks:
    libc.free(ctypes.c_void_p(b))
print(applied, before - rss_kb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning is Linux-only")
def test_keep_freed_memory_stops_glibc_returning_buffers_to_the_os():
    """On for a run on any CPU device name; a GPU run leaves malloc as it is (its activations are not malloc's)."""
    results = {}
    for mode, device in (("off", "cpu"), ("on", "cpu:0"), ("on", "cuda:0")):
        r = run_script(["-c", FREE_PROBE, mode, device])
        assert r.returncode == 0, r.stderr
        applied, released_kb = r.stdout.split()
        results[mode, device] = (applied == "True", int(released_kb))
    assert [applied for applied, _ in results.values()] == [False, True, False]
    assert results["off", "cpu"][1] > 20_000 and results["on", "cuda:0"][1] > 20_000  # plain glibc: the 24 MiB
    # went back to the OS at free()
    assert results["on", "cpu:0"][1] < 1_000  # kept for the next step's allocations


def test_auto_dtype_is_bf16_for_cpu_training_on_bf16_hardware_and_float32_for_cpu_generation(monkeypatch):
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_dtype("auto", "cpu") == want
        assert dtype_reason("auto", "cpu").startswith("auto: this CPU has " + ("bf16" if native else "no bf16"))
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16" and dtype_reason("bfloat16", "cpu") == "set explicitly"
    monkeypatch.undo()
    # this machine's own answer comes from the CPU's feature flags (/proc/cpuinfo), not from PyTorch's build
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else None
    if flags is not None:
        assert hardware.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_tile" in flags)
    assert resolve_dtype("auto", "cpu", training=False) == "float32"
    assert resolve_dtype("float32", "cpu", training=False) == "float32"
    with pytest.raises(UserError, match="dtype='float16' is not supported on the CPU: use bfloat16 or float32"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(UserError, match="dtype='fp8' is not one of auto, float32, bfloat16, float16"):
        resolve_dtype("fp8", "cpu")


def test_synchronize_waits_for_the_runs_gpu(monkeypatch):
    # with --device=cuda:1 the timings must wait for GPU 1, not the current device (GPU 0)
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    synchronize("cuda:1")
    synchronize("cpu")
    assert waited == ["cuda:1"]


def test_bf16_check_asks_the_runs_gpu(monkeypatch):
    # GPU 0 an A100 (bf16), GPU 1 a V100 (no bf16): cuda:1 gets float16 and refuses bfloat16
    majors = {0: 8, 1: 7}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(major=majors[torch.device(device).index or 0]))
    assert resolve_dtype("auto", "cuda:0") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "float16"
    with pytest.raises(UserError, match="does not support bfloat16"):
        resolve_dtype("bfloat16", "cuda:1")


def test_auto_attention_is_math_on_a_cpu_under_bf16_and_sdpa_elsewhere_explicit_wins():
    assert resolve_attention("auto", "cpu", "bfloat16")[0] == "math"
    assert resolve_attention("auto", "cpu", "float32")[0] == "sdpa"
    assert resolve_attention("auto", "cuda:0", "bfloat16")[0] == "sdpa"
    for explicit in ("math", "sdpa"):
        for device, dtype in (("cpu", "bfloat16"), ("cpu", "float32"), ("cuda", "float16")):
            assert resolve_attention(explicit, device, dtype) == (explicit, "set explicitly")


def test_fused_loss_defaults_to_fused_on_the_cpu_and_plain_on_a_gpu_explicit_wins():
    from train import TrainConfig
    from nanogpt.step import model_settings

    assert resolve_fused_loss(None, "cpu") is True
    assert resolve_fused_loss(None, "cuda:1") is False  # compiled, the plain loss was 1.22x faster on an H100
    for explicit in (True, False):
        for device in ("cpu", "cuda", "mps"):
            assert resolve_fused_loss(explicit, device) is explicit
    assert TrainConfig().fused_loss is None
    assert model_settings(TrainConfig(device="cpu"))["fused_loss"] is True
    assert model_settings(TrainConfig(device="cpu", fused_loss=False))["fused_loss"] is False
    from configurator import ConfigError, configure

    assert configure(TrainConfig(), ["--fused_loss=False"]).fused_loss is False
    assert configure(TrainConfig(fused_loss=True), ["--fused_loss=None"]).fused_loss is None
    with pytest.raises(ConfigError, match=r"fused_loss: expected bool \| None, got int 1"):
        configure(TrainConfig(), ["--fused_loss=1"])


def test_cpu_peak_keeps_the_best_measured_and_a_busy_measurement_never_lowers_it(tmp_path, monkeypatch):
    cache = tmp_path / "peak.json"
    key = f"{hardware.cpu_name()} | {torch.get_num_threads()} threads | "
    # a figure no CPU reaches stays (a measurement on a busy machine never lowers it); 123 FLOP/s, one no CPU
    # falls to, is replaced by the measured one, which the file then keeps
    cache.write_text(json.dumps({key + "float32": 1e18, key + "bfloat16": 123.0}))
    assert mfu.measured_cpu_peak_flops("float32", str(cache), n=64, repeats=1) == 1e18
    bf16 = mfu.measured_cpu_peak_flops("bfloat16", str(cache), n=64, repeats=1)
    assert bf16 > 1e6 and json.loads(cache.read_text()) == {key + "float32": 1e18, key + "bfloat16": bf16}
    monkeypatch.setattr(mfu, "PEAK_CACHE", str(cache))
    assert mfu.run_peak_flops("cpu", "float32") == (1e18, f"measured float32 matmul peak of this CPU ({cache})")
    assert mfu.run_peak_flops("cpu", "float32", given=5e12) == (5e12, "--peak_flops")
    assert mfu.run_peak_flops("mps", "float32") == (None, "unknown: give --peak_flops")
    # a CPU that emulates bf16 has no peak to divide by: none is measured (it took seconds), MFU says n/a
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(mfu, "measured_cpu_peak_flops", lambda dtype: pytest.fail("measured an emulated peak"))
    assert mfu.run_peak_flops("cpu", "bfloat16") == (
        None, "this CPU emulates bfloat16 (no AVX-512-BF16/AMX): give --peak_flops")
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(mfu, "measured_cpu_peak_flops", lambda dtype: 7e11)
    assert mfu.run_peak_flops("cpu", "bfloat16")[0] == 7e11


def test_measuring_the_cpu_peak_leaves_torchs_global_rng_alone(tmp_path):
    """A run measures the peak after seeding: a draw from the global RNG would change its initial weights (a
    torchrun worker measures, an in-process run may read the process's figure: DDP vs one process differed)."""
    mfu._matmul_flops.cache_clear()
    state = torch.get_rng_state()
    assert mfu.measured_cpu_peak_flops("float32", str(tmp_path / "peak.json"), n=32, repeats=1) > 0
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("budget, sizes", [(0.0, [256]), (1e9, [256, 512, 1024])])
def test_the_cpu_peak_matmul_shrinks_to_its_time_budget(monkeypatch, budget, sizes):
    """A CPU that emulates bf16 took 2.5 s per 1024^3 matmul: the measurement stops doubling the size once the next
    one would take longer than MATMUL_BUDGET_S (here none may: it stays at 256), else goes up to n."""
    drawn = []
    real_randn = torch.randn

    def randn(*shape, **kwargs):
        drawn.append(shape[0])
        return real_randn(*shape, **kwargs)

    monkeypatch.setattr(mfu, "MATMUL_BUDGET_S", budget)
    monkeypatch.setattr(torch, "randn", randn)
    assert mfu._matmul_flops.__wrapped__("float32", torch.get_num_threads(), 1024, 1) > 0
    assert drawn == [s for s in sizes for _ in range(2)]  # two operands of each size tried


def test_plural_says_one_thing_and_several_things():
    assert [text.plural(n, "sample") for n in (0, 1, 2, 12000)] == [
        "0 samples", "1 sample", "2 samples", "12,000 samples"]
    assert text.plural(1, "micro-step") == "1 micro-step" and text.plural(3, "timed step") == "3 timed steps"


def test_an_optional_package_missing_or_broken_is_a_user_error_naming_pip(tmp_path, monkeypatch):
    (tmp_path / "broken_extra").mkdir()  # installed, but one of its own imports is missing
    (tmp_path / "broken_extra" / "__init__.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError) as missing:
        optional.optional_import("no_such_package_xyz", "--feature=True")
    assert str(missing.value) == ("--feature=True needs no_such_package_xyz, which is not installed: "
                                  "pip install no_such_package_xyz")
    with pytest.raises(UserError) as broken:
        optional.optional_import("broken_extra", "--feature=True")
    assert str(broken.value) == ("--feature=True needs broken_extra, which fails to import (No module named "
                                 "'no_such_dependency_xyz'): pip install broken_extra")
    assert optional.optional_import("json", "--feature=True") is json


def test_a_busy_start_cannot_collapse_the_cpu_peak(tmp_path, monkeypatch):
    """Bug: other processes on the cores during the start made the threads' matmul measure 0.001 TFLOP/s, and the run
    printed MFU 4,600-16,000%. One thread's best short matmul still finds a quiet slice; the peak is at least that
    times the threads, so a collapsed all-threads figure no longer decides it."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    busy = {1: 80e9, 2: 1e9}  # the 2-thread matmul waits for the busy core; one thread measures its real speed
    monkeypatch.setattr(mfu, "_matmul_flops", lambda dtype, threads, n, repeats: busy[threads])
    assert mfu.measured_cpu_peak_flops("float32", str(tmp_path / "peak.json")) >= 160e9


def test_an_mfu_above_100_percent_is_never_printed(tmp_path, capsys):
    """A peak too low for the machine (here --peak_flops=1) gives MFU n/a with the reason, in the log and the report."""
    from helpers import make_char_dataset, tiny_config
    from train import train

    make_char_dataset(tmp_path / "data")
    train(tiny_config(tmp_path / "data", tmp_path / "out", max_iters=4, eval_interval=4, log_interval=1, peak_flops=1.0,
                      report=True))
    printed = capsys.readouterr().out
    assert "mfu n/a (above 100%: the peak FLOP/s it divides by is too low for this machine; give --peak_flops)" in printed
    assert "%, grad norm" not in printed
    assert "MFU n/a (above 100%" in (tmp_path / "out" / "report.md").read_text()
