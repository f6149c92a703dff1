"""benchmarks/generation.py's check of a mode's tokens: a near-tie that rounding may flip passes, a clearly worse
token is named. The expected choices come from a brute-force float64 forward pass in the test, not the script."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, f"{ROOT}/benchmarks")
from generation import build_modes, first_divergence, nanogpt_generate  # noqa: E402

from nanogpt import engine
from model import GPT, GPTConfig  # noqa: E402


def test_near_ties_pass_and_a_clearly_worse_token_is_named() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).double().eval()
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(1))
    out = engine.generate(model, prompt, 9, temperature=0.0)  # (2, 12): past block_size 8, so windows slide
    assert first_divergence(model, out, 3, tol=0.0) is None  # greedy tokens are the float64 argmax

    # at new token 6 (position 9, predicted from the window of positions 1..8) take the runner-up of sample 1
    with torch.no_grad():
        logits = model(out[1:2, 1:9])[0][0, -1]  # (V,)
    top2 = logits.topk(2)
    gap = (top2.values[0] - top2.values[1]).item()
    flipped = out[:, :10].clone()
    flipped[1, 9] = top2.indices[1]
    assert first_divergence(model, flipped, 3, tol=gap * 1.01) is None, "a flip within the tolerance is a near-tie"
    why = first_divergence(model, flipped, 3, tol=gap * 0.99)
    assert why is not None and why.startswith("new token 6 of sample 1:"), why


def test_before_mode_runs_an_older_model_py_with_the_same_weights(monkeypatch, capsys) -> None:
    """--before=REV builds the model of model.py at REV (read with git show) with this model's weights, passing only
    the settings REV knows: a revision whose GPTConfig has no `fused_loss` (today's model.py without that field
    stands in for it) still loads, and its greedy tokens equal today's. The project modules it imports are read at
    REV too (a revision's model.py may import a module this tree no longer has: REV's stand-in imports `errors`, a
    module of the root then), not taken from this tree."""
    import subprocess

    import generation

    shown = []
    at_rev = {"errors.py": "class UserError(ValueError):\n    pass\n"}  # a root module REV had and this tree has not

    def git(cmd, **kw):  # REV is this tree's model.py, without its fused_loss field, importing REV's errors.py
        if cmd[1] == "ls-tree":
            return subprocess.CompletedProcess(cmd, 0, stdout="model.py\nerrors.py\ntrain.py\n", stderr="")
        name = cmd[-1].split(":", 1)[1]
        shown.append(cmd[-1])
        if name in at_rev:
            return subprocess.CompletedProcess(cmd, 0, stdout=at_rev[name], stderr="")
        source = "".join(line for line in open(os.path.join(ROOT, name)) if not line.startswith("    fused_loss: bool"))
        source = source.replace("\nimport math\n", "\nimport math\n\nimport errors  # noqa: F401\n", 1)
        source = source.replace('for name in ("bias", "fused_loss"):', 'for name in ("bias",):')  # its check too
        return subprocess.CompletedProcess(cmd, 0, stdout=source, stderr="")

    monkeypatch.setattr(generation.subprocess, "run", git)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).eval()
    modes = build_modes(model, argparse.Namespace(before="abc123", uncached=False, device="cpu", attention="auto"),
                        "cpu")
    assert shown == ["abc123:model.py", "abc123:errors.py"]  # each module read once, REV's
    assert generation.model_at_revision("abc123").errors.__name__ == "errors_abc123"  # REV's, not this tree's
    assert "--before=abc123: its GPTConfig has no fused_loss: built without" in capsys.readouterr().out
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(1))
    before, dtype, compiled = modes["before (abc123), fp32"]
    assert (dtype, compiled) == (torch.float32, False)
    assert torch.equal(before(prompt, 20), engine.generate(model, prompt, 20, temperature=0.0))


def test_nanogpt_rows_way_and_the_modes_give_the_tokens_of_generate_without_the_cache() -> None:
    """--nanogpt's first row is nanoGPT's sample loop (one sample after another, a whole forward pass per token
    through the public forward); it and the float32 modes (SDPA, the cache, the trimmed window past block_size) choose the same greedy
    tokens, here past block_size 8 too; the bf16 window mode runs its model with math attention (sample.py's
    attention=auto on a CPU under bf16)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=50, n_layer=2, n_head=2, n_embd=16, gelu="erf")).eval()
    prompt = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(1))
    expected = engine.generate(model, prompt, 12, temperature=0.0, use_cache=False)
    with torch.no_grad():
        assert torch.equal(nanogpt_generate(model, prompt, 12), expected)
    modes = build_modes(model, argparse.Namespace(before=None, uncached=True, device="cpu", attention="auto"), "cpu")
    for name in ("no cache, fp32 (nanoGPT's way)", "eager, fp32"):
        with torch.no_grad():
            assert torch.equal(modes[name][0](prompt, 12), expected), name
    from model import CausalSelfAttention

    def attention_paths(mode: str) -> set[str]:
        seen = set()
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda m, i, o: seen.add(m.attention) if isinstance(m, CausalSelfAttention) else None)
        try:
            modes[mode][0](prompt, 12)
        finally:
            hook.remove()
        return seen

    assert attention_paths("eager, fp32") == {"sdpa"}
    assert attention_paths("eager, fp32, bf16 window") == {"math"}


