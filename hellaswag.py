"""
HellaSwag accuracy of a checkpoint or of GPT-2's weights, scored as build-nanogpt does ("completion style"): each
example's context is followed by each of its 4 endings, and the ending whose tokens the model finds most likely
wins. acc: the lowest total loss over the ending's tokens; acc_norm: the lowest mean loss per token (it does not
favour short endings). train.py runs the same evaluation during training with hellaswag=True.

$ python hellaswag.py --init_from=gpt2       # build-nanogpt's figures for it: acc 0.2859, acc_norm 0.2955
$ python hellaswag.py --init_from=gpt2-xl    # acc 0.3842, acc_norm 0.4893
$ python hellaswag.py --out_dir=out-fineweb  # a training run's newest checkpoint (ckpt.pt or an FSDP sharded folder)
$ torchrun --standalone --nproc_per_node=8 hellaswag.py --init_from=gpt2-xl   # the examples split over 8 GPUs

The validation set (10,042 examples, 11 MB) is downloaded once to data/hellaswag/; `path=FILE` reads a local copy
or any file in its format: JSON lines with "ctx" (text), "endings" (4 texts) and "label" (0-3).

Config: the HellaSwagConfig defaults below, then config files and --key=value overrides in the order given.

Reads checkpoints through run_checkpoints.py; train.py imports this module, so it imports nothing from train.py or
sample.py.
"""
from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

import dataio
import run_checkpoints
from common import autocast_context, resolve_dtype
from errors import UserError, exit_on_user_error
from distributed import Dist, cleanup_distributed
from common import plural
from distributed import setup_distributed
from configurator import configure

ROOT = os.path.dirname(os.path.abspath(__file__))
URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE = os.path.join(ROOT, "data", "hellaswag", "hellaswag_val.jsonl")
VAL_EXAMPLES = 10042
# build-nanogpt's hellaswag.py on GPT-2's weights (completion style; EleutherAI's harness scores differently)
REFERENCE = {"gpt2": (0.2859, 0.2955), "gpt2-xl": (0.3842, 0.4893)}
FORMAT = 'JSON lines of {"ctx": text, "endings": [4 texts], "label": 0-3}'


Encoded = tuple[list[list[int]], list[int], int]  # an example's 4 token rows, its endings' token counts, its label


@dataclass
class Example:
    context: str
    endings: list[str]
    label: int


def load_examples(path: str | None = None) -> list[Example]:
    """The examples of a HellaSwag-format file; None: the validation set, downloaded to data/hellaswag/ once."""
    if path is None:
        if not os.path.isfile(CACHE):
            download(CACHE)
        path = CACHE
    if not os.path.isfile(path):
        raise UserError(f"hellaswag path {path!r}: no such file; give a file of {FORMAT}, or None to download it")
    examples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                examples.append(_parse(line, f"{path} line {n}"))
    if not examples:
        raise UserError(f"{path} holds no examples: expected {FORMAT}")
    return examples


def _parse(line: str, where: str) -> Example:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not JSON ({e.msg}): expected {FORMAT}") from None
    ok = (
        isinstance(d, dict) and isinstance(d.get("ctx"), str) and d["ctx"] and isinstance(d.get("endings"), list)
        and len(d["endings"]) == 4 and all(isinstance(e, str) for e in d["endings"])
        and type(d.get("label")) is int and 0 <= d["label"] < 4
    )
    if not ok:
        shown = json.dumps(d)[:120]
        raise UserError(f"{where} is not a HellaSwag example ({shown}): expected {FORMAT}")
    return Example(d["ctx"], d["endings"], d["label"])


