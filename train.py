"""
Train a GPT: from scratch, from a checkpoint (resume), or from GPT-2 weights (fine-tuning).

One process (a GPU, or the CPU):
$ python train.py config/train_shakespeare_char_cpu.py
$ python train.py config/train_gpt2.py --batch_size=8 --compile=False

DDP on one node with 8 GPUs (gloo on the CPU: add --device=cpu):
$ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

DDP on 2 nodes of 8 GPUs (run on each node, with its own --node_rank; the master's address and a free port):
$ torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py ...
(If your cluster has no Infiniband, prepend NCCL_IB_DISABLE=1.)

FSDP instead of DDP, for models whose weights, gradients and AdamW state do not fit one GPU (see parallel.py):
$ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_xl_fsdp.py

Config: the TrainConfig defaults below, then config files and --key=value overrides in the order given.

A run, top to bottom: train() holds out_dir (outdir.hold) and decides the start once (decide_start: resume or not);
start_run() does the start (settings, data, log, model, optimizer, compile, DDP) and accepts it only once every
check has passed; Loop.iterate() runs the iterations (evaluate and save, one step, log), RunSaves says when a save is
due and writes it, and Loop.end() writes the report. The training step itself (StepConfig, the batches, train_step)
is step.py's, which bench.py shares; nothing but the tests imports train.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Callable, NoReturn

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nanogpt import checkpoint
from nanogpt import dataio
from nanogpt.hf_gpt2 import pretrained_gpt2
from nanogpt import float8
from nanogpt import hellaswag
from nanogpt import parallel
from nanogpt import report
from nanogpt import checkpoint_manager
from nanogpt import outdir
from nanogpt.metrics import Logger, wandb_problem
from nanogpt.checkpoint import checkpoint_model_config
from nanogpt.device import dtype_reason, resolve_attention
from nanogpt.mfu import mfu_text, run_peak_flops
from nanogpt.text import plural
from nanogpt.hardware import run_info
from nanogpt.errors import UserError, exit_on_user_error
from nanogpt.hardware import check_attention_kernel
from nanogpt.distributed import (
    DDP_SETTINGS,
    Dist,
    Stopped,
    StopRequest,
    check_shared_out_dir,
    checkpoint_group,
    cleanup_distributed,
    setup_distributed,
    torchrun_job,
)
from configurator import config_summary, configure_keys
from model import GPT
from nanogpt.optim import Optimizers
from nanogpt.step import (
    MODEL_KEYS,
    NonFiniteGuard,
    OneStepLate,
    StepConfig,
    StepInterrupted,
    batch_generator,
    compile_model,
    data_paths,
    get_batch,
    model_config,
    model_settings,
    optimizer_and_scaler,
    setup_device,
    to_device,
    train_batches,
    train_step,
)



@dataclass
class TrainConfig(StepConfig):
    # I/O
    out_dir: str = "out"
    eval_interval: int = 2000
    log_interval: int = 1
    eval_iters: int = 200
    eval_only: bool = False  # evaluate once and exit
    always_save_checkpoint: bool = True  # else save only when the val loss improves
    init_from: str = "scratch"  # "scratch", "resume" (out_dir's newest checkpoint), "auto" (resume if out_dir holds a
    # checkpoint, else scratch), "gpt2", "gpt2-medium", ... a HF folder, or a checkpoint (this repo's or nanoGPT's
    # ckpt.pt, or a sharded folder) whose weights start a new run. A new run moves an earlier one aside (outdir.py)
    keep_last: int = 0  # also keep the last K checkpoints as ckpt_<iter>.pt (0: only ckpt.pt)
    checkpoint_interval: int = 0  # also save every this many iterations between evals (0: at evals only): a hard kill
    # (no SIGTERM) loses at most this many
    checkpoint_minutes: float = 0.0  # also save once this many minutes passed since the last save (0: off)
    async_save: bool = False  # FSDP: write the shards in the background while training goes on (DCP's async_save);
    # the last save and a stop's are written before the run ends
    report: bool = True  # at the end, write out_dir/report.md: command, machine, settings, speed, losses, a sample

    # logging
    wandb_log: bool = False
    wandb_project: str = "owt"
    wandb_run_name: str = "gpt2"
    hellaswag: bool = False  # also score HellaSwag (acc, acc_norm; see hellaswag.py) at evals
    hellaswag_interval: int = 0  # ... only every this many steps, a multiple of eval_interval (0: at every eval)
    hellaswag_path: str | None = None  # a HellaSwag-format file; None: the validation set, downloaded once

    # learning rate schedule: linear warmup, then cosine decay to min_lr
    max_iters: int = 600000  # optimizer steps
    decay_lr: bool = True
    warmup_iters: int = 2000
    lr_decay_iters: int | None = None  # None: max_iters (~ Chinchilla: about max_iters)
    min_lr: float = 6e-5  # ~ learning_rate / 10

    # non-finite losses or gradient norms (float16 leaves them to its grad scaler)
    max_nonfinite_skips: int = 0  # skip up to this many such steps per run; past that, stop with an error

    # system
    backend: str = "auto"  # DDP: "nccl" on CUDA, "gloo" on the CPU
    parallelism: str = "ddp"  # "ddp": a full copy per rank; "fsdp": parameters, grads, AdamW state sharded (FSDP2)
    activation_checkpointing: bool | int = False  # recompute blocks' activations in the backward: True, or N blocks

    def problems(self, world_size: int) -> list[str]:
        cfg = self
        problems = super().problems(world_size)
        for key in ("eval_iters", "log_interval", "eval_interval"):
            if getattr(cfg, key) < 1:
                problems.append(f"{key}={getattr(cfg, key)} must be at least 1")
        if cfg.max_iters < 0:
            problems.append(f"max_iters={cfg.max_iters} must be >= 0")
        if cfg.checkpoint_interval < 0 or cfg.checkpoint_minutes < 0:
            problems.append(f"checkpoint_interval={cfg.checkpoint_interval} and checkpoint_minutes="
                            f"{cfg.checkpoint_minutes} must be >= 0 (0: save at evals only)")
        if cfg.async_save and cfg.parallelism != "fsdp":
            problems.append(f"async_save=True writes FSDP's sharded checkpoints, and parallelism={cfg.parallelism!r} "
                            f"saves one file: set parallelism='fsdp' or async_save=False")
        if cfg.init_from not in ("scratch", "resume", "auto", *GPT2_NAMES) and not os.path.exists(cfg.init_from):
            problems.append(
                f"init_from={cfg.init_from!r} is not one of scratch, resume, auto, {', '.join(GPT2_NAMES)}, a folder with "
                f"a HF GPT-2 model, a checkpoint file or sharded folder, or a run's out_dir"
            )
        if cfg.hellaswag_interval < 0 or (cfg.eval_interval > 0 and cfg.hellaswag_interval % cfg.eval_interval):
            problems.append(f"hellaswag_interval={cfg.hellaswag_interval} must be 0 or a multiple of eval_interval="
                            f"{cfg.eval_interval} (HellaSwag runs at evals)")
        if (wandb := wandb_problem(cfg)) is not None:
            problems.append(wandb)
        problems += parallel.config_problems(cfg)
        if cfg.optimizer == "muon" and cfg.parallelism == "fsdp":  # a rank holds shards, Muon needs whole matrices
            problems.append("optimizer='muon' needs whole matrices, and parallelism='fsdp' shards them: use ddp")
        return problems

    def check(self, world_size: int) -> None:
        """Raise one UserError that names every problem of this config for a run of world_size ranks."""
        if problems := self.problems(world_size):
            raise UserError("; ".join(problems))


GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# ----------------------------------------------------------------------------------------------- schedule


def get_lr(it: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_iters (the first step's LR is not zero), cosine decay to min_lr at
    lr_decay_iters, min_lr after. `it` counts optimizer steps from 0."""
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters if cfg.lr_decay_iters is not None else cfg.max_iters
    if it >= decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