def linear_flops(run) -> int:
    """The FLOPs of the (b)mm-free matmuls `run()` does: its linear layers' (mm, addmm, or from a packed weight),
    whose shapes do not depend on the position a step is at."""
    from nanogpt.measure import MatmulRecorder

    recorder = MatmulRecorder()
    with recorder:
        run()
    flops = 0
    for op, args, _ in recorder.calls:
        name = str(op)
        if name == "mkldnn._linear_pointwise.default":  # a Linear from a packed weight (the bf16 window)
            flops += 2 * args[0][1][0] * args[0][1][1] * args[1][1].size(0)
            continue
        if "bmm" in name or not ("mm" in name):
            continue
        a, b = [x for x in args if isinstance(x, tuple) and x[0] == "tensor"][-2:]
        flops += 2 * a[1][0] * a[1][1] * b[1][1]
    return flops


@pytest.mark.parametrize("new", [5, 12, 30])  # within the block, reaching it, past it
def test_the_sample_commands_bound_adds_up_the_work_generate_does(new, monkeypatch) -> None:
    """The bound of `--nanogpt` adds up the floors of the prefill, the cached steps and the window steps: with each
    floor replaced by the linear layers' FLOPs it replays, the sum is the FLOPs the real generate's linear layers
    do, within the block and past it (the window in bf16, as sample.py runs it)."""
    import generation

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=16, attention="math")).eval()
    prompt = torch.zeros(3, 4, dtype=torch.long)
    real = linear_flops(lambda: engine.generate(model, prompt, new, temperature=0.8, top_k=200, window_dtype=torch.bfloat16))
    monkeypatch.setattr(generation, "replayed_matmuls", lambda run, device, repeats=3: (linear_flops(run), 0))
    seconds, _ = generation.sample_command_bound(model, 3, 4, new, "cpu", torch.bfloat16)
    assert round(seconds * 1000) == real


def test_the_whole_command_is_timed_apart_from_its_generation() -> None:
    """`--nanogpt` runs sample.py in a fresh process: its wall time, and of it the generation sample.py reports
    (its tokens/s line), the rest being process start, imports and checkpoint load, of which a process that only
    imports torch and exits is the part no generation removes."""
    import generation

    model = GPT(GPTConfig(block_size=16, vocab_size=65, n_layer=1, n_head=2, n_embd=16)).eval()
    whole, generating, command = generation.whole_sample_command_s(model, "cpu")
    assert 0 < generating < whole
    # importing torch (~0.9 s) is most of a process that does it: dozens of times a bare interpreter's start
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - t0
    assert generation.torch_process_s() > 5 * bare
    assert command == "python sample.py --out_dir=OUT --device=cpu"
