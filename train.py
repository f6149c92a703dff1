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

The training step itself (StepConfig, the batches, train_step) is step.py's, which bench.py shares; nothing but the
tests imports train.py.
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, NoReturn

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint
import dataio
import float8
import hellaswag
import parallel
import report
import run_dir
from metrics import Logger, wandb_problem
from checkpoint import checkpoint_model_config
from common import dtype_reason, mfu_text, plural, resolve_attention, run_info, run_peak_flops
from errors import UserError, exit_on_user_error
from hardware import check_attention_kernel
from distributed import (
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
from step import (
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
    # ckpt.pt, or a sharded folder) whose weights start a new run. A new run moves an earlier one aside (run_dir.py)
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
    gradient norm, warn of each such skipped step, and every log_interval steps log the loss, learning rate, time,
    tokens/s, MFU and gradient norm. A step's time is the time between two steps' figures arriving: in a steady loop,
    what a step takes on the device."""

    def __init__(self, cfg: TrainConfig, log: Logger, model: GPT, tokens_per_iter: int, accum_steps: int,
                 peak_flops: float | None, scaler_enabled: bool):
        self.cfg, self.log, self.model, self.scaler_enabled = cfg, log, model, scaler_enabled
        self.tokens_per_iter, self.accum_steps, self.peak_flops = tokens_per_iter, accum_steps, peak_flops
        self.running_mfu = -1.0
        self.last_loss = float("nan")
        self.restart_clock()

    def restart_clock(self) -> None:
        """The next step's time counts from now (after an eval or a save, which are not part of it)."""
        self.t0 = time.time()

    def report(self, read: tuple | None) -> None:
        """read: ((iteration, learning rate), StepFigures) of one step, or None."""
        if read is None:
            return
        (it, lr), f = read
        t1 = time.time()
        dt, self.t0 = t1 - self.t0, t1
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
            f"iter {it + 1}: loss {f.loss:.4f}, lr {lr:.2e}, time {dt * 1000:.2f}ms, "
            f"{self.tokens_per_iter / dt:,.0f} tok/s, mfu {mfu_text(self.running_mfu if self.running_mfu >= 0 else None)}, "
            f"grad norm {f.grad_norm:.3f}"
        )
        self.log.metrics({"iter": it + 1, "loss": f.loss, "lr": lr, "ms": dt * 1000, "tok_s": self.tokens_per_iter / dt,
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
    path = checkpoint.checkpoint_path(cfg.init_from)
    if path is not None:  # a checkpoint's weights (not its optimizer or iteration) start this run
        return fit_pretrained(checkpoint.model_from_checkpoint(checkpoint.read_weights(path), **settings), cfg)
    if cfg.init_from in GPT2_NAMES or os.path.isdir(cfg.init_from):
        model = GPT.from_pretrained(cfg.init_from, settings, vocab_padding_multiple=cfg.vocab_padding_multiple)
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
    found: checkpoint.Found | None  # the checkpoint a resume continues: one of the run in out_dir
    job: str | None  # torchrun's job (distributed.torchrun_job), recorded in run.json


def decide_start(cfg: TrainConfig, given: set[str] | None = None) -> Start:
    """Resume or not, and from which checkpoint, before anything is printed: a resume's checkpoint is found (one of
    the run in out_dir, else a UserError) before its line is, so that no start announces a resume it then refuses.
    A resume takes its run's own setting for every key not `given` (on the command line or in a config file; None:
    every key given)."""
    if not cfg.eval_only:
        run_dir.read_run(cfg.out_dir)  # a damaged run.json: one line now, not once the start is accepted
    job = torchrun_job()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    init_from, why = run_dir.resolve_init_from(cfg.init_from, cfg.out_dir, restart, job)
    cfg = replace(cfg, init_from=init_from)
    notes = [why] if why else []
    if init_from != "resume":
        return Start(cfg, notes, None, job)
    found = checkpoint.find_checkpoint(cfg.out_dir)
    if given is not None:
        cfg, taken = run_dir.settings_of_the_run(cfg, given, found.read().get("config") or {})
        if taken:
            notes.append(f"resuming the run's settings (not given here): {', '.join(taken)}")
    if cfg.parallelism == "fsdp":  # a file and a sharded folder at the same iteration: FSDP reads the folder
        found = checkpoint.find_checkpoint(cfg.out_dir, prefer_sharded=True)
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
        return run_dir.continue_run(out_dir, resumed_run_id, job)
    if moved := run_dir.move_previous_run(out_dir):
        log.print(f"a new run in {out_dir}: the previous run's files ({run_dir.size_text(run_dir.disk_usage(moved))}) "
                  f"moved to {moved} (it resumes from there with --out_dir={moved}; {run_dir.PREVIOUS}/ keeps every run "
                  f"moved aside, whole: remove those you no longer need)")
    return run_dir.begin_run(out_dir, job)


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
    with run_dir.hold(cfg.out_dir, enabled=not cfg.eval_only and int(os.environ.get("RANK", "0")) == 0):
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
    cfg = start.cfg
    cfg.check(dist.world_size)
    config_line = config_summary(cfg)  # what was set, before "auto" settings are resolved
    device = dist.device
    device_type = device.split(":")[0]
    dtype, ctx, kept_memory = setup_device(cfg, device, dist.rank)
    attention, attention_why = resolve_attention(cfg.attention, device, dtype)
    saved_cfg = cfg  # what a checkpoint records: "auto" stays "auto", resolved again where the run resumes
    cfg = replace(cfg, attention=attention)  # the model's config (model_args) records the path that ran
    accum_steps = cfg.gradient_accumulation_steps // dist.world_size  # per rank
    tokens_per_iter = accum_steps * dist.world_size * cfg.batch_size * cfg.block_size
    # data: checked once up front, so a missing file or an id beyond the vocabulary fails before any training, and
    # before out_dir or its metrics are touched. The ids are checked here against the dataset's own vocabulary
    # (scratch); against other weights' (GPT-2's, a checkpoint's) once those are read
    data_dir = data_paths(cfg)
    meta = dataio.load_meta(data_dir) if cfg.init_from == "scratch" else dataio.find_meta(data_dir)
    data_vocab = meta["vocab_size"] if cfg.init_from == "scratch" else None
    for split in ("train", "val"):  # before the model is built (or downloaded, or compiled): seconds, not minutes
        dataio.open_split(data_dir, split, data_vocab, meta).check_window(cfg.block_size)

    if dist.enabled:
        torch_dist.barrier()  # every rank has resolved init_from from out_dir as it was
    log = Logger(cfg, dist)
    log.print(config_line)
    for note in start.notes:
        log.print(note)
    log.print(" ".join(f"{k}={v}" for k, v in {**run_info(device), "dtype": dtype, "world_size": dist.world_size}.items()))
    log.print(f"defaults: dtype={dtype} ({dtype_reason(cfg.dtype, device)}); attention={attention} ({attention_why})")
    peak_flops, peak_source = run_peak_flops(device, dtype, cfg.peak_flops)
    log.print(f"MFU peak: {f'{peak_flops / 1e12:.3f} TFLOP/s' if peak_flops else 'n/a'} ({peak_source})")
    log.print(f"tokens per iteration: {tokens_per_iter:,} ({plural(accum_steps, 'micro-step')} x "
              f"{plural(dist.world_size, 'rank')} x {cfg.batch_size} x {cfg.block_size})")

    if kept_memory:
        log.print("malloc: glibc keeps freed memory (keep_freed_memory=True)")

    # model
    if not cfg.eval_only or cfg.init_from == "resume":  # what the ranks read there, or rank 0 writes
        check_shared_out_dir(cfg.out_dir, dist)
    ckpt = None
    if start.found is not None:
        log.print(start.found.describe("resuming from"))
        ckpt = start.found.read()
    iter_num, best_val_loss = 0, float("inf")
    changes = None
    if ckpt is not None:
        saved_world_size = ckpt.get("world_size", 1)
        saved_gelu = checkpoint_model_config(ckpt["model_args"]).gelu
        changes = run_dir.resume_changes(ckpt["config"], saved_gelu, cfg, dist.world_size, saved_world_size,
                                         MODEL_KEYS)
        for change in changes:
            log.print(f"resuming with a changed setting (it applies from here on): {change}")
        iter_num, best_val_loss = int(ckpt["iter_num"]), float(ckpt["best_val_loss"])
        log.continue_from(ckpt.get("elapsed_s", 0.0))
    nothing_to_train = ckpt is not None and iter_num >= cfg.max_iters
    if nothing_to_train:
        log.print(f"nothing to train: the checkpoint is at iter {iter_num} and max_iters={cfg.max_iters}; "
                  f"evaluating it only (raise max_iters to train on)")
    eval_only = cfg.eval_only or nothing_to_train  # evaluate once, save nothing: change nothing in out_dir
    best_file = ckpt.get("best_file") if ckpt is not None else None  # which file holds the best weights
    if meta is not None and cfg.init_from != "scratch":  # weights train only on data of their own tokenizer
        source = "the checkpoint" if ckpt is not None else f"init_from={cfg.init_from!r}"
        dataio.check_tokenizer(*checkpoint.weights_tokenizer(cfg.init_from, ckpt), meta, source, cfg.dataset)
    with parallel.same_random_init(cfg.seed, enabled=cfg.parallelism == "fsdp"):  # the shards of one model
        model = init_model(cfg, meta, ckpt)
    shape = {k: getattr(model.config, k) for k in SHAPE_KEYS}  # the shape that trains, for the checkpoint and report
    cfg, saved_cfg = replace(cfg, **shape), replace(saved_cfg, **shape)
    if cfg.block_size > model.config.block_size:
        raise UserError(f"block_size={cfg.block_size} is larger than the model's {model.config.block_size}")
    weights_vocab = None if data_vocab is not None else model.config.vocab_size  # ids not yet checked
    splits = {s: dataio.open_split(data_dir, s, weights_vocab, meta) for s in ("train", "val")}
    if cfg.hellaswag:  # encoded once, with the dataset's tokenizer (GPT-2 BPE for GPT-2's weights without one)
        tokenizer = dataio.get_tokenizer(meta) if meta is not None else dataio.gpt2_tokenizer()
        hellaswag_examples = hellaswag.encode(hellaswag.load_examples(cfg.hellaswag_path), tokenizer, cfg.block_size)
    if cfg.activation_checkpointing:
        n = parallel.checkpoint_activations(model, cfg.activation_checkpointing)
        log.print(f"activation checkpointing: {n} of {model.config.n_layer} blocks recompute in the backward")
    if cfg.fp8:  # before sharding and compiling (setup_device refused it where float8 matmuls cannot run)
        log.print(float8.describe(model, cfg.fp8_recipe, cfg.fp8_layers))
        float8.convert_to_fp8(model, cfg.fp8_recipe, cfg.fp8_layers)
    if cfg.parallelism == "fsdp":
        model = parallel.shard_model(model, dist, dtype, compile=cfg.compile,  # moves each rank's shard to device
                                     compile_mode=cfg.compile_mode)
    else:
        model.to(device)
        check_attention_kernel(model, ctx, compile=cfg.compile)  # a refused kernel: one line, even when compiled
    raw_model = model
    log.print(f"model: {model.get_num_params() / 1e6:.2f}M parameters, {model.config}")
    log.print(parallel.memory_text(parallel.memory_per_rank(model, accum_steps), dist.world_size))

    optimizer, scaler = optimizer_and_scaler(raw_model, cfg, device, dtype, verbose=dist.master)
    if ckpt is not None:
        checkpoint.load_training_state(raw_model, optimizer, ckpt)
        if scaler.is_enabled() and ckpt.get("scaler"):  # absent when the run was not float16 (or from nanoGPT)
            scaler.load_state_dict(ckpt["scaler"])
        checkpoint.restore_rng(ckpt, cfg.seed, dist, iter_num)
    resuming, resumed_run_id = ckpt is not None, ckpt.get("run_id") if ckpt is not None else None
    del ckpt  # free its memory

    if cfg.compile and cfg.parallelism == "ddp":  # after the weights are loaded; checkpoints save raw_model, never
        # the compiled wrapper. FSDP compiled each block before sharding.
        log.print("compiling the model...")
        model = compile_model(model, cfg)
    eval_model = model  # evaluation needs no gradient sync: it runs on the (compiled) module, not the DDP wrapper
    if dist.enabled and cfg.parallelism == "ddp":
        model = DDP(model, device_ids=[dist.local_rank] if device_type == "cuda" else None, **DDP_SETTINGS)

    if dist.enabled:
        torch_dist.barrier()  # every rank passed every check: none refuses the start once rank 0 accepted it
    run_id = accept_start(cfg.out_dir, resuming, resumed_run_id, start.job, dist, log) if not eval_only else None
    log.start(run_id, iter_num, cfg.init_from, changes, saves=not eval_only)

    last_save = {"iter": iter_num, "time": time.time()}  # the last save begun: the cadence counts from it
    saver = checkpoint.RunSaver(cfg.out_dir, dist, cfg.parallelism == "fsdp", cfg.always_save_checkpoint,
                                cfg.keep_last, best_file, checkpoint_group(dist) if cfg.async_save else None)

    def save(iter_num: int, best_val_loss: float, improved: bool, background: bool = False) -> None:
        state = checkpoint.train_state(raw_model, scaler, iter_num, best_val_loss, saved_cfg, dist, log.elapsed(),
                                       meta, run_id)
        for line in saver.save(raw_model, optimizer, state, improved, background):
            log.print(line)
        last_save.update(iter=iter_num, time=time.time())

    def finish_save(if_done: bool = False) -> None:
        if (line := saver.finish(if_done)) is not None:
            log.print(line)

    def periodic_save_due(iter_num: int) -> bool:
        """checkpoint_interval / checkpoint_minutes: the ranks agree (rank 0's clock decides the minutes)."""
        if last_save["iter"] == iter_num or eval_only:
            return False
        due = cfg.checkpoint_interval > 0 and iter_num % cfg.checkpoint_interval == 0
        if cfg.checkpoint_minutes > 0:
            late = dist.master and time.time() - last_save["time"] >= 60 * cfg.checkpoint_minutes
            due = stop.agree(due or late)
        return due

    def background_save(iter_num: int) -> bool:
        return cfg.async_save and iter_num < cfg.max_iters  # the last save is written before the run ends

    def stop_now(iter_num: int) -> NoReturn:
        steps.report(late.flush())  # a non-finite step before the stop stops the run as such, saving nothing
        save(iter_num, best_val_loss, improved=False)
        # train() ends the ranks together, once rank 0's checkpoint is on disk
        raise Stopped(stop.message(iter_num), stop.exit_code())

    with StopRequest(dist) as stop, contextlib.ExitStack() as on_exit:
        on_exit.callback(finish_save)  # a save written in the background is linked before the run ends, however
        guard = NonFiniteGuard(device, cfg.max_nonfinite_skips)
        late = OneStepLate(device)  # each step's figures, read while the next step runs
        steps = StepReports(cfg, log, raw_model, tokens_per_iter, accum_steps, peak_flops, scaler.is_enabled())
        while True:
            # evaluate, and save the checkpoint
            if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters or eval_only:
                steps.report(late.flush())  # the last step's figures first: a non-finite step stops before the eval
                last_eval = iter_num >= cfg.max_iters or eval_only  # runs whole: the run ends after it anyway
                stopping = (lambda: False) if last_eval else stop.signalled
                losses = estimate_loss(eval_model, cfg, splits, dist, ctx, stopping)
                if not last_eval and stop.requested():  # a signal during the eval: skip it (it may be cut short)
                    stop_now(iter_num)
                record = {"iter": iter_num, "train_loss": losses["train"], "val_loss": losses["val"]}
                if cfg.hellaswag and (iter_num % (cfg.hellaswag_interval or cfg.eval_interval) == 0
                                      or iter_num == cfg.max_iters or cfg.eval_only):
                    # on the uncompiled model: its varying lengths would make torch.compile recompile
                    record.update(hellaswag.evaluate(raw_model, hellaswag_examples, dist, ctx))
                log.print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                          + (f", {hellaswag.describe(record)}" if "hellaswag_acc" in record else ""))
                log.metrics(record)
                improved = losses["val"] < best_val_loss
                best_val_loss = min(best_val_loss, losses["val"])  # never overwritten by a worse value
                if (improved or cfg.always_save_checkpoint) and iter_num > 0 and not eval_only:
                    save(iter_num, best_val_loss, improved, background=background_save(iter_num))
                steps.restart_clock()  # the eval is not part of the next step's time
            if periodic_save_due(iter_num):  # between evals (an eval's save counts)
                steps.report(late.flush())
                save(iter_num, best_val_loss, improved=False, background=background_save(iter_num))
                steps.restart_clock()
            if iter_num >= cfg.max_iters or eval_only:
                break

            # one optimizer step, queued: the host goes on while the device computes it
            lr = get_lr(iter_num, cfg)
            optimizer.set_lr(lr)
            batches = train_batches(splits["train"], cfg, iter_num, dist.rank, accum_steps)
            rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device_type == "cuda" else None
            try:
                result = train_step(model, optimizer, scaler, batches, ctx, cfg, dist, stop.requested, guard)
            except StepInterrupted:  # not applied: save the state before the step, dropout RNG included
                torch.set_rng_state(rng[0])
                if rng[1] is not None:
                    torch.cuda.set_rng_state(rng[1], device)
                stop_now(iter_num)
            steps.report(late.push((iter_num, lr), result))  # the step before's figures: log, or stop if non-finite
            iter_num += 1
            if stop.requested():  # before the next eval: a stop skips it
                stop_now(iter_num)
            finish_save(if_done=True)

        if cfg.report and dist.master and not eval_only:
            write_report(cfg, raw_model, meta, {**run_info(device), "world_size": str(dist.world_size)}, log, ctx)
        return {"iter_num": iter_num, "best_val_loss": best_val_loss, "last_loss": steps.last_loss,
                "val_loss": losses["val"], "train_loss": losses["train"], "model": raw_model}


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
