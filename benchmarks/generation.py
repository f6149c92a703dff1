"""
Generation speed of GPT.generate's modes side by side in one run, on a randomly initialised GPT.

    python benchmarks/generation.py                                  # 6 x 384 model, 256 and 1000 new tokens
    python benchmarks/generation.py --before=HEAD~1 --max_new_tokens 256 1000 --batch_size=10  # against the last commit
    python benchmarks/generation.py --max_new_tokens 100 --uncached  # and without the KV cache (slow)
    python benchmarks/generation.py --nanogpt      # nanoGPT's sample command on its baby GPT, against its way

Modes: the static KV cache eager and compiled (torch.compile of the one-token step), each with the float32 weights
and with the weights converted to bfloat16, and float32 with the window recomputed in bf16 past block_size
(sample.py's dtype=auto on a CPU with bf16 matmuls; compiled: the window step compiled too). Each mode's attention
is the one sample.py's attention=auto picks for the dtype of its heavy work and the block (math on a CPU under bf16
for a block of at most 256 positions, else SDPA). `--nanogpt` is nanoGPT's `python sample.py
--out_dir=out-shakespeare-char` on its baby GPT (6 x 384, block 256, 65 characters, no biases and the exact GELU, as
nanoGPT's train.py and ours train it; 10 samples of 500 tokens from one), against nanoGPT's way of generating as the
first row (its sample.py's loop: the samples one after another, each token a whole forward pass over the last
block_size tokens, no cache, float32, SDPA). After the table `--nanogpt` runs the command itself, `python sample.py
--out_dir=OUT` on a checkpoint of the same weights (sampled, as nanoGPT's defaults: temperature 0.8, top_k 200), in
a fresh process per round, and prints its wall time against nanoGPT's way and against its compute bound: the matmuls
of the exact recompute (the prefill, the cached one-token steps, and past block_size every window step, in the
window's dtype and from packed weights, as generate runs it), each replayed alone back to back (x of the bound:
bound / wall time, process start and checkpoint load included); the command and its bound alternate round by round.
Beside them, a python process that imports torch and exits: the part of the command no generation removes, which
caps the fraction of the bound any generation could reach on the machine.
Then the batch-1 cached step of a 4 x 128 model, eager and compiled, against the matmul floor of one step (its
matmuls replayed alone). `--uncached` adds that way, and `--before=REV` the KV-cache generate of model.py at git
revision REV (same weights, the batch's samples one after another, as sample.py generated them before it batched
them), to measure a change side by side. In every round the modes run one after another, the order reversed each
round so that a shared machine's drift favours none; each mode's figure is its best round. Compile time is measured
apart: the first compiled call's time minus the next one's, on a few tokens.

Every mode decodes greedily from the same random prompt. Its tokens (of the first CHECKED_ROWS samples) are checked
against a float64 forward pass over its own output: each chosen token's float64 logit must be within the mode's
tolerance of the best one (a closer call is a near-tie that rounding may flip, not an error); otherwise the script
names the first divergence and exits with status 1.
"""
from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: model.py and nanogpt/

