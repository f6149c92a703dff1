"""
GPT-2 weights from HF transformers: loading a GPT2LMHeadModel (a GPT-2 name or a local folder), its config as
GPTConfig's settings, and its weights copied into our layout. GPT.from_pretrained and GPT.from_hf_model (model.py)
are the API and call these; export.py goes the other way.

It must not import model.py (model.py imports it) nor any script; transformers is imported only to load a model.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from errors import UserError

GPT2_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# HF transformers' activation_function names of the two GELU forms (GPTConfig.gelu)
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}
# HF's GPT-2 uses Conv1D modules whose weights are stored (in, out), where nn.Linear's are (out, in)
CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def load_hf_gpt2(model_type: str):
    """HF's GPT2LMHeadModel of "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl" (from HF's cache, else downloaded), or of
    a local folder written by `save_pretrained`. Without the network it fails in seconds, naming HF_HUB_OFFLINE."""
    if model_type not in GPT2_MODELS and not os.path.isdir(model_type):
        raise UserError(f"unknown GPT-2 model {model_type!r}: use {', '.join(GPT2_MODELS)} or a local folder")
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    from transformers import GPT2LMHeadModel  # only needed here

    def first_line(e: Exception) -> str:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__

    folder = "a local folder written by save_pretrained"
    try:  # the folder, or the HF cache: no network
        return GPT2LMHeadModel.from_pretrained(model_type, local_files_only=True)
    except OSError as e:  # transformers' error for a folder without weights, or weights not in the cache
        if os.path.isdir(model_type):
            raise UserError(f"could not load GPT-2 weights {model_type!r} ({first_line(e)}): pass {folder}") from None
    cached = f"they are not in the HF cache {constants.HF_HUB_CACHE}"
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"could not load GPT-2 weights {model_type!r} ({cached}, and HF_HUB_OFFLINE is set): "
                       f"download them once online, or pass {folder}")
    # One request with a short timeout says whether the hub answers: unreachable, from_pretrained would retry
    # each file several times with backoff before failing.
    try:
        get_hf_file_metadata(hf_hub_url(model_type, "config.json"), timeout=5)
    except HfHubHTTPError:
        pass  # the hub answered (with an error status): from_pretrained says what
    except Exception as e:  # no answer; the transport's error classes (requests', httpx's) vary by version
        raise UserError(
            f"could not load GPT-2 weights {model_type!r} ({constants.ENDPOINT} is unreachable ({type(e).__name__}: "
            f"{first_line(e)}) and {cached}): connect once to download them, or pass {folder}; offline, set "
            f"HF_HUB_OFFLINE=1 so that nothing waits on the network"
        ) from None
    try:
        return GPT2LMHeadModel.from_pretrained(model_type)
    except OSError as e:  # transformers' error for no network, or no such files
        raise UserError(f"could not load GPT-2 weights {model_type!r} ({first_line(e)}): check your internet "
                       f"connection or pass {folder}") from None


def hf_config_args(hf_config) -> dict:
    """GPTConfig's architecture arguments for an HF GPT2Config; options our model does not implement are refused."""
    activation = getattr(hf_config, "activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise UserError(f"unsupported GPT-2 activation {activation!r}: this model supports {', '.join(HF_ACTIVATIONS)}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(hf_config, flag, False):
            raise UserError(f"unsupported GPT-2 option {flag}=True")
    return dict(
        block_size=hf_config.n_positions,
        vocab_size=hf_config.vocab_size,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        bias=True,
        gelu=HF_ACTIVATIONS[activation],
    )


def copy_hf_weights(model: nn.Module, hf_model) -> None:
    """Copy hf_model's weights into `model`, our GPT built from hf_config_args: the same keys (a missing or extra
    one is named), Conv1D weights transposed, every shape checked; of our padded embedding the real rows are
    copied and the padding rows zeroed."""
    vocab_size = model.config.vocab_size
    sd = model.state_dict()
    sd_hf = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    ours = set(sd) - {"lm_head.weight"}  # tied to transformer.wte.weight
    theirs = set(sd_hf) - {"lm_head.weight"}
    if ours != theirs:
        raise UserError(
            f"GPT-2 checkpoint keys differ: missing {sorted(ours - theirs)[:5]}, unexpected {sorted(theirs - ours)[:5]}"
        )
    with torch.no_grad():
        for k in sorted(theirs):
            src = sd_hf[k].t() if k.endswith(CONV1D_WEIGHTS) else sd_hf[k]  # (in, out) -> (out, in)
            dst = sd[k]
            if k == "transformer.wte.weight":  # our table may have extra (padding) rows: copy the real ones
                dst = dst[:vocab_size]
                sd[k][vocab_size:].zero_()
            if src.shape != dst.shape:
                raise UserError(f"GPT-2 checkpoint key {k} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(src)
