"""nanogpt/device.py: the malloc setting, the dtype, attention and loss defaults, waiting for the run's GPU."""
from __future__ import annotations

import dataclasses
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from nanogpt import hardware
from nanogpt.device import dtype_reason, resolve_attention, resolve_dtype, resolve_fused_loss, synchronize
from nanogpt.errors import UserError
from helpers import run_script


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


@pytest.mark.slow
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
    from nanogpt.config import TrainConfig
    from nanogpt.fused_loss import fused_linear_cross_entropy
    from nanogpt.start import load_model

    assert resolve_fused_loss(None, "cpu") is True
    assert resolve_fused_loss(None, "cuda:1") is False  # compiled, the plain loss was 1.22x faster on an H100
    for explicit in (True, False):
        for device in ("cpu", "cuda", "mps"):
            assert resolve_fused_loss(explicit, device) is explicit
    assert TrainConfig().fused_loss is None
    for cfg, fused in ((TrainConfig(device="cpu"), True), (TrainConfig(device="cpu", fused_loss=False), False)):
        # every init_from's model comes through load_model, which hands it the loss the machine chose
        cfg = dataclasses.replace(cfg, n_layer=1, n_head=2, n_embd=16, block_size=8)
        model = load_model(cfg, cfg.machine(), {"vocab_size": 20}, None)
        assert model.head_loss is (fused_linear_cross_entropy if fused else None)
    from configurator import ConfigError, configure

    assert configure(TrainConfig(), ["--fused_loss=False"]).fused_loss is False
    assert configure(TrainConfig(fused_loss=True), ["--fused_loss=None"]).fused_loss is None
    with pytest.raises(ConfigError, match=r"fused_loss: expected bool \| None, got int 1"):
        configure(TrainConfig(), ["--fused_loss=1"])
