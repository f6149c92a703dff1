"""
GPT-2's weights from HF transformers, as the project loads them: a GPT2LMHeadModel (a GPT-2 name or a local folder)
from HF's cache first, failing in seconds without the network, then converted by GPT.from_hf_model (model.py), with
every failure one line. export.py goes the other way.
"""
from __future__ import annotations

import os

from model import GPT
from nanogpt.errors import UserError

GPT2_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


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
    if os.path.isdir(model_type) and not os.path.isfile(os.path.join(model_type, "config.json")):
        # transformers would build GPT-2 small's config and fail on the weights' sizes (RuntimeError)
        raise UserError(f"could not load GPT-2 weights {model_type!r}: it has no config.json: pass {folder} (export.py "
                        f"writes one)")
    try:  # the folder, or the HF cache: no network
        return GPT2LMHeadModel.from_pretrained(model_type, local_files_only=True)
    except Exception as e:  # noqa: BLE001 OSError: no weights there or in the cache; a folder's damaged files raise
        if os.path.isdir(model_type) and isinstance(e, OSError):  # no weights there
            raise UserError(f"could not load GPT-2 weights {model_type!r} ({first_line(e)}): pass {folder}") from None
        if os.path.isdir(model_type):  # the readers' own errors (safetensors' SafetensorError, a RuntimeError)
            raise UserError(f"could not load GPT-2 weights {model_type!r} ({type(e).__name__}: {first_line(e)[:160]}): "
                            f"its files are damaged or not GPT-2's: pass {folder}") from None
        if not isinstance(e, OSError):
            raise
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


OVERRIDABLE = ("dropout", "attention", "sdpa_backend")  # settings that do not touch GPT-2's weights


def pretrained_gpt2(model_type: str, overrides: dict | None = None, vocab_padding_multiple: int = 64) -> GPT:
    """Our GPT with GPT-2's weights (load_hf_gpt2, then GPT.from_hf_model: every key and shape checked), `overrides`
    (OVERRIDABLE only) applied; what does not fit is a UserError."""
    overrides = dict(overrides or {})
    if set(overrides) - set(OVERRIDABLE):
        raise UserError(f"cannot override {sorted(set(overrides) - set(OVERRIDABLE))} of GPT-2; only {sorted(OVERRIDABLE)}")
    hf_model = load_hf_gpt2(model_type)
    try:
        return GPT.from_hf_model(hf_model, vocab_padding_multiple=vocab_padding_multiple, **overrides)
    except ValueError as e:  # a setting our model does not implement, or keys and shapes that differ
        raise UserError(f"{model_type}: {e}") from None
