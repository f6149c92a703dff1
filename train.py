"""
Train a GPT: from scratch, from a checkpoint (resume), or from GPT-2 weights (fine-tuning).

One process (device="auto": a GPU if there is one, else the CPU; the first config here says device="cpu"):
$ python train.py config/train_shakespeare_char_cpu.py
$ python train.py config/train_gpt2.py --batch_size=8 --compile=False

DDP on one node with 8 GPUs (gloo on the CPU: add --device=cpu):
$ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py

DDP on 2 nodes of 8 GPUs (run on each node, with its own --node_rank; the master's address and a free port):
$ torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py ...
(If your cluster has no Infiniband, prepend NCCL_IB_DISABLE=1.)

FSDP instead of DDP, for models whose weights, gradients and AdamW state do not fit one GPU (nanogpt/parallel.py):
$ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_xl_fsdp.py

Config: the TrainConfig defaults (nanogpt/config.py), then config files and --key=value overrides in the order given.

Top to bottom: train() checks the settings and decides the start (start.begin); setup() makes the run (the device and
its precision, the data and the weights: start.load, the model, the optimizer, compile and the wrap) and accepts the
start once every check has passed (start.accept); Loop runs the iterations and the end.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Callable, NoReturn

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import configure_keys
from model import GPT
from nanogpt import checkpoint_file, checkpoints, dataio, float8, hellaswag, parallel, report, start
from nanogpt.checkpoints import CheckpointWriter
from nanogpt.config import TrainConfig
from nanogpt.device import autocast_context, set_tf32
from nanogpt.distributed import (DDP_SETTINGS, Dist, check_same_settings, checkpoint_group, run_in_group,
                                 setup_distributed)
from nanogpt.signals import SecondCtrlC, StopRequest, resume_command
from nanogpt.errors import RunError, Stopped, UserError, WriteError, exit_on_user_error, say, stop_behind
from nanogpt.hardware import check_attention_kernel, system_info, use_flash_impl
from nanogpt.metrics import Logger
from nanogpt.mfu import mfu_text
from nanogpt.optim import Optimizers, build_optimizer, hidden_matrices
from nanogpt.start import StartPlan
from nanogpt.step import (NonFiniteError, NonFiniteGuard, OneStepLate, StepInterrupted, batch_generator, get_batch,
                          setup_process, to_device, train_batches, train_step)

# ----------------------------------------------------------------------------------------------- the schedule, evals


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
            x, y = get_batch(splits[split], cfg.batch_size, cfg.block_size, gen)  # (B, T) each
            with ctx:
                _, loss = model(to_device(x, dist.device), to_device(y, dist.device), return_logits=False)
            total += torch.stack([loss.float(), torch.ones((), device=dist.device)]) * counted
        if dist.enabled:
            torch_dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


# ----------------------------------------------------------------------------------------------- the start


def train(cfg: TrainConfig, given: set[str] | None = None) -> dict:
    """Run the training that `cfg` describes; returns the final figures (for tests and scripts) and the model, unless
    sharded: FSDP's shards need the process group, which the end of the run destroys. `given`: the keys the user
    set (a resume takes its run's setting for every other key; None: every key given)."""
    # a signal before the start is accepted changes nothing (StopRequest); out_dir is held from before the decision
    # to the end, and every rank decides before rank 0 moves any file
    with StopRequest() as stop, start.begin(cfg, given) as plan:
        dist = setup_distributed(plan.machine.device, plan.cfg.backend, group_of_one=plan.cfg.parallelism == "fsdp")
        return run_in_group(dist, lambda: run(plan, dist, stop))


def run(plan: StartPlan, dist: Dist, stop: StopRequest) -> dict:
    """The run on this rank: its setup, then the iterations until max_iters, a stop, or a write that failed."""
    with stop.joined(dist), contextlib.ExitStack() as on_exit:
        training = setup(plan, dist, stop)
        loop = Loop(training, stop)
        on_exit.callback(loop.saves.finish)  # a save written in the background is linked before the run ends
        try:
            loop.iterate()
        except WriteError as e:  # a full disk, a read-only folder: saved where the disk still allows, and one line
            loop.stop_after_failed_write(e)
        return loop.end()


@dataclass
class Training:
    """What the iterations need, made once by setup()."""
    cfg: TrainConfig  # the run's settings, as its checkpoints record them ("auto" kept: resolved again on resume)
    dist: Dist
    ctx: AbstractContextManager  # autocast
    log: Logger
    loaded: start.Loaded  # the data, a resume's state, the tokenizer's meta, MFU's peak
    raw_model: GPT  # what checkpoints save and HellaSwag evaluates
    model: torch.nn.Module  # what trains: compiled, DDP's wrapper
    eval_model: torch.nn.Module  # what evaluates: compiled, without DDP's gradient sync
    optimizer: Optimizers
    scaler: torch.amp.GradScaler
    run_id: str | None  # run.json's (rank 0 of a start that saves)
    accum_steps: int  # micro-steps per rank
    tokens_per_iter: int


def setup(plan: StartPlan, dist: Dist, stop: StopRequest) -> Training:
    """
    The run on this rank, in the order that keeps out_dir untouched until every check has passed on every rank: the
    device and its precision, the data and the weights (start.load), the model placed, its optimizer, compile and the
    DDP / FSDP wrap; only then is the start accepted (start.accept: the run in out_dir moved aside, run.json written).
    """
    cfg, machine = plan.cfg, plan.machine
    check_same_settings(asdict(cfg), dist)  # the settings (checked by start.begin) are the same on every rank
    # the device and its precision
    kept_memory = setup_process(cfg, dist.device, dist.rank)  # seed + rank, deterministic algorithms, malloc
    device_type = dist.device.split(":")[0]
    set_tf32(cfg.tf32 and device_type == "cuda")  # TF32 matmuls on Ampere+ GPUs: 10-bit inputs, float32 sums
    use_flash_impl(cfg.flash_impl)  # behind SDPA's flash kernel: PyTorch's FlashAttention-2, or FlashAttention-4
    ctx = autocast_context(dist.device, machine.dtype)  # matmuls in bf16/fp16 under torch.autocast, reductions float32
    accum_steps = cfg.gradient_accumulation_steps // dist.world_size  # each rank's micro-steps of an optimizer step
    tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
    log = Logger(dist, cfg.out_dir, wandb=dict(project=cfg.wandb_project, name=cfg.wandb_run_name,
                                               config=asdict(cfg)) if cfg.wandb_log else None)
    # the data, its files and token ids checked before anything slow; a resume's checkpoint; the weights
    loaded = start.load(plan, dist, log)
    cfg = loaded.cfg  # the shape that trains is the weights': checkpoints, the report
    if kept_memory:
        log.print("malloc: glibc keeps freed memory (keep_freed_memory=True)")
    # the model: on the device, or sharded over the ranks (FSDP)
    raw_model = place_model(loaded.model, cfg, dist, machine.dtype, ctx, log)
    log.print(f"model: {raw_model.get_num_params() / 1e6:.2f}M parameters, {raw_model.config}")
    muon = hidden_matrices(raw_model) if cfg.optimizer == "muon" else []  # one moment each (Muon's momentum)
    log.print(parallel.memory_text(parallel.memory_per_rank(raw_model, accum_steps, muon), dist.world_size))
    # the optimizer: AdamW (fused where the device has the kernel), or Muon + AdamW; float16's grad scaler
    optimizer = build_optimizer(raw_model, cfg, device_type, verbose=dist.master)
    scaler = torch.amp.GradScaler(device_type, enabled=machine.dtype == "float16")
    # compile, and DDP's wrapper (FSDP compiled each block before sharding); evaluation needs no gradient sync
    model = raw_model
    if cfg.compile and cfg.parallelism == "ddp":
        log.print("compiling the model...")
        model = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    eval_model = model
    if dist.enabled and cfg.parallelism == "ddp":
        model = DDP(model, device_ids=[dist.local_rank] if device_type == "cuda" else None, **DDP_SETTINGS)
    run_id = start.accept(plan, loaded, raw_model, optimizer, scaler, dist, log, stop)
    return Training(cfg, dist, ctx, log, loaded, raw_model, model, eval_model, optimizer, scaler, run_id, accum_steps,
                    tokens_per_iter)


def place_model(model: GPT, cfg: TrainConfig, dist: Dist, dtype: str, ctx, log: Logger) -> GPT:
    """The model on the device: activation checkpointing and float8 applied, then FSDP's sharding (each rank its
    shard, on its device) or the whole model moved, and a forced attention kernel's refusal raised now (one line,
    before any compile)."""
    if cfg.activation_checkpointing:
        n = parallel.checkpoint_activations(model, cfg.activation_checkpointing)
        log.print(f"activation checkpointing: {n} of {model.config.n_layer} blocks recompute in the backward")
    if cfg.fp8:  # before sharding and compiling (the settings' check refused it where float8 matmuls cannot run)
        log.print(float8.describe(model, cfg.fp8_recipe, cfg.fp8_layers))
        float8.convert_to_fp8(model, cfg.fp8_recipe, cfg.fp8_layers)
    if cfg.parallelism == "fsdp":
        return parallel.shard_model(model, dist, dtype, compile=cfg.compile, compile_mode=cfg.compile_mode)
    model.to(dist.device)
    check_attention_kernel(model, ctx, compile=cfg.compile)  # a refused kernel: one line, even when compiled
    return model


# ----------------------------------------------------------------------------------------------- the iterations


class StepReports:
    """What the loop does with each step's figures once they are read (step.OneStepLate: one step late, so reading
    never holds the device back): stop the run once more than max_nonfinite_skips steps had a non-finite loss or
    gradient norm, warn of each such skipped step, and every log_interval steps log the loss, learning rate, the
    step's time on the device's timeline, tokens/s, MFU and gradient norm."""

    def __init__(self, training: Training):
        self.cfg, self.log, self.model = training.cfg, training.log, training.raw_model
        self.scaler_enabled = training.scaler.is_enabled()
        self.tokens_per_iter, self.accum_steps = training.tokens_per_iter, training.accum_steps
        self.peak_flops = training.loaded.peak_flops
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
                newest = newest_checkpoint(cfg.out_dir)
                raise NonFiniteError(
                    f"non-finite {what} at iter {it + 1} (loss {f.loss}, grad norm {f.grad_norm}); the step was not "
                    f"applied, and {f'{newest} is intact' if newest else 'no checkpoint was saved yet'}: lower "
                    f"learning_rate, or set max_nonfinite_skips"
                )
            self.log.print(f"warning: non-finite {what} at iter {it + 1}: step skipped ({f.nonfinite_skips} so far)")
        self.last_loss = f.loss
        if (it + 1) % cfg.log_interval:
            return
        # per rank: this rank's micro-batches against one device's peak
        mfu = self.model.estimate_mfu(cfg.batch_size * self.accum_steps, dt, self.peak_flops, cfg.block_size)
        if mfu is not None:
            self.running_mfu = mfu if self.running_mfu < 0 else 0.9 * self.running_mfu + 0.1 * mfu
        self.log.print(
            f"iter {it + 1}: loss {f.loss:.4f}, lr {lr:.2e}, time {ms:.2f}ms, "
            f"{self.tokens_per_iter / dt:,.0f} tok/s, "
            f"mfu {mfu_text(self.running_mfu if self.running_mfu >= 0 else None)}, grad norm {f.grad_norm:.3f}"
        )
        self.log.metrics({"iter": it + 1, "loss": f.loss, "lr": lr, "ms": ms, "tok_s": self.tokens_per_iter / dt,
                          "mfu": mfu, "grad_norm": f.grad_norm})


class SaveSchedule:
    """
    When a run saves, and the save (checkpoints.CheckpointWriter writes it): at evals, every
    checkpoint_interval steps or checkpoint_minutes between them (the cadence counts from the last save begun), and
    on a stop. Under async_save a save is written in the background while training goes on, except the last, which
    is written before the run ends.
    """

    def __init__(self, training: Training, stop: StopRequest):
        cfg, self.training, self.stop = training.cfg, training, stop
        self.writer = CheckpointWriter(cfg.out_dir, training.dist, cfg.parallelism == "fsdp",
                                       cfg.always_save_checkpoint, cfg.keep_last, training.loaded.resumed.best_file,
                                       checkpoint_group(training.dist) if cfg.async_save else None)
        self.last_iter, self.last_time = training.loaded.resumed.iter_num, time.time()

    def save(self, iter_num: int, best_val_loss: float, improved: bool, stopping: bool = False) -> None:
        """Save the run at iter_num: in the background under async_save, unless it is the last save (the end, or a
        stop's), which is written before the run ends."""
        t, cfg = self.training, self.training.cfg
        state = checkpoint_file.train_state(t.raw_model, t.scaler, iter_num, best_val_loss, asdict(cfg), t.dist,
                                            t.log.elapsed(), t.loaded.meta, t.run_id)
        background = cfg.async_save and iter_num < cfg.max_iters and not stopping
        for line in self.writer.save(t.raw_model, t.optimizer, state, improved, background):
            t.log.print(line)
        self.last_iter, self.last_time = iter_num, time.time()

    def finish(self, if_done: bool = False) -> None:
        """Link a save written in the background: once done (if_done), or waiting for it."""
        if (line := self.writer.finish(if_done)) is not None:
            self.training.log.print(line)

    def periodic_due(self, iter_num: int) -> bool:
        """checkpoint_interval / checkpoint_minutes: the ranks agree (rank 0's clock decides the minutes)."""
        cfg = self.training.cfg
        if self.last_iter == iter_num or self.training.loaded.eval_only:
            return False
        due = cfg.checkpoint_interval > 0 and iter_num % cfg.checkpoint_interval == 0
        if cfg.checkpoint_minutes > 0:
            late = self.training.dist.master and time.time() - self.last_time >= 60 * cfg.checkpoint_minutes
            due = self.stop.agree(due or late)
        return due


class Loop:
    """The iterations of a run: evaluate and save, one optimizer step, log; a signal stops it with a checkpoint, a
    non-finite step past max_nonfinite_skips with an error. Each step is queued without waiting for the device, and
    its figures are read one step late (step.OneStepLate), before anything that needs them final."""

    def __init__(self, training: Training, stop: StopRequest):
        self.training, self.stop = training, stop
        self.iter_num, self.best_val_loss = training.loaded.resumed.iter_num, training.loaded.resumed.best_val_loss
        self.losses = {}
        self.saves = SaveSchedule(training, stop)
        self.guard = NonFiniteGuard(training.dist.device, training.cfg.max_nonfinite_skips)
        self.readout = OneStepLate(training.dist.device)  # each step's figures, read one step late
        self.reports = StepReports(training)  # what is done with them: log, warn, stop on a non-finite step

    def iterate(self) -> None:
        cfg, eval_only = self.training.cfg, self.training.loaded.eval_only
        while True:
            if self.iter_num % cfg.eval_interval == 0 or self.iter_num == cfg.max_iters or eval_only:
                self.evaluate_and_save()
            if self.saves.periodic_due(self.iter_num):  # between evals (an eval's save counts)
                self.reports.report(self.readout.flush())
                self.saves.save(self.iter_num, self.best_val_loss, improved=False)
                self.readout.restart()
            if self.iter_num >= cfg.max_iters or eval_only:
                return
            self.step()
            if self.stop.requested():  # before the next eval: a stop skips it
                self.stop_now()
            self.saves.finish(if_done=True)

    def evaluate_and_save(self) -> None:
        t, cfg, it = self.training, self.training.cfg, self.iter_num
        self.reports.report(self.readout.flush())  # the last step's figures first: a non-finite step stops first
        last_eval = it >= cfg.max_iters or t.loaded.eval_only  # runs whole: the run ends after it anyway
        self.losses = estimate_loss(t.eval_model, cfg, t.loaded.splits, t.dist, t.ctx,
                                    (lambda: False) if last_eval else self.stop.signalled)
        if not last_eval and self.stop.requested():  # a signal during the eval: skip it (it may be cut short)
            self.stop_now()
        record = {"iter": it, "train_loss": self.losses["train"], "val_loss": self.losses["val"]}
        if cfg.hellaswag and (it % (cfg.hellaswag_interval or cfg.eval_interval) == 0 or last_eval):
            # on the uncompiled model: its varying lengths would make torch.compile recompile
            record.update(hellaswag.evaluate(t.raw_model, t.loaded.hellaswag_examples, t.dist, t.ctx))
        t.log.print(f"step {it}: train loss {self.losses['train']:.4f}, val loss {self.losses['val']:.4f}"
                    + (f", {hellaswag.describe(record)}" if "hellaswag_acc" in record else ""))
        t.log.metrics(record)
        improved = self.losses["val"] < self.best_val_loss
        self.best_val_loss = min(self.best_val_loss, self.losses["val"])  # never overwritten by a worse value
        if (improved or cfg.always_save_checkpoint) and it > 0 and not t.loaded.eval_only:
            self.saves.save(it, self.best_val_loss, improved)
        self.readout.restart()  # the eval is not part of the next step's time

    def step(self) -> None:
        """One optimizer step of gradient accumulation, queued: the host goes on while the device computes it."""
        t, cfg, device = self.training, self.training.cfg, self.training.dist.device
        lr = get_lr(self.iter_num, cfg)
        t.optimizer.set_lr(lr)
        batches = train_batches(t.loaded.splits["train"], cfg, self.iter_num, t.dist.rank, t.accum_steps)
        rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.startswith("cuda") else None
        try:
            result = train_step(t.model, t.optimizer, t.scaler, batches, t.ctx, cfg, t.dist, self.stop.requested,
                                self.guard)
        except StepInterrupted:  # not applied: save the state before the step, dropout RNG included
            torch.set_rng_state(rng[0])
            if rng[1] is not None:
                torch.cuda.set_rng_state(rng[1], device)
            self.stop_now()
        except BaseException:
            # A step that fails (out of memory, a second Ctrl-C) logs the step before it first, as a loop that read
            # each step at once would have; a device too broken to read it loses that line only, never the error.
            with contextlib.suppress(Exception):
                self.reports.report(self.readout.flush())
            raise
        self.reports.report(self.readout.push((self.iter_num, lr), result))  # the step before's: log it, or stop
        self.iter_num += 1

    def stop_after_failed_write(self, error: WriteError) -> NoReturn:
        """A write in out_dir failed mid-run: save the run where the disk still allows (the last good checkpoint
        stays whatever happens), and stop with one line that says which."""
        with contextlib.suppress(NonFiniteError):
            self.reports.report(self.readout.flush())
        resume = resume_command(self.training.cfg.out_dir)
        try:
            self.saves.save(self.iter_num, self.best_val_loss, improved=False, stopping=True)
            saved = f"a checkpoint at iter {self.iter_num} was saved (resume with {resume})"
        except WriteError:
            newest = newest_checkpoint(self.training.cfg.out_dir)
            saved = (f"{newest} is intact (resume with {resume})" if newest else
                     "no checkpoint was saved, so there is nothing to resume: start again once the disk has room")
        raise RunError(f"{error}. The run stopped at iter {self.iter_num}: {saved}")

    def stop_now(self) -> NoReturn:
        self.reports.report(self.readout.flush())  # a non-finite step before the stop stops the run, saving nothing
        self.saves.save(self.iter_num, self.best_val_loss, improved=False, stopping=True)
        # run_in_group ends the ranks together, once rank 0's checkpoint is on disk
        raise Stopped(self.stop.message(self.iter_num, self.training.cfg.out_dir), self.stop.exit_code())

    def end(self) -> dict:
        """The report (rank 0, a run that saved) and the run's final figures; the model, unless sharded (FSDP's
        shards need the process group, which the end of the run destroys)."""
        t = self.training
        if t.cfg.report and t.dist.master and not t.loaded.eval_only:
            info = {**system_info(t.dist.device), "world_size": str(t.dist.world_size)}
            report.write_run_report(t.cfg, t.raw_model, t.loaded.meta, info, t.log.print, t.ctx)
        return {"iter_num": self.iter_num, "best_val_loss": self.best_val_loss, "last_loss": self.reports.last_loss,
                "val_loss": self.losses["val"], "train_loss": self.losses["train"],
                "model": None if t.cfg.parallelism == "fsdp" else t.raw_model}


def newest_checkpoint(out_dir: str) -> str | None:
    """What a resume would continue from, in words ('ckpt.pt at iter 6'), or None."""
    try:
        found = checkpoints.find_checkpoint(out_dir)
    except UserError:
        return None
    return f"{found.name} at iter {found.iter_num}"


def main(argv: list[str] | None = None) -> None:
    cfg, given = configure_keys(TrainConfig(), sys.argv[1:] if argv is None else argv, __doc__)
    try:
        train(cfg, given)
    except BaseException as e:  # a stop, also one that an error raised from it wraps (errors.stop_behind)
        stop = stop_behind(e)
        if isinstance(stop, Stopped):  # a clean stop: 143 (SIGTERM) or 130 (SIGINT), for requeue scripts
            say(stop.message, stop.code)
        if isinstance(stop, SecondCtrlC):  # no checkpoint, so no clean stop's code
            say(f"interrupted: {stop}", 1)
        raise


if __name__ == "__main__":
    exit_on_user_error(main)
