"""The run report: at the end of a train.py run, out_dir/report.md says in one page what ran and what came of it: the
command line, the machine, the settings that differ from the defaults, tokens/s and MFU, the loss picture (when
matplotlib is installed), the best val loss, HellaSwag when it was scored, and a short sample from the final weights."""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from dataclasses import fields
from typing import Any, Callable

import torch

from nanogpt import engine, files, plot, tokenizers
from nanogpt.config import TrainConfig
from nanogpt.mfu import mfu_text
from nanogpt.errors import UserError
from nanogpt.metrics import read_metrics
from nanogpt.outdir import LOSS_PNG, REPORT


def config_differences(cfg, defaults) -> list[tuple[str, Any, Any]]:
    """(key, value, default) for every setting of `cfg` that differs from the dataclass defaults."""
    return [(f.name, getattr(cfg, f.name), getattr(defaults, f.name)) for f in fields(cfg)
            if getattr(cfg, f.name) != getattr(defaults, f.name)]


def sample_text(model, tokenizer: tokenizers.Tokenizer, device: str, ctx=contextlib.nullcontext(), n_tokens: int = 200,
                seed: int = 1337) -> str:
    """A short sample from the final weights (temperature 0.8, top-k 200, as sample.py's defaults), under the run's
    autocast context `ctx`: the attention kernel the run chose may not run outside it (flash in float32 on a GPU)."""
    start = [tokenizer.eot] if tokenizer.eot is not None else tokenizer.encode("\n")
    was_training = model.training
    model.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad(), ctx:
        x = torch.tensor([start], dtype=torch.long, device=device)
        y = engine.generate(model, x, n_tokens, temperature=0.8, top_k=200, generator=generator,
                           vocab_size=tokenizer.vocab_size)
    model.train(was_training)
    return tokenizer.decode(y[0, len(start):].tolist())


def write_report(out_dir: str, cfg, defaults, info: dict[str, str], sample: str | None) -> str:
    """Write out_dir/report.md (and loss.png beside it); returns the report's path. `info`: the run's machine and
    versions (hardware.system_info) and world size."""
    run = read_metrics(out_dir)  # once: a damaged line is warned of once
    steps, evals, starts = run
    lines = [f"# Run report: {os.path.basename(os.path.normpath(out_dir))}", ""]
    lines += [f"- command: `{' '.join(['python', *sys.argv])}`",
              f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
              f"- machine: {info.get('device_name')} ({info.get('device')}, {info.get('threads')} threads, "
              f"{info.get('world_size')} rank(s)); torch {info.get('torch')}, python {info.get('python')}, "
              f"commit {info.get('git_commit')}"]
    diffs = config_differences(cfg, defaults)
    lines += ["", "## Settings (those that differ from the defaults)", ""]
    lines += ["| key | value | default |", "|:--|:--|:--|"] + [f"| {k} | `{v!r}` | `{d!r}` |" for k, v, d in diffs]
    lines += ["", "## Results", ""]
    if steps:
        last = steps[-1]
        timed = steps[1:] or steps  # the first logged step holds warm-up (compile)
        tok_s = [r["tok_s"] for r in timed]
        mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
        lines.append(f"- {last['iter']} iterations in {last['elapsed_s']:.0f} s of wall time (evals included), in "
                     f"{len(starts) or 1} start{'s' if len(starts) > 1 else ''}")
        mfu = f", MFU {mfu_text(statistics.median(mfus))}" if mfus else "; MFU n/a"
        lines.append(f"- speed: {statistics.median(tok_s):,.0f} tokens/s (median of the logged steps after the "
                     f"first){mfu}")
    if evals:
        best = min(evals, key=lambda r: r["val_loss"])
        final = evals[-1]
        lines.append(f"- best val loss: {best['val_loss']:.4f} at iter {best['iter']} (final: train "
                     f"{final['train_loss']:.4f}, val {final['val_loss']:.4f} at iter {final['iter']})")
        scored = [r for r in evals if "hellaswag_acc" in r]
        if scored:
            h = scored[-1]
            lines.append(f"- HellaSwag at iter {h['iter']}: acc {h['hellaswag_acc']:.4f}, acc_norm "
                         f"{h['hellaswag_acc_norm']:.4f} ({h.get('hellaswag_n', '?')} examples)")
    if len(starts) > 1:
        lines += ["", "## Starts", "", "| at iter | how | settings changed | command |", "|:--|:--|:--|:--|"]
        lines += [f"| {st['iter']} | {st['init_from']} | {'; '.join(st.get('changes') or []) or '-'} | "
                  f"`{st['command']}` |" for st in starts]
    lines += ["", "## Loss", ""]
    try:
        plot.draw([(os.path.basename(os.path.normpath(out_dir)), run)], os.path.join(out_dir, LOSS_PNG))
        lines.append(f"![train and val loss against steps and wall time]({LOSS_PNG})")
    except UserError as e:  # matplotlib is optional: the report goes without the picture
        lines.append(f"(no picture: {e}; then `python plot.py {out_dir}`)")
    if sample is not None:
        lines += ["", "## A sample from the final weights", "", "```text", sample.strip("\n"), "```"]
    path = os.path.join(out_dir, REPORT)
    files.write_text(path, "\n".join(lines) + "\n", "report")
    return path


def write_run_report(cfg: TrainConfig, model, meta: dict | None, info: dict[str, str], log: Callable[[str], None],
                     ctx=contextlib.nullcontext()) -> str | None:
    """out_dir/report.md at the end of a run, with a sample in the dataset's tokenizer (`meta`; None: GPT-2 BPE), none
    under FSDP (a rank alone cannot run the sharded model). A report that cannot be written is a warning, never the
    run's failure: the run is done and saved. Returns the report's path, or None."""
    sample = None
    if cfg.parallelism != "fsdp":
        try:
            tokenizer = tokenizers.get_tokenizer(meta) if meta is not None else tokenizers.gpt2_tokenizer()
            sample = sample_text(model, tokenizer, info["device"], ctx)
        except UserError as e:  # e.g. no GPT-2 BPE files offline: the report goes without a sample
            log(f"report: no sample ({e})")
    try:
        path = write_report(cfg.out_dir, cfg, TrainConfig(), info, sample)
    except (UserError, OSError) as e:
        print(f"warning: no report ({e}); the run and its checkpoint are whole", file=sys.stderr, flush=True)
        return None
    except Exception as e:  # noqa: BLE001 a library's failure on some content: the run is done and saved all the same
        print(f"warning: no report ({type(e).__name__}: {e}); the run and its checkpoint are whole; "
              f"`python plot.py {cfg.out_dir}` may say more", file=sys.stderr, flush=True)
        return None
    log(f"report: {path}")
    return path