# ----------------------------------------------------------------------------------------------- steps


@torch.no_grad()
def estimate_loss(
    model, cfg: TrainConfig, splits: dict[str, dataio.TokenSplit], dist: Dist, ctx,
    stopping: Callable[[], bool] = lambda: False,
) -> dict[str, float]:
    """Mean loss over eval_iters fixed batches per split (the same batches at every eval, so evals compare);
    under DDP the ranks share the batches and average them. Once `stopping()` (this rank's signal flag, no
    collective) is true the eval is cut short, since the run is about to stop and its figures will not be used;
    not under FSDP, whose forward passes are collectives that every rank must run alike."""
    model.eval()
    out = {}
    may_cut = cfg.parallelism != "fsdp"
    for split in ("train", "val"):
        total = torch.zeros(2, device=dist.device)  # loss sum, batches
        for k, counted in parallel.eval_batch_indices(cfg.eval_iters, dist, cfg.parallelism == "fsdp"):
            if may_cut and stopping():
                break
            gen = batch_generator(cfg.seed, f"eval_{split}", 0, k)
            x, y = get_batch(splits[split], cfg.batch_size, cfg.block_size, gen)
            with ctx:
                _, loss = model(to_device(x, dist.device), to_device(y, dist.device), return_logits=False)
            total += torch.stack([loss.float(), torch.ones((), device=dist.device)]) * counted
        if dist.enabled:
            torch_dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


class NonFiniteError(UserError):
    pass


