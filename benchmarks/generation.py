"""
Generation speed with and without the KV cache, side by side in one run, on a randomly initialised GPT.

    python benchmarks/generation.py                         # GPT-2-small-shaped model (6 layers), 300 new tokens
    python benchmarks/generation.py --max_new_tokens=100 --dtype=bfloat16 --repeats=3

Both runs decode greedily (temperature 0) from the same random prompt, so their tokens must be identical; the
script checks that and exits with status 1 (naming the first differing position) if they are not. It prints
the tokens/s of each and the speed-up. Timings are the best of --repeats, after a short warm-up of each mode.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: model, common

from common import UserError, autocast_context, exit_on_user_error, resolve_device, synchronize  # noqa: E402
from model import GPT, GPTConfig, GPTError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_head", type=int, default=6)
    p.add_argument("--n_embd", type=int, default=384)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--vocab_size", type=int, default=50257)
    p.add_argument("--vocab_padding_multiple", type=int, default=64)
    p.add_argument("--attention", default="sdpa", help="math or sdpa")
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per mode; the best is reported")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def timed_generate(model: GPT, prompt: torch.Tensor, n: int, use_cache: bool, device: str, dtype: str):
    synchronize(device)
    t0 = time.perf_counter()
    with autocast_context(device, dtype):
        out = model.generate(prompt, n, temperature=0.0, use_cache=use_cache)
    synchronize(device)
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prompt_len < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise UserError("--prompt_len, --max_new_tokens and --repeats must be at least 1")
    device = resolve_device(args.device)
    try:
        config = GPTConfig(
            block_size=args.block_size,
            vocab_size=args.vocab_size,
            vocab_padding_multiple=args.vocab_padding_multiple,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            attention=args.attention,
        )
    except GPTError as e:
        raise UserError(str(e)) from None
    if args.prompt_len > config.block_size:
        raise UserError(f"--prompt_len={args.prompt_len} is longer than --block_size={config.block_size}")

    torch.manual_seed(args.seed)
    model = GPT(config).to(device).eval()
    prompt = torch.randint(0, config.vocab_size, (args.batch_size, args.prompt_len), device=device)
    print(
        f"model: {config.n_layer} layers, {config.n_head} heads, n_embd {config.n_embd}, block {config.block_size}, "
        f"vocab {config.vocab_size} (padded {config.padded_vocab_size}), {model.get_num_params() / 1e6:.1f}M params"
    )
    print(
        f"run: {device}, {args.dtype}, {torch.get_num_threads()} threads, attention={config.attention}, "
        f"batch {args.batch_size}, prompt {args.prompt_len}, {args.max_new_tokens} new tokens, greedy, "
        f"best of {args.repeats}, torch {torch.__version__}"
    )

    for use_cache in (True, False):  # warm-up: first-call allocations and kernel selection are not timed
        timed_generate(model, prompt, 4, use_cache, device, args.dtype)

    best = {True: float("inf"), False: float("inf")}
    outputs = {}
    for r in range(args.repeats):
        # Alternate the order so slow drift of a shared machine does not favour one mode.
        for use_cache in (True, False) if r % 2 == 0 else (False, True):
            out, dt = timed_generate(model, prompt, args.max_new_tokens, use_cache, device, args.dtype)
            best[use_cache] = min(best[use_cache], dt)
            outputs[use_cache] = out

    new_tokens = args.batch_size * args.max_new_tokens
    print(f"{'mode':<10} {'seconds':>9} {'tokens/s':>10}")
    for use_cache, name in ((False, "no cache"), (True, "KV cache")):
        print(f"{name:<10} {best[use_cache]:>9.2f} {new_tokens / best[use_cache]:>10.1f}")
    print(f"speed-up with the KV cache: {best[False] / best[True]:.2f}x")

    cached, uncached = outputs[True], outputs[False]
    if not torch.equal(cached, uncached):
        where = (cached != uncached).any(dim=0).nonzero()[0].item() - args.prompt_len
        print(f"MISMATCH: cached and uncached greedy tokens first differ at new token {where}", file=sys.stderr)
        sys.exit(1)
    print(f"outputs identical: {tuple(cached.shape)} tokens")


if __name__ == "__main__":
    exit_on_user_error(main)
