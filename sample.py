"""
Sample text from a trained model (the newest checkpoint in out_dir, or a named one) or from GPT-2 weights, with the
KV cache.

$ python sample.py --out_dir=out-shakespeare-char
$ python sample.py --init_from=gpt2-xl --start="What is the answer to life, the universe, and everything?" \
    --num_samples=5 --max_new_tokens=100
$ python sample.py --out_dir=out-shakespeare --start=FILE:prompt.txt   # the prompt is the file's text

stdout holds only the samples, each followed by a line of dashes. stderr has the notes (tokenizer, model) and,
last, one line to parse: `tokens/s: <float> (...)`, the new tokens over the generation wall time.

Config: the SampleConfig defaults below, then config files and --key=value overrides in the order given.

Reads checkpoints and GPT-2 weights through checkpoints.py; imports nothing from train.py.
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import sys
import time
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch

from configurator import configure
from model import GPT, SDPA_BACKENDS, GPTConfig
from nanogpt import checkpoints, engine, tokenizers
from nanogpt.config import (ATTENTIONS, AtLeast1, OneOf, Range, Seed, WeightsSource, check, declared_problems,
                            kernel_problem)
from nanogpt.device import (DTYPES, autocast_context, keep_freed_memory, resolve_device, resolve_dtype,
                            resolve_sampling_attention, synchronize)
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.hardware import cpu_has_native_bf16
from nanogpt.text import plural

SEPARATOR = "---------------"


@dataclass
class SampleConfig(WeightsSource):  # init_from, out_dir, ckpt
    start: str = "\n"  # the prompt, or "FILE:path" to read it from a file; "<|endoftext|>" works with GPT-2 BPE
    num_samples: AtLeast1[int] = 10  # drawn as one batch, each from its own random stream (seed and its index)
    batch_size: Annotated[int | None, Range(1, note="or None: all num_samples at once")] = None  # to bound memory
    max_new_tokens: AtLeast1[int] = 500  # tokens generated per sample
    temperature: Annotated[float, Range(0, note="0 means greedy")] = 0.8  # 1.0: the model's distribution
    top_k: AtLeast1[int | None] = 200  # keep only the top_k most likely tokens (None: all)
    top_p: Annotated[float | None, Range(0, 1, low_open=True)] = None  # nucleus: the fewest tokens of p >= top_p
    seed: Seed[int] = 1337
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N", "mps"
    dtype: Annotated[str, OneOf("auto", *DTYPES)] = "auto"  # autocast's
    window_dtype: Annotated[str | None, OneOf("auto", *DTYPES)] = None  # recomputing past block_size; None: dtype's
    compile: bool = False  # torch.compile the one-token decoding step (its compile takes a while: long runs only)
    attention: Annotated[str, OneOf(*ATTENTIONS)] = "auto"  # auto: math on a bf16 CPU for windows <= 256, else sdpa
    sdpa_backend: Annotated[str | None, OneOf(*SDPA_BACKENDS)] = None  # attention=sdpa's kernel; None: the model's
    keep_freed_memory: bool = True  # CPU: glibc malloc keeps freed buffers (each window step allocates them again)


@dataclass
class Generation:
    ids: list[list[int]]  # per sample: the prompt's tokens, then the new ones
    texts: list[str]  # per sample: the decoded text, prompt included
    new_tokens: int  # over all samples
    seconds: float  # generation wall time over all samples, device synchronised

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_config(cfg: SampleConfig) -> SampleConfig:
    """Every problem with the settings in one UserError, before anything slow (loading weights) happens. Returns
    the config with its device and dtype resolved ('auto' becomes what runs), which the functions below take."""
    problems = declared_problems(cfg) + cfg.weights_problems()
    if (why := kernel_problem(cfg.attention, cfg.sdpa_backend)) is not None:
        problems.append(why)
    if any(p.startswith(("dtype=", "window_dtype=")) for p in problems):
        check(problems)  # names this machine need not be asked about
    try:  # what runs here: the device, and the dtypes on it ("auto" resolved)
        device = resolve_device(cfg.device)
        window = cfg.window_dtype
        if window is None and cfg.dtype == "auto" and device == "cpu" and cpu_has_native_bf16():
            window = "bfloat16"
        if window is not None:
            window = resolve_dtype(window, device, training=False, key="window_dtype")
        cfg = dataclasses.replace(cfg, device=device, dtype=resolve_dtype(cfg.dtype, device, training=False),
                                  window_dtype=window)
    except UserError as e:
        problems.append(str(e))
    check(problems)
    return cfg


def read_prompt(start: str) -> str:
    """The prompt text: `start` itself, or the contents of the file named after "FILE:"."""
    if not start.startswith("FILE:"):
        return start
    path = start[len("FILE:") :]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"start={start!r}: no prompt file {path!r}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"start={start!r}: cannot read the prompt file {path!r} ({e})") from None


def load_model(cfg: SampleConfig) -> tuple[GPT, tokenizers.Tokenizer]:
    """The model for init_from, in eval mode on cfg.device and cfg.dtype (as check_config resolved them), and the
    tokenizer it was trained with; attention="auto" resolved for the model's block_size."""
    overrides = {k: v for k, v in (("attention", cfg.attention), ("sdpa_backend", cfg.sdpa_backend))
                 if v is not None and (k, v) != ("attention", "auto")}

    def auto_attention(config: GPTConfig) -> str:  # the window past block_size is the heavy work
        return resolve_sampling_attention("auto", cfg.device, cfg.window_dtype or cfg.dtype, config.block_size,
                                          cfg.sdpa_backend)[0]

    return checkpoints.load_for_inference(cfg.init_from, cfg.out_dir, cfg.ckpt, cfg.device, cfg.dtype, overrides,
                                         cfg.compile, log, auto_attention if cfg.attention == "auto" else None)


