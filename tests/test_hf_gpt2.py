"""GPT-2's weights: a random HF GPT-2 saved locally loads with the same logits, through model.py's own
GPT.from_pretrained and the project's nanogpt/hf_gpt2.py (the HF cache first, offline), and bad overrides, names and
shapes are one-line errors there."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from model import GPT
from nanogpt.errors import UserError
from nanogpt.hf_gpt2 import pretrained_gpt2
from model_helpers import max_err


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may reach for the network: HF reads HF_HUB_OFFLINE at import, so patch the constant too."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def tiny_hf_gpt2(activation: str = "gelu_new"):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(14)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=0,
                        activation_function=activation)
    hf = GPT2LMHeadModel(config)
    with torch.no_grad():  # non-trivial biases and LayerNorm gains, so a mis-copied one shows in the logits
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("multiple, activation, gelu", [(64, "gelu_new", "tanh"), (1, "gelu_new", "tanh"), (64, "gelu", "erf")])
def test_from_pretrained_matches_hf_gpt2_logits(tmp_path, multiple: int, activation: str, gelu: str) -> None:
    hf = tiny_hf_gpt2(activation)
    path = tmp_path / "tiny-gpt2"
    hf.save_pretrained(path)
    model = GPT.from_pretrained(str(path), vocab_padding_multiple=multiple).eval()
    assert model.config.vocab_size == 300 and model.config.gelu == gelu
    loaded = pretrained_gpt2(str(path), vocab_padding_multiple=multiple)  # the project's loader: the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert model.lm_head.weight.shape[0] == (320 if multiple == 64 else 300)
    idx = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    assert ours.shape == theirs.shape == (2, 64, 300)
    print(f"\nHF parity (padding multiple {multiple}, {activation}): max |logit diff| {max_err(ours, theirs):.3g}")
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # float32
    if multiple == 64:
        assert torch.count_nonzero(model.lm_head.weight[300:]) == 0


@pytest.mark.usefixtures("offline")
def test_from_pretrained_rejects_bad_overrides_names_and_shapes(tmp_path) -> None:
    allowed = r"only \['attention', 'dropout', 'sdpa_backend'\]"
    with pytest.raises(UserError, match=r"cannot override \['n_layer'\] of GPT-2; " + allowed):
        pretrained_gpt2("gpt2", {"n_layer": 4})
    with pytest.raises(ValueError, match=r"cannot override \['n_layer'\] of GPT-2; " + allowed):  # model.py's own
        GPT.from_pretrained("gpt2", override_args={"n_layer": 4})
    with pytest.raises(UserError, match=r"unknown GPT-2 model 'gpt3': use gpt2, gpt2-medium"):
        pretrained_gpt2("gpt3")
    with pytest.raises(UserError, match="unknown GPT-2 model"):
        pretrained_gpt2(str(tmp_path / "no-such-folder"))

    relu = tmp_path / "relu"
    tiny_hf_gpt2("relu").save_pretrained(relu)
    with pytest.raises(UserError, match=r"unsupported GPT-2 activation 'relu': this model supports gelu_new, gelu_pytorch_tanh, gelu"):
        pretrained_gpt2(str(relu))
    with pytest.raises(ValueError, match=r"unsupported GPT-2 activation 'relu'"):
        GPT.from_hf_model(tiny_hf_gpt2("relu"))
    hf = tiny_hf_gpt2()
    hf.transformer.h[1].mlp.c_fc.bias = nn.Parameter(torch.zeros(100))  # expected 4 * 64 = 256
    with pytest.raises(ValueError, match=r"key transformer\.h\.1\.mlp\.c_fc\.bias has shape \(100,\), expected \(256,\)"):
        GPT.from_hf_model(hf)


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("damage, said", [
    ("weights cut short", "(SafetensorError: "),
    ("no config.json", ": it has no config.json: pass a local folder written by save_pretrained (export.py writes one)"),
])
def test_a_damaged_hf_folder_is_one_line(tmp_path, damage, said) -> None:
    """A review's reproduction: sample.py --init_from=FOLDER whose model.safetensors was cut short ended in
    safetensors' SafetensorError traceback, and one without config.json in transformers' RuntimeError (it built GPT-2
    small's config and the sizes differed). Both are one line naming the folder."""
    import os

    folder = tmp_path / "hf"
    tiny_hf_gpt2().save_pretrained(folder)
    if damage == "weights cut short":
        weights = folder / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    else:
        (folder / "config.json").unlink()
    with pytest.raises(UserError) as e:
        pretrained_gpt2(str(folder))
    assert str(e.value).startswith(f"could not load GPT-2 weights {str(folder)!r}") and said in str(e.value), str(e.value)
