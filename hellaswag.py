"""
HellaSwag accuracy of a checkpoint or of GPT-2's weights, scored as build-nanogpt does (nanogpt/hellaswag.py, which
train.py's evals use too with hellaswag=True): acc by the ending's total loss, acc_norm by its mean loss per token.

$ python hellaswag.py --init_from=gpt2       # build-nanogpt's figures for it: acc 0.2859, acc_norm 0.2955
$ python hellaswag.py --init_from=gpt2-xl    # acc 0.3842, acc_norm 0.4893
$ python hellaswag.py --out_dir=out-gpt2-fineweb  # a run's newest checkpoint (ckpt.pt or an FSDP sharded folder)
$ torchrun --standalone --nproc_per_node=8 hellaswag.py --init_from=gpt2-xl   # the examples split over 8 GPUs

The validation set (10,042 examples, 11 MB) is downloaded once to data/hellaswag/; `path=FILE` reads a local copy
or any file in its format: JSON lines with "ctx" (text), "endings" (4 texts) and "label" (0-3).
Config: the HellaSwagConfig defaults below, then config files and --key=value overrides in the order given.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Annotated

from nanogpt import checkpoints
from nanogpt.hellaswag import VAL_EXAMPLES, describe, encode, evaluate, load_examples
from nanogpt.config import OneOf, Range, WeightsSource, check, declared_problems
from nanogpt.device import DTYPES, autocast_context, resolve_dtype
from nanogpt.errors import exit_on_user_error
from nanogpt.distributed import cleanup_distributed, setup_distributed
from nanogpt.text import plural
from configurator import configure

# build-nanogpt's hellaswag.py on GPT-2's weights (completion style; EleutherAI's harness scores differently)
REFERENCE = {"gpt2": (0.2859, 0.2955), "gpt2-xl": (0.3842, 0.4893)}


@dataclass
class HellaSwagConfig(WeightsSource):  # init_from, out_dir, ckpt
    path: str | None = None  # JSON lines of {"ctx", "endings": [4], "label": 0-3}; None: the validation set, downloaded
    max_examples: Annotated[int, Range(0, note="0: all")] = 0  # score only the first this many examples
    device: str = "auto"  # "auto", "cpu", "cuda", ... (under torchrun: each rank's GPU)
    dtype: Annotated[str, OneOf("auto", *DTYPES)] = "auto"  # auto: bf16 on a GPU that has it, else float32


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = configure(HellaSwagConfig(), sys.argv[1:] if argv is None else argv)
    check(declared_problems(cfg) + cfg.weights_problems())  # before the examples' download
    dist = setup_distributed(cfg.device)
    finished = False
    try:
        dtype = resolve_dtype(cfg.dtype, dist.device, training=False)
        examples = load_examples(cfg.path)[: cfg.max_examples or None]
        log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if dist.master else (lambda msg: None)
        model, tokenizer = checkpoints.load_for_inference(cfg.init_from, cfg.out_dir, cfg.ckpt, dist.device, dtype, {},
                                                         log=log)
        t0 = time.time()
        result = evaluate(model, encode(examples, tokenizer, model.config.block_size), dist,
                          autocast_context(dist.device, dtype))
        if dist.master:
            print(f"{describe(result)} in {time.time() - t0:.0f} s ({dist.device}, {dtype}, "
                  f"{plural(dist.world_size, 'rank')})")
            if cfg.init_from in REFERENCE and result["hellaswag_n"] == VAL_EXAMPLES:
                acc, acc_norm = REFERENCE[cfg.init_from]
                print(f"build-nanogpt's figures for {cfg.init_from}: acc {acc:.4f}, acc_norm {acc_norm:.4f}")
        finished = True
        return result
    finally:
        cleanup_distributed(dist, barrier=finished)  # no barrier after an error: the other ranks may never get there


if __name__ == "__main__":
    exit_on_user_error(main)