class StepReports:
    """What the loop does with each step's figures once they are read (step.OneStepLate: one step late, so reading
    never holds the device back): stop the run once more than max_nonfinite_skips steps had a non-finite loss or
    gradient norm, warn of each such skipped step, and every log_interval steps log the loss, learning rate, the
    step's time on the device's timeline, tokens/s, MFU and gradient norm."""

    def __init__(self, cfg: TrainConfig, log: Logger, model: GPT, tokens_per_iter: int, accum_steps: int,
                 peak_flops: float | None, scaler_enabled: bool):
        self.cfg, self.log, self.model, self.scaler_enabled = cfg, log, model, scaler_enabled
        self.tokens_per_iter, self.accum_steps, self.peak_flops = tokens_per_iter, accum_steps, peak_flops
        self.running_mfu = -1.0
        self.last_loss = float("nan")

    def report(self, read: tuple | None) -> None:
        """read: ((iteration, learning rate), StepFigures, ms) of one step, or None."""
        if read is None:
            return
        (it, lr), f, ms = read
        dt = ms / 1000
        cfg = self.cfg
        if not f.applied and not (self.scaler_enabled and math.isfinite(f.loss)):  # float16 overflow: the scaler's
            what = "loss" if not math.isfinite(f.loss) else "gradient norm"
            if f.nonfinite_skips > cfg.max_nonfinite_skips:
                raise NonFiniteError(
                    f"non-finite {what} at iter {it} (loss {f.loss}, grad norm {f.grad_norm}); the step was not "
                    f"applied and the last checkpoint is intact: lower learning_rate, or set max_nonfinite_skips"
                )
            self.log.print(f"warning: non-finite {what} at iter {it}: step skipped ({f.nonfinite_skips} so far)")
        self.last_loss = f.loss
        if (it + 1) % cfg.log_interval:
            return
        mfu = self.model.estimate_mfu(cfg.batch_size * self.accum_steps, dt, self.peak_flops, cfg.block_size)  # per rank
        if mfu is not None:
            self.running_mfu = mfu if self.running_mfu < 0 else 0.9 * self.running_mfu + 0.1 * mfu
        self.log.print(
            f"iter {it + 1}: loss {f.loss:.4f}, lr {lr:.2e}, time {ms:.2f}ms, "
            f"{self.tokens_per_iter / dt:,.0f} tok/s, mfu {mfu_text(self.running_mfu if self.running_mfu >= 0 else None)}, "
            f"grad norm {f.grad_norm:.3f}"
        )
        self.log.metrics({"iter": it + 1, "loss": f.loss, "lr": lr, "ms": ms, "tok_s": self.tokens_per_iter / dt,
                          "mfu": mfu, "grad_norm": f.grad_norm})


# ----------------------------------------------------------------------------------------------- the run


def init_model(cfg: TrainConfig, meta: dict | None, ckpt: dict | None) -> GPT:
    """The model for init_from: a fresh GPT sized by the config and the dataset's vocabulary, the checkpoint's,
    or GPT-2's weights (cropped to block_size)."""
    settings = model_settings(cfg)
    if cfg.init_from == "scratch":
        if meta is None:
            raise UserError(f"init_from=scratch needs the dataset's meta.json (vocab_size) in {data_paths(cfg)}")
        return GPT(model_config(cfg, meta["vocab_size"]))
    if cfg.init_from == "resume":
        # every weight is the checkpoint's: here for ckpt.pt, a sharded checkpoint's once the model is sharded
        model = GPT.uninitialized(checkpoint_model_config(ckpt["model_args"], **settings))
        if "model" in ckpt:
            checkpoint.load_model_state(model, ckpt["model"], source=os.path.join(cfg.out_dir, checkpoint.CKPT_NAME))
        return model
    path = checkpoint_manager.checkpoint_path(cfg.init_from)
    if path is not None:  # a checkpoint's weights (not its optimizer or iteration) start this run
        return fit_pretrained(checkpoint.model_from_checkpoint(checkpoint_manager.read_weights(path), **settings), cfg)
    if cfg.init_from in GPT2_NAMES or os.path.isdir(cfg.init_from):
        model = pretrained_gpt2(cfg.init_from, settings, vocab_padding_multiple=cfg.vocab_padding_multiple)
        return fit_pretrained(model, cfg)
    raise UserError(
        f"init_from={cfg.init_from!r} is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl, "
        f"a folder with a HF GPT-2 model, a checkpoint file or sharded folder, or a run's out_dir"
    )


SHAPE_KEYS = ("n_layer", "n_head", "n_embd")


def fit_pretrained(model: GPT, cfg: TrainConfig) -> GPT:
    """Pretrained weights for a new run: their shape and GELU must be the configured ones where the config sets them,
    and their context is cropped to block_size."""
    defaults = TrainConfig()
    wrong = [f"{k}={getattr(cfg, k)} (the weights have {getattr(model.config, k)})" for k in SHAPE_KEYS
             if getattr(cfg, k) not in (getattr(defaults, k), getattr(model.config, k))]
    if wrong:
        raise UserError(f"init_from={cfg.init_from!r}: {', '.join(wrong)}: the model's shape is its weights'; remove "
                        f"{'these settings' if len(wrong) > 1 else 'this setting'}")
    if cfg.gelu is not None and cfg.gelu != model.config.gelu:
        raise UserError(
            f"gelu={cfg.gelu!r} does not match the weights of {cfg.init_from!r}, which were trained with "
            f"gelu={model.config.gelu!r}: remove the gelu setting"
        )
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    return model