from nanogpt import engine  # noqa: E402
from nanogpt.checkpoint_file import save_checkpoint  # noqa: E402
from nanogpt.device import keep_freed_memory, resolve_device, resolve_sampling_attention, synchronize  # noqa: E402
from nanogpt.hardware import cpu_has_native_bf16  # noqa: E402
from nanogpt.measure import replayed_matmuls  # noqa: E402
from nanogpt.errors import UserError, exit_on_user_error  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A chosen token's float64 logit may be this far below the best one: float32 steps differ from float64 by ~1e-5
# here, bf16 weights (8 mantissa bits) by ~1e-2 on logits of size ~0.4.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
CHECKED_ROWS = 2  # the samples the float64 check reads (a float64 forward pass per token past block_size each)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=384)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--attention", default="auto", help="math, sdpa, or auto: each mode's as sample.py resolves it "
                   "(math on a CPU under bf16 for a block of at most 256, else sdpa)")
    p.add_argument("--gelu", default="tanh", help="tanh (GPT-2's) or erf (nanoGPT's, and train.py's from scratch)")
    p.add_argument("--no_bias", action="store_true", help="no biases in Linears and LayerNorms (nanoGPT's and "
                   "train.py's from scratch; GPT-2 has them)")
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, nargs="+", default=[256, 1000], help="one table per length")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds; each mode's best is reported")
    p.add_argument("--uncached", action="store_true", help="also time generation without the KV cache")
    p.add_argument("--before", default=None, help="git revision whose model.py's generate (KV cache) to time too")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--modes", default=None, help="only the modes whose names contain one of these comma-separated "
                   "words, e.g. 'nanoGPT,bf16 window'")
    p.add_argument("--nanogpt", action="store_true", help="nanoGPT's sample command on its baby GPT (sets the shape, "
                   "batch 10, prompt 1, 500 new tokens; its uncached way first)")
    args = p.parse_args(argv)
    if args.nanogpt:
        args.n_layer, args.n_head, args.n_embd, args.block_size, args.vocab_size = 6, 6, 384, 256, 65
        args.gelu, args.no_bias = "erf", True  # as nanoGPT's train.py trains it
        args.batch_size, args.prompt_len, args.max_new_tokens, args.uncached = 10, 1, [500], True
    return args


def model_at_revision(rev: str) -> types.ModuleType:
    """model.py as it was at git revision rev, imported as its own module, with the project modules it imports (and
    theirs) as they were at rev too: another revision's model.py may import modules this tree no longer has."""
    try:
        listing = subprocess.run(["git", "ls-tree", "--name-only", rev], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"--before={rev!r}: cannot list that git revision ({e})") from None
    modules = {f[:-3] for f in listing.split() if f.endswith(".py")}  # the root's modules at rev
    return _module_at_revision(rev, "model", modules, {})


def _module_at_revision(rev: str, name: str, modules: set[str],
                        loaded: dict[str, types.ModuleType]) -> types.ModuleType:
    if name in loaded:
        return loaded[name]
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:{name}.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise UserError(f"--before={rev!r}: cannot read {name}.py at that git revision ({e})") from None
    module = types.ModuleType(f"{name}_{rev}")
    loaded[name] = module
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names if not isinstance(node, ast.ImportFrom) or node.level == 0}
    at_rev = {dep: _module_at_revision(rev, dep, modules, loaded) for dep in sorted((imported & modules) - {name})}
    saved = {dep: sys.modules.get(dep) for dep in at_rev}
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    sys.modules.update(at_rev)  # its imports find the revision's modules while it runs
    try:
        exec(compile(source, f"{name}.py@{rev}", "exec"), module.__dict__)
    finally:
        for dep, previous in saved.items():
            if previous is None:
                sys.modules.pop(dep, None)
            else:
                sys.modules[dep] = previous
    return module


