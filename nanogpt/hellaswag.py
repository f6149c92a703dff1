"""HellaSwag scored as build-nanogpt does ("completion style"): the context followed by each of 4 endings, the ending
the model finds most likely wins (acc: lowest total loss over its tokens; acc_norm: lowest mean, which does not favour
short endings). The examples, their tokens and the scoring over DDP ranks, for train.py's evals and hellaswag.py.
"""
from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from nanogpt import tokenizers
from nanogpt.distributed import Dist
from nanogpt.errors import UserError
from nanogpt.text import plural

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
CACHE = os.path.join(ROOT, "data", "hellaswag", "hellaswag_val.jsonl")
VAL_EXAMPLES = 10042
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
    if os.path.isdir(path):
        raise UserError(f"hellaswag path {path!r} is a folder, not a file: give a file of {FORMAT}, or None to "
                        f"download it")
    if not os.path.isfile(path):
        raise UserError(f"hellaswag path {path!r}: no such file; give a file of {FORMAT}, or None to download it")
    examples = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                examples.append(_parse(line, f"{path} line {n}"))
    if not examples:
        raise UserError(f"{path} holds no examples: expected {FORMAT}")
    return examples


def _parse(line: bytes, where: str) -> Example:
    try:
        d = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start}): expected {FORMAT}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not JSON ({e.msg}): expected {FORMAT}") from None
    except (ValueError, RecursionError) as e:  # a 5000-digit number, '[' nested past Python's limit
        raise UserError(f"{where} is not JSON that Python reads ({type(e).__name__}): expected {FORMAT}") from None
    if not (isinstance(d, dict) and isinstance(d.get("ctx"), str) and d["ctx"] and isinstance(d.get("endings"), list)
            and len(d["endings"]) == 4 and all(isinstance(e, str) for e in d["endings"])
            and type(d.get("label")) is int and 0 <= d["label"] < 4):
        raise UserError(f"{where} is not a HellaSwag example ({json.dumps(d)[:120]}): expected {FORMAT}")
    return Example(d["ctx"], d["endings"], d["label"])


def download(dest: str, url: str | None = None) -> None:
    """Fetch the validation set through a temporary file: no half-written copy is ever read."""
    url = url or URL
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tmp = f"{dest}.tmp.{os.getpid()}"  # per process: DDP ranks may download at once
    print(f"downloading HellaSwag validation from {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(tmp, "wb") as f:
            f.write(r.read())
        with open(tmp, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        if lines != VAL_EXAMPLES:
            raise UserError(f"{url} gave {plural(lines, 'example')}, not HellaSwag validation's {VAL_EXAMPLES}: try "
                            f"again later")
        os.replace(tmp, dest)
    except OSError as e:
        raise UserError(f"cannot download HellaSwag from {url} ({type(e).__name__}: {e}); check the network, or set "
                        f"the hellaswag path to a local copy of hellaswag_val.jsonl") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def encode(examples: list[Example], tokenizer: tokenizers.Tokenizer, block_size: int) -> list[Encoded]:
    """Per example: 4 token rows (context + " " + ending), each ending's token count, the label. A row keeps its last
    block_size tokens (the ending must fit whole)."""
    out = []
    for ex in examples:
        context = tokenizer.encode_ordinary(ex.context)
        endings = [tokenizer.encode_ordinary(" " + e) for e in ex.endings]
        if (longest := max(map(len, endings))) >= block_size:
            raise UserError(f"a HellaSwag ending has {longest} tokens: more than block_size={block_size} allows")
        out.append(([(context + e)[-block_size:] for e in endings], [len(e) for e in endings], ex.label))
    return out


@torch.no_grad()
def ending_losses(model, batch: list[Encoded], device: str, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """Total and mean loss over each ending's tokens, (N, 4) each, from one forward of the 4N rows right-padded
    (causal attention: padding after a row never changes its logits)."""
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
    """acc and acc_norm; under DDP each rank scores every world_size-th example and the counts are summed."""
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


def encoded_examples(path: str | None, meta: dict | None, block_size: int) -> list[Encoded]:
    """The examples encoded once for train.py's evals, with the dataset's tokenizer (meta None: GPT-2 BPE)."""
    tokenizer = tokenizers.get_tokenizer(meta) if meta is not None else tokenizers.gpt2_tokenizer()
    return encode(load_examples(path), tokenizer, block_size)