@dataclass
class Start:
    """What a start does, decided once from out_dir as it is, before anything is printed or changed there."""
    cfg: TrainConfig  # init_from resolved ("auto", a torchrun restart), a resume's settings of its run taken
    notes: list[str]  # why, and the settings taken: printed once the log is open
    found: checkpoint_manager.Found | None  # the checkpoint a resume continues: one of the run in out_dir
    job: str | None  # torchrun's job (distributed.torchrun_job), recorded in run.json


def decide_start(cfg: TrainConfig, given: set[str] | None = None) -> Start:
    """Resume or not, and from which checkpoint, before anything is printed: a resume's checkpoint is found (one of
    the run in out_dir, else a UserError) before its line is, so that no start announces a resume it then refuses.
    A resume takes its run's own setting for every key not `given` (on the command line or in a config file; None:
    every key given)."""
    if not cfg.eval_only:
        outdir.read_run(cfg.out_dir)  # a damaged run.json: one line now, not once the start is accepted
    job = torchrun_job()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    init_from, why = outdir.resolve_init_from(cfg.init_from, cfg.out_dir, restart, job)
    cfg = replace(cfg, init_from=init_from)
    notes = [why] if why else []
    if init_from != "resume":
        return Start(cfg, notes, None, job)
    found = checkpoint_manager.find_checkpoint(cfg.out_dir)
    if given is not None:
        cfg, taken = outdir.settings_of_the_run(cfg, given, found.read().get("config") or {})
        if taken:
            notes.append(f"resuming the run's settings (not given here): {', '.join(taken)}")
    if cfg.parallelism == "fsdp":  # a file and a sharded folder at the same iteration: FSDP reads the folder
        found = checkpoint_manager.find_checkpoint(cfg.out_dir, prefer_sharded=True)
    return Start(cfg, notes, found, job)


def accept_start(out_dir: str, resuming: bool, resumed_run_id: str | None, job: str | None, dist: Dist,
                 log: Logger) -> str | None:
    """The start is accepted, once every check passed on every rank (a refused start changed nothing in out_dir): a
    new run moves the one there aside whole and writes its run.json; a resume keeps its run's. Rank 0 alone, and only
    for a start that saves (one that evaluates only changes nothing there); returns the run's id (None on the other
    ranks)."""
    if not dist.master:
        return None
    if resuming:
        return outdir.continue_run(out_dir, resumed_run_id, job)
    if moved := outdir.move_previous_run(out_dir):
        log.print(f"a new run in {out_dir}: the previous run's files ({outdir.size_text(outdir.disk_usage(moved))}) "
                  f"moved to {moved} (it resumes from there with --out_dir={moved}; {outdir.PREVIOUS}/ keeps every run "
                  f"moved aside, whole: remove those you no longer need)")
    return outdir.begin_run(out_dir, job)


def write_report(cfg: TrainConfig, model: GPT, meta: dict | None, info: dict[str, str], log: Logger, ctx) -> None:
    """out_dir/report.md at the end of the run (report.py). A report that cannot be written is a warning, never the
    run's failure: the run is done and saved."""
    try:
        log.print(f"report: {report.write_run_report(cfg, TrainConfig(), model, meta, info, log.print, ctx)}")
    except (UserError, OSError) as e:
        print(f"warning: no report ({e}); the run and its checkpoint are whole", file=sys.stderr, flush=True)


def train(cfg: TrainConfig, given: set[str] | None = None) -> dict:
    """Run the training that `cfg` describes; returns the final figures (for tests and scripts) and the model, unless
    sharded: FSDP's shards need the process group, which the end of the run destroys. `given`: the keys the user
    set (a resume takes its run's setting for every other key; None: every key given)."""
    # rank 0 holds out_dir for every rank of the job, from before the decision to the end (a start that saves nothing
    # holds nothing); every rank decides before rank 0 moves any file
    with outdir.hold(cfg.out_dir, enabled=not cfg.eval_only and int(os.environ.get("RANK", "0")) == 0):
        return _run(decide_start(cfg, given))


def _run(start: Start) -> dict:
    cfg = start.cfg
    dist = setup_distributed(cfg.device, cfg.backend, group_of_one=cfg.parallelism == "fsdp")
    stopped = None
    try:
        result = _train(start, dist)  # what holds the group (the DDP wrapper, the sharded model) goes with its locals
    except Stopped as e:
        stopped = Stopped(e.message, e.code)  # a new one: e's traceback holds the run's frames, and so the group
    except BaseException:
        cleanup_distributed(dist)  # no barrier: after an error the other ranks may never get there
        raise
    else:
        if cfg.parallelism == "fsdp":
            result["model"] = None
    cleanup_distributed(dist, barrier=True)  # every rank gets here, the last save done: the end, or the same stop
    if stopped is not None:
        raise stopped
    return result