def encode_prompt(tokenizer: tokenizers.Tokenizer, prompt: str) -> tuple[list[int], int]:
    """The prompt's token ids to start from, and how many leading ids to leave out of the decoded text.
    An empty prompt starts from <|endoftext|> with GPT-2 BPE (unconditional samples, as GPT-2's own)."""
    ids = tokenizer.encode(prompt)
    if ids:
        return ids, 0
    if tokenizer.eot is None:
        raise UserError("start is empty: a char-level model needs at least one character to start from")
    return [tokenizer.eot], 1


def sample_generators(seed: int, n: int, device: str) -> list[torch.Generator]:
    """A random stream per sample, seeded from (seed, the sample's index) alone: sample i is drawn alike whichever
    batch it is generated in."""
    seeds = (np.random.SeedSequence([seed, i]).generate_state(1, dtype=np.uint64)[0] for i in range(n))
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]


def sample(model: GPT, tokenizer: tokenizers.Tokenizer, prompt: str, cfg: SampleConfig) -> Generation:
    """num_samples continuations of `prompt`, generated together as one batch (each step reads the weights once
    for all of them; batch_size: at most that many at once), each from its own seeded stream: the same seed and
    settings give the same text, whatever batch_size. cfg.device and cfg.dtype: resolved (check_config)."""
    device, dtype = cfg.device, cfg.dtype
    ids, hidden = encode_prompt(tokenizer, prompt)
    torch.manual_seed(cfg.seed)
    generators = sample_generators(cfg.seed, cfg.num_samples, device)
    batch = cfg.batch_size or cfg.num_samples
    outputs: list[list[int]] = []
    synchronize(device)
    t0 = time.perf_counter()
    for first in range(0, cfg.num_samples, batch):
        rows = min(batch, cfg.num_samples - first)
        x = torch.tensor([ids] * rows, dtype=torch.long, device=device)  # (rows, T)
        with autocast_context(device, dtype):
            y = engine.generate(model, x, cfg.max_new_tokens, cfg.temperature, cfg.top_k, top_p=cfg.top_p,
                               generator=generators[first:first + rows], vocab_size=tokenizer.vocab_size,
                               compile=cfg.compile, window_dtype=DTYPES[cfg.window_dtype] if cfg.window_dtype else None)
        outputs += y.tolist()
    synchronize(device)
    seconds = time.perf_counter() - t0
    texts = [tokenizer.decode(out[hidden:]) for out in outputs]
    return Generation(outputs, texts, cfg.num_samples * cfg.max_new_tokens, seconds)


def main(argv: list[str] | None = None) -> None:
    cfg = configure(SampleConfig(), sys.argv[1:] if argv is None else argv)
    cfg = check_config(cfg)
    keep_freed_memory(cfg.keep_freed_memory, cfg.device)
    prompt = read_prompt(cfg.start)
    model, tokenizer = load_model(cfg)
    result = sample(model, tokenizer, prompt, cfg)
    for text in result.texts:
        print(text)
        print(SEPARATOR, flush=True)
    log(
        f"tokens/s: {result.tokens_per_s:.1f} ({plural(result.new_tokens, 'new token')} in {result.seconds:.3f} s, "
        f"{plural(cfg.num_samples, 'sample')}, {cfg.device}, {cfg.dtype}"
        + (f", the window past block_size in {cfg.window_dtype})" if cfg.window_dtype else ")")
    )


if __name__ == "__main__":
    # at exit the interpreter's last collections walk every object left, the ~170k that the imports made (torch's)
    # among them: frozen just before, they are skipped (a one-token sample command: 1.4 -> 1.1 s, most of it
    # import torch). At exit only: a host that runs this file as __main__ (IPython's %run) keeps its collector.
    atexit.register(gc.freeze)
    exit_on_user_error(main)