def download(dest: str, url: str | None = None) -> None:
    """Fetch the validation set (from URL) to `dest`, through a temporary file: no half-written copy is ever read."""
    url = url or URL
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.tmp.{os.getpid()}"  # per process: DDP ranks may download at once
    print(f"downloading HellaSwag validation from {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            f.write(r.read())
        with open(tmp, encoding="utf-8") as f:
            lines = sum(1 for line in f if line.strip())
        if lines != VAL_EXAMPLES:
            raise UserError(f"{url} gave {plural(lines, 'example')}, not HellaSwag validation's {VAL_EXAMPLES}: try "
                            f"again later")
        os.replace(tmp, dest)
    except OSError as e:
        raise UserError(
            f"cannot download HellaSwag from {url} ({type(e).__name__}: {e}); check the network, or set the "
            f"hellaswag path to a local copy of hellaswag_val.jsonl"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def encode(examples: list[Example], tokenizer: dataio.Tokenizer, block_size: int) -> list[Encoded]:
    """Per example: the 4 token rows (context + " " + ending), how many tokens each row's ending has, and the label.
    A row longer than block_size keeps its last block_size tokens (the ending must fit whole)."""
    out = []
    for ex in examples:
        context = tokenizer.encode_ordinary(ex.context)
        endings = [tokenizer.encode_ordinary(" " + e) for e in ex.endings]
        if max(map(len, endings)) >= block_size:
            longest = max(map(len, endings))
            raise UserError(f"a HellaSwag ending has {longest} tokens: more than block_size={block_size} allows")
        out.append(([(context + e)[-block_size:] for e in endings], [len(e) for e in endings], ex.label))
    return out


@torch.no_grad()
def ending_losses(model, batch: list[Encoded], device: str, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Total and mean loss over each ending's tokens: two (N, 4) float32 tensors for N encoded examples, from one
    forward of their 4N rows, right-padded (causal attention: padding after a row never changes its logits)."""
    rows = [r for rows, _, _ in batch for r in rows]
    n_end = torch.tensor([n for _, ns, _ in batch for n in ns])  # (4N,)
    lengths = torch.tensor([len(r) for r in rows])
    T = int(lengths.max())
    tokens = torch.zeros(len(rows), T, dtype=torch.long)  # (4N, T)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    # the targets of position t are the tokens at t + 1; the ending's are the last n_end of each row
    pos = torch.arange(1, T)[None, :]  # (1, T - 1)
    ending = (pos >= (lengths - n_end)[:, None]) & (pos < lengths[:, None])  # (4N, T - 1)
    with ctx:
        logits, _ = model(tokens.to(device))  # (4N, T, vocab)
    losses = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1).to(device), reduction="none"
    ).view(len(rows), T - 1)  # (4N, T - 1)
    total = (losses * ending.to(device)).sum(1).cpu()  # (4N,)
    return total.view(-1, 4), (total / n_end).view(-1, 4)


def evaluate(model, encoded: list[Encoded], dist: Dist, ctx, examples_per_batch: int = 4) -> dict[str, float]:
    """acc and acc_norm over the encoded examples; under DDP each rank scores every world_size-th example and the
    counts are summed over ranks."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64)  # right by total loss, right by mean loss, examples
    mine = encoded[dist.rank :: dist.world_size]
    for i in range(0, len(mine), examples_per_batch):
        batch = mine[i : i + examples_per_batch]
        total, mean = ending_losses(model, batch, dist.device, ctx)
        labels = torch.tensor([label for _, _, label in batch])
        right = [(losses.argmin(1) == labels).sum().item() for losses in (total, mean)]
        counts += torch.tensor([*right, len(batch)], dtype=torch.float64)
    if dist.enabled:
        counts = counts.to(dist.device)
        torch_dist.all_reduce(counts)
        counts = counts.cpu()
    model.train(was_training)
    right, right_norm, n = counts.tolist()
    return {"hellaswag_acc": right / n, "hellaswag_acc_norm": right_norm / n, "hellaswag_n": int(n)}


def describe(result: dict[str, float]) -> str:
    acc, acc_norm, n = result["hellaswag_acc"], result["hellaswag_acc_norm"], result["hellaswag_n"]
    return f"HellaSwag acc {acc:.4f}, acc_norm {acc_norm:.4f} ({plural(n, 'example')})"


# ----------------------------------------------------------------------------------------------- the script


@dataclass
class HellaSwagConfig:
    init_from: str = "resume"  # "resume" (a checkpoint in out_dir), "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", a
    # HF folder, or a checkpoint file or sharded folder
    out_dir: str = "out"  # with init_from=resume: the training run's folder
    ckpt: str | None = None  # with init_from=resume: a checkpoint in out_dir (None: the newest of ckpt.pt and
    # ckpt_sharded, by iteration; ckpt_best.pt or ckpt_sharded_best: the best val loss's weights, if kept)
    path: str | None = None  # a HellaSwag-format file; None: the validation set, downloaded to data/hellaswag/
    max_examples: int = 0  # score only the first this many examples (0: all)
    device: str = "auto"  # "auto", "cpu", "cuda", ... (under torchrun: each rank's GPU)
    dtype: str = "auto"  # "auto" (bf16 on a GPU that has it, float32 on the CPU), "float32", "bfloat16", "float16"


def main(argv: list[str] | None = None) -> dict[str, float]:
    cfg = configure(HellaSwagConfig(), sys.argv[1:] if argv is None else argv)
    if cfg.max_examples < 0:
        raise UserError(f"max_examples={cfg.max_examples} must be >= 0 (0: all)")
    dist = setup_distributed(cfg.device)
    finished = False
    try:
        dtype = resolve_dtype(cfg.dtype, dist.device, training=False)
        examples = load_examples(cfg.path)[: cfg.max_examples or None]
        log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if dist.master else (lambda msg: None)
        model, tokenizer = run_checkpoints.load_for_inference(cfg.init_from, cfg.out_dir, cfg.ckpt, dist.device, dtype, {},
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