def _train(start: Start, dist: Dist) -> dict:
    run = start_run(start, dist)
    with StopRequest(dist) as stop, contextlib.ExitStack() as on_exit:
        loop = Loop(run, stop)
        on_exit.callback(loop.saves.finish)  # a save written in the background is linked before the run ends, however
        loop.iterate()
        return loop.end()


# ----------------------------------------------------------------------------------------------- the start


@dataclass
class Run:
    """A started run: what its iterations need, made once by start_run."""
    cfg: TrainConfig  # as it trains: attention resolved, the weights' shape
    saved_cfg: TrainConfig  # what a checkpoint records: "auto" settings stay "auto", resolved again where it resumes
    dist: Dist
    ctx: AbstractContextManager  # autocast
    log: Logger
    meta: dict | None  # the dataset's meta.json (None for GPT-2's weights on data without one)
    splits: dict[str, dataio.TokenSplit]
    hellaswag_examples: list | None
    raw_model: GPT  # what checkpoints save and HellaSwag evaluates
    model: torch.nn.Module  # what trains: compiled, DDP's wrapper
    eval_model: torch.nn.Module  # what evaluates: compiled, without DDP's gradient sync
    optimizer: Optimizers
    scaler: torch.amp.GradScaler
    iter_num: int
    best_val_loss: float
    best_file: str | None  # which file holds the best weights (always_save_checkpoint=False)
    eval_only: bool  # evaluate once and save nothing (eval_only, or a resume with nothing left to train)
    run_id: str | None  # run.json's (rank 0 of a start that saves)
    accum_steps: int  # micro-steps per rank
    tokens_per_iter: int
    peak_flops: float | None


@dataclass
class Resumed:
    """What a resume continues from: the checkpoint, its iteration and best val loss, what changed since."""
    ckpt: dict | None = None
    iter_num: int = 0
    best_val_loss: float = float("inf")
    changes: list[str] | None = None


def start_run(start: Start, dist: Dist) -> Run:
    """
    The start, in the order that keeps out_dir untouched until every check has passed on every rank: the settings and
    the device, the data, the log's header, the checkpoint a resume continues, the model, its optimizer, compile and
    DDP; only then is the start accepted (run_dir: the run in out_dir moved aside, run.json written).
    """
    cfg = start.cfg
    cfg.check(dist.world_size)
    config_line = config_summary(cfg)  # what was set, before "auto" settings are resolved
    dtype, ctx, kept_memory = setup_device(cfg, dist.device, dist.rank)
    attention, attention_why = resolve_attention(cfg.attention, dist.device, dtype)
    saved_cfg, cfg = cfg, replace(cfg, attention=attention)  # the model's config records the path that ran
    accum_steps = cfg.gradient_accumulation_steps // dist.world_size  # per rank
    tokens_per_iter = accum_steps * dist.world_size * cfg.batch_size * cfg.block_size
    data_dir, meta, data_vocab = check_data(cfg)
    if dist.enabled:
        torch_dist.barrier()  # every rank has resolved init_from from out_dir as it was
    log = Logger(cfg, dist)
    for line in (config_line, *start.notes, " ".join(f"{k}={v}" for k, v in {
            **run_info(dist.device), "dtype": dtype, "world_size": dist.world_size}.items()),
            f"defaults: dtype={dtype} ({dtype_reason(cfg.dtype, dist.device)}); attention={attention} ({attention_why})"):
        log.print(line)
    peak_flops, peak_source = run_peak_flops(dist.device, dtype, cfg.peak_flops)
    log.print(f"MFU peak: {f'{peak_flops / 1e12:.3f} TFLOP/s' if peak_flops else 'n/a'} ({peak_source})")
    log.print(f"tokens per iteration: {tokens_per_iter:,} ({plural(accum_steps, 'micro-step')} x "
              f"{plural(dist.world_size, 'rank')} x {cfg.batch_size} x {cfg.block_size})")
    if kept_memory:
        log.print("malloc: glibc keeps freed memory (keep_freed_memory=True)")

    if not cfg.eval_only or cfg.init_from == "resume":  # what the ranks read there, or rank 0 writes
        check_shared_out_dir(cfg.out_dir, dist)
    resumed = read_resumed(start, cfg, dist, log)
    nothing_to_train = resumed.ckpt is not None and resumed.iter_num >= cfg.max_iters
    if nothing_to_train:
        log.print(f"nothing to train: the checkpoint is at iter {resumed.iter_num} and max_iters={cfg.max_iters}; "
                  f"evaluating it only (raise max_iters to train on)")
    raw_model = load_model(cfg, meta, resumed.ckpt)
    shape = {k: getattr(raw_model.config, k) for k in SHAPE_KEYS}  # the shape that trains: checkpoint, report
    cfg, saved_cfg = replace(cfg, **shape), replace(saved_cfg, **shape)
    weights_vocab = None if data_vocab is not None else raw_model.config.vocab_size  # ids not yet checked
    splits = {s: dataio.open_split(data_dir, s, weights_vocab, meta) for s in ("train", "val")}
    hellaswag_examples = None
    if cfg.hellaswag:  # encoded once, with the dataset's tokenizer (GPT-2 BPE for GPT-2's weights without one)
        tokenizer = dataio.get_tokenizer(meta) if meta is not None else dataio.gpt2_tokenizer()
        hellaswag_examples = hellaswag.encode(hellaswag.load_examples(cfg.hellaswag_path), tokenizer, cfg.block_size)
    raw_model = place_model(raw_model, cfg, dist, dtype, ctx, log)
    log.print(f"model: {raw_model.get_num_params() / 1e6:.2f}M parameters, {raw_model.config}")
    log.print(parallel.memory_text(parallel.memory_per_rank(raw_model, accum_steps), dist.world_size))

    optimizer, scaler = optimizer_and_scaler(raw_model, cfg, dist.device, dtype, verbose=dist.master)
    ckpt = resumed.ckpt
    if ckpt is not None:
        checkpoint_manager.load_training_state(raw_model, optimizer, ckpt)
        if scaler.is_enabled() and ckpt.get("scaler"):  # absent when the run was not float16 (or from nanoGPT)
            scaler.load_state_dict(ckpt["scaler"])
        checkpoint.restore_rng(ckpt, cfg.seed, dist, resumed.iter_num)
    model, eval_model = compile_and_wrap(raw_model, cfg, dist, log)

    if dist.enabled:
        torch_dist.barrier()  # every rank passed every check: none refuses the start once rank 0 accepted it
    eval_only = cfg.eval_only or nothing_to_train  # evaluate once, save nothing: change nothing in out_dir
    run_id = None if eval_only else accept_start(cfg.out_dir, ckpt is not None, ckpt and ckpt.get("run_id"),
                                                 start.job, dist, log)
    log.start(run_id, resumed.iter_num, cfg.init_from, resumed.changes, saves=not eval_only)
    return Run(cfg, saved_cfg, dist, ctx, log, meta, splits, hellaswag_examples, raw_model, model, eval_model,
               optimizer, scaler, resumed.iter_num, resumed.best_val_loss, ckpt and ckpt.get("best_file"), eval_only,
               run_id, accum_steps, tokens_per_iter, peak_flops)


