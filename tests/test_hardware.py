"""Tests for hardware.py: GPU peak FLOP/s by device name (MFU), and forced SDPA kernels' refusals as one-line errors."""
from __future__ import annotations

import pytest
import torch

from nanogpt import hardware
from nanogpt.errors import UserError
from nanogpt.hardware import check_attention_kernel, sdpa_kernel_compiles
from nanogpt.mfu import device_peak_flops, gpu_peak_flops
from model_helpers import make_model


# The names torch.cuda.get_device_name reports, and each one's dense bf16 (V100/T4: fp16) peak from NVIDIA's
# datasheets (the sparse figures halved). The NVL and PCIe parts are slower than the SXM ones of the same name.
DEVICE_PEAKS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA H800": 989e12,
    "NVIDIA H800 PCIe": 756e12,
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA B200": 2.25e15,
    "NVIDIA GB200": 2.5e15,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A800 80GB PCIe": 312e12,
    "NVIDIA A10G": 70e12,
    "NVIDIA A10": 125e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA L40": 181e12,
    "NVIDIA L4": 121e12,
    "NVIDIA RTX A6000": 155e12,
    "NVIDIA GeForce RTX 4090": 165e12,
    "NVIDIA GeForce RTX 3090": 71e12,
    "Tesla V100-SXM2-16GB": 125e12,
    "Tesla T4": 65e12,
    # not in the table: no figure rather than a neighbour's
    "NVIDIA RTX A1000": None,
    "NVIDIA RTX A4000": None,
    "Some Unknown Accelerator": None,
}


@pytest.mark.parametrize("name", DEVICE_PEAKS)
def test_gpu_peak_flops_matches_the_most_specific_name(name: str) -> None:
    assert gpu_peak_flops(name) == DEVICE_PEAKS[name]


def test_mfu_of_a_cpu_run_never_takes_a_visible_gpus_peak(monkeypatch) -> None:
    # a GPU is visible, but the model runs on the CPU: its MFU has no peak (the old code took the A100's)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert device_peak_flops("cpu") is None
    assert device_peak_flops("cuda:0") == 312e12


def test_peak_flops_asks_for_the_runs_gpu(monkeypatch) -> None:
    names = {0: "NVIDIA A100-SXM4-80GB", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_name",
        lambda device=None: names[0 if device is None else torch.device(device).index or 0],
    )
    assert device_peak_flops("cuda:1") == 989e12


def test_a_cuda_kernel_refusal_becomes_a_clear_error(monkeypatch):
    """On CUDA, PyTorch words a refused kernel "No available kernel"; the check that runs before the first forward
    (train.py, bench.py, sample.py) turns it into a UserError (simulated here: the CPU cannot run the CUDA kernels)."""
    import torch.nn.functional as F

    from nanogpt.errors import UserError
    from model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=16, sdpa_backend="flash"))

    def refuse(*args, **kwargs):
        raise RuntimeError("No available kernel. Aborting execution.")

    monkeypatch.setattr(F, "scaled_dot_product_attention", refuse)
    with pytest.raises(UserError, match=r"sdpa_backend='flash' cannot run on cpu with dtype torch.float32"):
        check_attention_kernel(model)


def test_a_cuda_refusal_names_the_chosen_kernels_reasons_only():
    """The warnings an H100 gave (torch 2.11) when flash refused float32 with a mask: the refusal keeps the two
    reasons and drops the per-kernel headers, the kernels sdpa_kernel turned off and the source locations (the
    first version of the message began with "Memory efficient kernel not used because: (Triggered internally")."""
    from nanogpt.hardware import sdpa_refusal_reasons

    at = " (Triggered internally at /pytorch/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:986.)"
    warned = [
        "Memory efficient kernel not used because:" + at,
        "Memory Efficient attention has been runtime disabled." + at,
        "Flash attention kernel not used because:" + at,
        "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, Key dtype: "
        "float, and Value dtype: float instead." + at,
        "Flash Attention does not support non-null attn_mask." + at,
        "cuDNN attention kernel not used because:" + at,
        "cuDNN attention has been runtime disabled." + at,
    ]
    assert sdpa_refusal_reasons(warned) == (
        "Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float, Key dtype: "
        "float, and Value dtype: float instead.; Flash Attention does not support non-null attn_mask."
    )
    assert sdpa_refusal_reasons(["Flash attention kernel not used because:" + at]) == (
        "Flash attention kernel not used because:")  # nothing more specific: what there is
    assert sdpa_refusal_reasons([]) == "no reason given by PyTorch"


def test_a_refused_forced_kernel_is_the_one_line_error_even_compiled(tmp_path) -> None:
    # flash refuses dropout on the CPU: eager and compiled runs both stop with the UserError before any step (the
    # compiled one raised torch._dynamo's TorchRuntimeError from inside the compiler)
    from helpers import make_char_dataset, tiny_config as train_config
    from train import train

    make_char_dataset(tmp_path / "data", n_chars=5_000)
    for compile in (False, True):
        cfg = train_config(tmp_path / "data", tmp_path / f"out{compile}", compile=compile, attention="sdpa",
                          sdpa_backend="flash", dropout=0.1, max_iters=2)
        with pytest.raises(UserError, match="sdpa_backend='flash' cannot run on cpu .*dropout"):
            train(cfg)
    model = make_model(attention="sdpa", sdpa_backend="flash", dropout=0.1)
    check_attention_kernel(model.eval(), compile=True)  # without dropout (eval) flash runs: nothing raised


@pytest.mark.slow
def test_forced_kernel_compiles_into_one_graph_or_is_refused(monkeypatch) -> None:
    # a forced kernel's sdpa_kernel context must not break the compiled graph (torch before 2.5 broke it at
    # every layer's attention and ran attention eagerly)
    model = make_model(attention="sdpa", sdpa_backend="flash", n_layer=2)
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    explanation = torch._dynamo.explain(model)(idx, idx)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert sdpa_kernel_compiles()
    monkeypatch.setattr(hardware, "sdpa_kernel_compiles", lambda: False)  # a torch whose dynamo cannot
    with pytest.raises(UserError, match="needs torch 2.5 or later"):
        check_attention_kernel(model, compile=True)
    check_attention_kernel(model, compile=False)  # eager: fine on any torch