def nanogpt_generate(model: GPT, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """nanoGPT's sample.py, greedy: the samples one after another (its loop over num_samples), each by GPT.generate,
    model.py's plain loop as nanoGPT's: for every new token a whole forward pass over the last block_size tokens."""
    return torch.cat([model.generate(idx, max_new_tokens, temperature=0.0) for idx in prompt.split(1)])  # (1, T) each


def with_attention(model: GPT, attention: str) -> GPT:
    """model itself if it uses `attention`, else a copy that does (the same weights)."""
    if model.config.attention == attention:
        return model
    other = copy.deepcopy(model)
    other.set_attention(attention)
    return other


def build_modes(model: GPT, args: argparse.Namespace, device: str) -> dict:
    """name -> (generate(prompt, n) function, weights dtype, compiled?). model: float32, SDPA attention."""
    # each mode's attention as sample.py resolves it for the dtype its heavy work runs in
    block_size = model.config.block_size
    fp32 = with_attention(model, resolve_sampling_attention(args.attention, device, "float32", block_size)[0])
    bf16_attention = resolve_sampling_attention(args.attention, device, "bfloat16", block_size)[0]
    bf16 = copy.deepcopy(with_attention(model, bf16_attention)).to(torch.bfloat16)
    bf16_window = with_attention(model, bf16_attention)
    modes = {}
    if args.before:
        old_module = model_at_revision(args.before)
        # the settings that revision knows (later ones, e.g. fused_loss, only change how training computes)
        known = {f.name for f in dataclasses.fields(old_module.GPTConfig)}
        dropped = sorted(set(vars(fp32.config)) - known)
        if dropped:
            print(f"--before={args.before}: its GPTConfig has no {', '.join(dropped)}: built without")
        old_config = old_module.GPTConfig(**{k: v for k, v in vars(fp32.config).items() if k in known})
        old = old_module.GPT(old_config).to(args.device).eval()
        old.load_state_dict(model.state_dict())
        # as sample.py ran before batching: the samples one after another
        def before(p: torch.Tensor, n: int) -> torch.Tensor:
            return torch.cat([old.generate(p[i : i + 1], n, temperature=0.0) for i in range(p.size(0))])

        modes[f"before ({args.before}), fp32"] = (before, torch.float32, False)
    if args.uncached:
        modes["no cache, fp32 (nanoGPT's way)"] = (lambda p, n: nanogpt_generate(model, p, n), torch.float32, False)
    for name, m, dtype in (("fp32", fp32, torch.float32), ("bf16", bf16, torch.bfloat16)):
        modes[f"eager, {name}"] = (lambda p, n, m=m: engine.generate(m, p, n, temperature=0.0), dtype, False)
        modes[f"compiled, {name}"] = (lambda p, n, m=m: engine.generate(m, p, n, temperature=0.0, compile=True), dtype, True)
    for compiled in (False, True):  # float32 steps, the window past block_size in bf16 autocast
        modes[f"{'compiled' if compiled else 'eager'}, fp32, bf16 window"] = (
            lambda p, n, c=compiled: engine.generate(bf16_window, p, n, temperature=0.0, compile=c,
                                                          window_dtype=torch.bfloat16),
            torch.bfloat16, compiled)
    return modes


def timed(fn, prompt: torch.Tensor, n: int, device: str) -> tuple[torch.Tensor, float]:
    synchronize(device)
    t0 = time.perf_counter()
    out = fn(prompt, n)
    synchronize(device)
    return out, time.perf_counter() - t0


@torch.no_grad()
def first_divergence(reference: GPT, out: torch.Tensor, prompt_len: int, tol: float) -> str | None:
    """Where a chosen token's float64 logit falls more than tol below the best one, as text; None if nowhere."""
    bs = reference.config.block_size
    L = out.size(1)
    # logits predicting token t come from the window of the block_size tokens before it
    head, _ = reference(out[:, : min(bs, L - 1)])  # (B, min(bs, L-1), V): predictions for tokens 1 .. bs
    for t in range(prompt_len, L):
        logits = head[:, t - 1] if t <= bs else reference(out[:, t - bs : t])[0][:, -1]  # (B, V)
        chosen = logits.gather(1, out[:, t : t + 1]).squeeze(1)  # (B,)
        gap = logits.max(dim=1).values - chosen  # (B,)
        if (gap > tol).any():
            row = int((gap > tol).nonzero()[0])
            return f"new token {t - prompt_len} of sample {row}: its logit is {gap[row]:.3g} below the best (> {tol})"
    return None


# nanoGPT's README sample command, run as it is (its defaults: 10 samples of 500 tokens from "\n", temperature 0.8,
# top_k 200) on a checkpoint of the benchmark's model
NANOGPT_SAMPLE = ["sample.py", "--out_dir={out_dir}"]
TINY = dict(n_layer=4, n_head=4, n_embd=128, block_size=1024, vocab_size=65, gelu="erf")  # the batch-1 floor's model


@torch.no_grad()
def cached_step_floor(model: GPT, batch: int, position: int, device: str, dtype: torch.dtype) -> tuple[float, int]:
    """The matmul floor of one cached one-token step at `position` (keys before it cached): ms, and its matmuls."""
    cache = engine.KVCache(model.config, batch, dtype, device, size=position + 1)
    idx = torch.randint(0, model.config.vocab_size, (batch, position + 1), device=device)
    model._hidden(idx[:, :position], kv_cache=cache)  # the prompt, cached
    return replayed_matmuls(lambda: engine._next_token_logits(model, idx, cache, engine.decode_step), device)


@torch.no_grad()
def window_step_floor(model: GPT, batch: int, device: str, dtype: torch.dtype) -> tuple[float, int]:
    """The matmul floor of one window step past block_size, with the weights in `dtype` and packed (as generate
    runs it, uncompiled): ms, and its matmuls."""
    idx = torch.randint(0, model.config.vocab_size, (batch, model.config.block_size), device=device)
    with engine.window_phase(model, idx, dtype):
        return replayed_matmuls(lambda: engine.window_logits(model, idx), device)


@torch.no_grad()
def sample_command_bound(model: GPT, batch: int, prompt_len: int, new: int, device: str,
                         window: torch.dtype) -> tuple[float, int]:
    """The compute bound of generating `new` tokens after a prompt of prompt_len for `batch` samples, exactly (every
    token past block_size recomputes the window): the matmul floors of the prefill, of each cached step (taken at
    the middle of the block) and of each window step, in seconds; and the number of matmuls that makes."""
    bs = model.config.block_size
    cached = min(new, bs - prompt_len + 1)  # tokens from the cache: the prefill's, then one per one-token step
    prefill = replayed_matmuls(lambda: engine.generate(model, torch.zeros(batch, prompt_len, dtype=torch.long,
                                                                          device=device), 1, 0.0), device)
    step = cached_step_floor(model, batch, bs // 2, device, torch.float32)
    windows = window_step_floor(model, batch, device, window) if new > cached else (0.0, 0)
    seconds = (prefill[0] + (cached - 1) * step[0] + (new - cached) * windows[0]) / 1000
    return seconds, prefill[1] + (cached - 1) * step[1] + (new - cached) * windows[1]


def whole_sample_command_s(model: GPT, device: str) -> tuple[float, float, str]:
    """nanoGPT's sample command (sample.py with its defaults) on a checkpoint of `model`, in a fresh process: its
    wall time (process start, imports and checkpoint load included), the generation's own time (its tokens/s
    line), and the command."""
    with tempfile.TemporaryDirectory(prefix="generation_") as out_dir:
        chars = [chr(c) for c in range(32, 32 + model.config.vocab_size - 1)] + ["\n"]
        meta = {"vocab_size": len(chars), "tokenizer": "char", "itos": chars}
        save_checkpoint(os.path.join(out_dir, "ckpt.pt"), {
            "model": model.state_dict(), "model_args": dataclasses.asdict(model.config), "iter_num": 0,
            "best_val_loss": float("inf"), "config": {}, "meta": meta})
        cmd = [a.format(out_dir=out_dir) for a in NANOGPT_SAMPLE] + [f"--device={device}"]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise UserError(f"sample.py failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    found = re.search(r"^tokens/s: .* in ([0-9.]+) s", proc.stderr, re.M)
    if found is None:
        raise UserError(f"sample.py printed no tokens/s line: {proc.stderr[-2000:]}")
    return seconds, float(found.group(1)), "python " + " ".join(cmd[:1] + ["--out_dir=OUT"] + cmd[2:])


def torch_process_s() -> float:
    """The wall time of a Python process that imports torch and exits, as sample.py does (its objects frozen out of
    the collector's way as it ends): the share of the sample command that no generation can remove."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gc, torch; gc.freeze()"], check=True)
    return time.perf_counter() - t0


def tiny_step_figures(device: str) -> str:
    """The batch-1 cached step of the tiny model (4 x 128), 256 tokens from one, eager and compiled, against its
    matmul floor (one step's matmuls replayed), in microseconds per token."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, attention="math")).to(device).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    per_token = {}
    for compiled in (False, True):
        engine.generate(model, prompt, 256, temperature=0.0, compile=compiled)  # warm-up (and compile)
        per_token[compiled] = min(timed(lambda p, n: engine.generate(model, p, n, temperature=0.0, compile=compiled),
                                        prompt, 256, device)[1] for _ in range(3)) / 256 * 1e6
    floor = cached_step_floor(model, 1, 128, device, torch.float32)[0] * 1000
    return (f"batch-1 cached step, {TINY['n_layer']} x {TINY['n_embd']} model, math attention, 256 tokens: eager "
            f"{per_token[False]:.0f} us/token, compiled {per_token[True]:.0f} us/token; its matmul floor {floor:.0f} "
            f"us: compiled = {per_token[True] / floor:.2f}x the floor")


def model_config(args) -> GPTConfig:
    """The model the options describe, every option checked first (one line each)."""
    if args.prompt_len < 1 or min(args.max_new_tokens) < 1 or args.repeats < 1 or args.batch_size < 1:
        raise UserError("--prompt_len, --max_new_tokens, --repeats and --batch_size must be at least 1")
    try:
        config = GPTConfig(block_size=args.block_size, vocab_size=args.vocab_size, n_layer=args.n_layer,
                           n_head=args.n_head, n_embd=args.n_embd, gelu=args.gelu, bias=not args.no_bias)
    except UserError as e:
        raise UserError(str(e)) from None
    if args.prompt_len > config.block_size:
        raise UserError(f"--prompt_len={args.prompt_len} is longer than --block_size={config.block_size}")
    return config


def time_length(modes: dict, reference: GPT, prompt: torch.Tensor, n: int, args, device: str) -> tuple[dict, bool]:
    """Each mode's best time for n new tokens over args.repeats alternating rounds, printed as a table beside the
    float64 check of its tokens; returns the best times and whether a mode's tokens diverged."""
    best = {name: float("inf") for name in modes}
    outputs = {}
    # generate sizes its cache to prompt + n, and the compiled step compiles once per cache size: compile this
    # length's variant before timing it
    for fn, _, compiled in modes.values():
        if compiled:
            fn(prompt, n)
    for r in range(args.repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in order:
            out, dt = timed(modes[name][0], prompt, n, device)
            print(f"  round {r + 1}, {name}: {dt:.2f} s", flush=True)
            best[name] = min(best[name], dt)
            outputs[name] = out
    base = next(iter(modes))
    print(f"\n{n} new tokens x batch {args.batch_size}; speed-up against '{base}'")
    block_size = reference.config.block_size
    if n + args.prompt_len > block_size + 1:  # the token after a full block is the first past it
        past = n + args.prompt_len - block_size - 1
        print(f"(the float64 check: a forward pass for each of the {past} tokens past block_size, per distinct "
              f"output, on its first {min(CHECKED_ROWS, args.batch_size)} samples)", flush=True)
    print(f"{'mode':<32} {'seconds':>9} {'tokens/s':>10} {'speed-up':>9}  float64 check", flush=True)
    failed = False
    checked = {}  # modes that chose the same tokens share one check
    for name, (_, dtype, _) in modes.items():
        key = (outputs[name].cpu().numpy().tobytes(), TOLERANCE[dtype])
        if key not in checked:
            checked[key] = first_divergence(reference, outputs[name][:CHECKED_ROWS], args.prompt_len, TOLERANCE[dtype])
        why = checked[key]
        failed |= why is not None
        check = f"DIVERGES at {why}" if why else f"ok (tol {TOLERANCE[dtype]:g})"
        tokens_per_s = args.batch_size * n / best[name]
        print(f"{name:<32} {best[name]:>9.2f} {tokens_per_s:>10.1f} {best[base] / best[name]:>8.2f}x  {check}",
              flush=True)
    return best, failed


def print_sample_command(model: GPT, args, device: str, nano: float | None) -> None:
    """nanoGPT's sample command as a whole process, against its generation in this process (`nano`) and its
    compute bound; the command and its bound alternate, round by round: a shared machine's speed drifts by tens of
    percent."""
    window = torch.bfloat16 if device == "cpu" and cpu_has_native_bf16() else torch.float32  # sample.py's auto
    bound_model = with_attention(model, resolve_sampling_attention(
        "auto", device, "bfloat16" if window == torch.bfloat16 else "float32", model.config.block_size)[0])
    rounds, starts = [], []
    for _ in range(args.repeats):
        whole, generation, command = whole_sample_command_s(model, device)
        bound = sample_command_bound(bound_model, args.batch_size, args.prompt_len, args.max_new_tokens[0],
                                     device, window)[0]
        rounds.append((whole, bound, generation))
        starts.append(torch_process_s())
    whole, bound, generation = min(rounds)
    start = min(starts)
    print(f"\nnanoGPT's sample command, whole process (start, imports, checkpoint load, 10 x 500 tokens): "
          f"{command}: {whole:.1f} s (rounds: {', '.join(f'{w:.1f}' for w, _, _ in rounds)}); of it, the "
          f"generation (sample.py's tokens/s line) {generation:.1f} s, process start, imports and checkpoint load "
          f"{whole - generation:.1f} s")
    if nano is not None:
        print(f"  against nanoGPT's way (its generation alone, in this process, above): {nano:.1f} s, "
              f"{nano / whole:.2f}x faster")
    print(f"  its compute bound (the matmuls of the exact recompute, each replayed alone; the window in "
          f"{str(window).split('.')[-1]}): {bound:.1f} s: {bound / whole:.2f} of the bound (each round's: "
          f"{', '.join(f'{b / w:.2f}' for w, b, _ in rounds)})")
    print(f"  a python process that imports torch and exits, as sample.py does: {start:.1f} s, so that no "
          f"generation could bring this command above {bound / (bound + start):.2f} of the bound here")
    print(f"  {tiny_step_figures(device)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = model_config(args)
    device = resolve_device(args.device)
    kept = keep_freed_memory(True, device)  # as sample.py's default: every mode gains from it
    torch.manual_seed(args.seed)
    model = GPT(config).to(device).eval()
    reference = copy.deepcopy(model).double()
    prompt = torch.randint(0, config.vocab_size, (args.batch_size, args.prompt_len), device=device)
    modes = build_modes(model, args, device)
    if args.modes:
        words = [w.strip() for w in args.modes.split(",") if w.strip()]
        modes = {name: mode for name, mode in modes.items() if any(w in name for w in words)}
        if not modes:
            raise UserError(f"--modes={args.modes!r} matches no mode: the modes are named as the table shows them")
    print(
        f"model: {config.n_layer} layers, {config.n_head} heads, n_embd {config.n_embd}, block {config.block_size}, "
        f"vocab {config.vocab_size}, {model.get_num_params() / 1e6:.1f}M params"
    )
    print(
        f"run: {device}, {torch.get_num_threads()} threads, gelu={config.gelu}, bias={config.bias}, "
        f"attention={args.attention}, "
        f"batch {args.batch_size}, prompt {args.prompt_len}, greedy, best of {args.repeats}, torch {torch.__version__}"
        + (", glibc malloc keeps freed memory (as sample.py)" if kept else "")
    )
    compile_s = {}
    for name, (fn, _, compiled) in modes.items():  # warm-up: compiles, first-call allocations, kernel choice
        first = timed(fn, prompt, 4, device)[1]
        if compiled:
            compile_s[name] = first - timed(fn, prompt, 4, device)[1]
    print("compile time (first compiled call minus the next, 4 tokens): "
          + ", ".join(f"{name}: {s:.1f} s" for name, s in compile_s.items()))
    failed = False
    best_of: dict[str, float] = {}  # each mode's best time at the first length
    for n in args.max_new_tokens:
        best, diverged = time_length(modes, reference, prompt, n, args, device)
        best_of, failed = best_of or best, failed or diverged
    if args.nanogpt:
        print_sample_command(model, args, device, best_of.get("no cache, fp32 (nanoGPT's way)"))
    if failed:
        print("MISMATCH: a mode chose a token that the float64 model ranks clearly below the best", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    exit_on_user_error(main)