def check_data(cfg: TrainConfig) -> tuple[str, dict | None, int | None]:
    """The dataset's folder, its meta.json and the vocabulary its ids are checked against now: checked once up front,
    so a missing file or an id beyond the vocabulary fails before any training, and before out_dir or its metrics
    are touched. The ids are checked here against the dataset's own vocabulary (scratch); against other weights'
    (GPT-2's, a checkpoint's) once those are read (None here)."""
    data_dir = data_paths(cfg)
    meta = dataio.load_meta(data_dir) if cfg.init_from == "scratch" else dataio.find_meta(data_dir)
    data_vocab = meta["vocab_size"] if cfg.init_from == "scratch" else None
    for split in ("train", "val"):  # before the model is built (or downloaded, or compiled): seconds, not minutes
        dataio.open_split(data_dir, split, data_vocab, meta).check_window(cfg.block_size)
    return data_dir, meta, data_vocab


def read_resumed(start: Start, cfg: TrainConfig, dist: Dist, log: Logger) -> Resumed:
    """The checkpoint a resume continues from (read, its changed settings printed), or nothing to resume."""
    if start.found is None:
        return Resumed()
    log.print(start.found.describe("resuming from"))
    ckpt = start.found.read()
    saved_gelu = checkpoint_model_config(ckpt["model_args"]).gelu
    changes = outdir.resume_changes(ckpt["config"], saved_gelu, cfg, dist.world_size, ckpt.get("world_size", 1),
                                     MODEL_KEYS)
    for change in changes:
        log.print(f"resuming with a changed setting (it applies from here on): {change}")
    log.continue_from(ckpt.get("elapsed_s", 0.0))
    return Resumed(ckpt, int(ckpt["iter_num"]), float(ckpt["best_val_loss"]), changes)


def load_model(cfg: TrainConfig, meta: dict | None, ckpt: dict | None) -> GPT:
    """The model init_from names (init_model), on the CPU, once its tokenizer is the dataset's and its context holds
    block_size."""
    if meta is not None and cfg.init_from != "scratch":  # weights train only on data of their own tokenizer
        source = "the checkpoint" if ckpt is not None else f"init_from={cfg.init_from!r}"
        dataio.check_tokenizer(*checkpoint_manager.weights_tokenizer(cfg.init_from, ckpt), meta, source, cfg.dataset)
    with parallel.same_random_init(cfg.seed, enabled=cfg.parallelism == "fsdp"):  # the shards of one model
        model = init_model(cfg, meta, ckpt)
    if cfg.block_size > model.config.block_size:
        raise UserError(f"block_size={cfg.block_size} is larger than the model's {model.config.block_size}")
    return model


def place_model(model: GPT, cfg: TrainConfig, dist: Dist, dtype: str, ctx, log: Logger) -> GPT:
    """The model on the device, activation checkpointing, float8 and FSDP's sharding applied, and a forced attention
    kernel's refusal raised now (one line, before any compile)."""
    if cfg.activation_checkpointing:
        n = parallel.checkpoint_activations(model, cfg.activation_checkpointing)
        log.print(f"activation checkpointing: {n} of {model.config.n_layer} blocks recompute in the backward")
    if cfg.fp8:  # before sharding and compiling (setup_device refused it where float8 matmuls cannot run)
        log.print(float8.describe(model, cfg.fp8_recipe, cfg.fp8_layers))
        float8.convert_to_fp8(model, cfg.fp8_recipe, cfg.fp8_layers)
    if cfg.parallelism == "fsdp":
        return parallel.shard_model(model, dist, dtype, compile=cfg.compile,  # moves each rank's shard to device
                                    compile_mode=cfg.compile_mode)
    model.to(dist.device)
    check_attention_kernel(model, ctx, compile=cfg.compile)  # a refused kernel: one line, even when compiled
    return model


def compile_and_wrap(model: GPT, cfg: TrainConfig, dist: Dist, log: Logger) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module that trains, the one that evaluates): compiled after the weights are loaded (checkpoints save the
    raw model, never the compiled wrapper; FSDP compiled each block before sharding), and under DDP the trained one
    wrapped, while evaluation, which needs no gradient sync, runs on the compiled module itself."""
    if cfg.compile and cfg.parallelism == "ddp":
        log.print("compiling the model...")
        model = compile_model(model, cfg)
    if dist.enabled and cfg.parallelism == "ddp":
        device_ids = [dist.local_rank] if dist.device.startswith("cuda") else None
        return DDP(model, device_ids=device_ids, **DDP_SETTINGS), model
    return model, model


# ----------------------------------------------------------------------------------------------- the iterations


class RunSaves:
    """
    When and how a run saves (checkpoint_manager.RunSaver writes): at evals, every checkpoint_interval steps or
    checkpoint_minutes between them (the cadence counts from the last save begun), and on a stop. Under async_save a
    save is written in the background while training goes on, except the last, which is written before the run ends.
    """

    def __init__(self, run: Run, stop: StopRequest):
        cfg, self.run, self.stop = run.cfg, run, stop
        self.saver = checkpoint_manager.RunSaver(cfg.out_dir, run.dist, cfg.parallelism == "fsdp", cfg.always_save_checkpoint,
                                         cfg.keep_last, run.best_file, checkpoint_group(run.dist) if cfg.async_save
                                         else None)
        self.last_iter, self.last_time = run.iter_num, time.time()

    def save(self, iter_num: int, best_val_loss: float, improved: bool, stopping: bool = False) -> None:
        """Save the run at iter_num: in the background under async_save, unless it is the last save (the end, or a
        stop's), which is written before the run ends."""
        r, cfg = self.run, self.run.cfg
        state = checkpoint.train_state(r.raw_model, r.scaler, iter_num, best_val_loss, r.saved_cfg, r.dist,
                                       r.log.elapsed(), r.meta, r.run_id)
        background = cfg.async_save and iter_num < cfg.max_iters and not stopping
        for line in self.saver.save(r.raw_model, r.optimizer, state, improved, background):
            r.log.print(line)
        self.last_iter, self.last_time = iter_num, time.time()

    def finish(self, if_done: bool = False) -> None:
        """Link a save written in the background: once done (if_done), or waiting for it."""
        if (line := self.saver.finish(if_done)) is not None:
            self.run.log.print(line)

    def periodic_due(self, iter_num: int) -> bool:
        """checkpoint_interval / checkpoint_minutes: the ranks agree (rank 0's clock decides the minutes)."""
        cfg = self.run.cfg
        if self.last_iter == iter_num or self.run.eval_only:
            return False
        due = cfg.checkpoint_interval > 0 and iter_num % cfg.checkpoint_interval == 0
        if cfg.checkpoint_minutes > 0:
            late = self.run.dist.master and time.time() - self.last_time >= 60 * cfg.checkpoint_minutes
            due = self.stop.agree(due or late)
        return due


class Loop:
    """The iterations of a run: evaluate and save, one optimizer step, log; a signal stops it with a checkpoint, a
    non-finite step past max_nonfinite_skips with an error. Each step is queued without waiting for the device, and
    its figures are read one step late (step.OneStepLate), before anything that needs them final."""

    def __init__(self, run: Run, stop: StopRequest):
        cfg, self.run, self.stop = run.cfg, run, stop
        self.iter_num, self.best_val_loss, self.losses = run.iter_num, run.best_val_loss, {}
        self.saves = RunSaves(run, stop)
        self.guard = NonFiniteGuard(run.dist.device, cfg.max_nonfinite_skips)
        self.late = OneStepLate(run.dist.device)
        self.steps = StepReports(cfg, run.log, run.raw_model, run.tokens_per_iter, run.accum_steps, run.peak_flops,
                                 run.scaler.is_enabled())

    def iterate(self) -> None:
        cfg, eval_only = self.run.cfg, self.run.eval_only
        while True:
            if self.iter_num % cfg.eval_interval == 0 or self.iter_num == cfg.max_iters or eval_only:
                self.evaluate_and_save()
            if self.saves.periodic_due(self.iter_num):  # between evals (an eval's save counts)
                self.steps.report(self.late.flush())
                self.saves.save(self.iter_num, self.best_val_loss, improved=False)
                self.late.restart()
            if self.iter_num >= cfg.max_iters or eval_only:
                return
            self.step()
            if self.stop.requested():  # before the next eval: a stop skips it
                self.stop_now()
            self.saves.finish(if_done=True)

    def evaluate_and_save(self) -> None:
        r, cfg, it = self.run, self.run.cfg, self.iter_num
        self.steps.report(self.late.flush())  # the last step's figures first: a non-finite step stops before the eval
        last_eval = it >= cfg.max_iters or r.eval_only  # runs whole: the run ends after it anyway
        self.losses = estimate_loss(r.eval_model, cfg, r.splits, r.dist, r.ctx,
                                    (lambda: False) if last_eval else self.stop.signalled)
        if not last_eval and self.stop.requested():  # a signal during the eval: skip it (it may be cut short)
            self.stop_now()
        record = {"iter": it, "train_loss": self.losses["train"], "val_loss": self.losses["val"]}
        if cfg.hellaswag and (it % (cfg.hellaswag_interval or cfg.eval_interval) == 0 or it == cfg.max_iters
                              or cfg.eval_only):
            # on the uncompiled model: its varying lengths would make torch.compile recompile
            record.update(hellaswag.evaluate(r.raw_model, r.hellaswag_examples, r.dist, r.ctx))
        r.log.print(f"step {it}: train loss {self.losses['train']:.4f}, val loss {self.losses['val']:.4f}"
                    + (f", {hellaswag.describe(record)}" if "hellaswag_acc" in record else ""))
        r.log.metrics(record)
        improved = self.losses["val"] < self.best_val_loss
        self.best_val_loss = min(self.best_val_loss, self.losses["val"])  # never overwritten by a worse value
        if (improved or cfg.always_save_checkpoint) and it > 0 and not r.eval_only:
            self.saves.save(it, self.best_val_loss, improved)
        self.late.restart()  # the eval is not part of the next step's time

    def step(self) -> None:
        """One optimizer step, queued: the host goes on while the device computes it."""
        r, cfg, device = self.run, self.run.cfg, self.run.dist.device
        lr = get_lr(self.iter_num, cfg)
        r.optimizer.set_lr(lr)
        batches = train_batches(r.splits["train"], cfg, self.iter_num, r.dist.rank, r.accum_steps)
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.startswith("cuda") else None
        try:
            result = train_step(r.model, r.optimizer, r.scaler, batches, r.ctx, cfg, r.dist, self.stop.requested,
                                self.guard)
        except StepInterrupted:  # not applied: save the state before the step, dropout RNG included
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
            self.stop_now()
        except BaseException:  # a step that fails (out of memory, Ctrl-C): the step before's line first, as a loop
            with contextlib.suppress(Exception):  # that read each step at once would have logged it; a device too
                self.steps.report(self.late.flush())  # broken to read it loses that line only, never the error
            raise
        self.steps.report(self.late.push((self.iter_num, lr), result))  # the step before's: log, or stop if non-finite
        self.iter_num += 1

    def stop_now(self) -> NoReturn:
        self.steps.report(self.late.flush())  # a non-finite step before the stop stops the run as such, saving nothing
        self.saves.save(self.iter_num, self.best_val_loss, improved=False, stopping=True)
        # train() ends the ranks together, once rank 0's checkpoint is on disk
        raise Stopped(self.stop.message(self.iter_num), self.stop.exit_code())

    def end(self) -> dict:
        """The report (rank 0, a run that saved) and the run's final figures."""
        r = self.run
        if r.cfg.report and r.dist.master and not r.eval_only:
            write_report(r.cfg, r.raw_model, r.meta, {**run_info(r.dist.device), "world_size": str(r.dist.world_size)},
                         r.log, r.ctx)
        return {"iter_num": self.iter_num, "best_val_loss": self.best_val_loss, "last_loss": self.steps.last_loss,
                "val_loss": self.losses["val"], "train_loss": self.losses["train"], "model": r.raw_model}


def main(argv: list[str] | None = None) -> None:
    cfg, given = configure_keys(TrainConfig(), sys.argv[1:] if argv is None else argv)
    try:
        train(cfg, given)
    except Stopped as e:  # a clean stop, checkpoint saved: 143 (SIGTERM) or 130 (SIGINT), for requeue scripts
        print(e.message, file=sys.stderr, flush=True)
        sys.exit(e.code)
    except KeyboardInterrupt as e:  # a second Ctrl-C: no checkpoint, so no clean stop's code
        print(f"interrupted: {e or 'Ctrl-C'}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    exit_on_user_error(main)
