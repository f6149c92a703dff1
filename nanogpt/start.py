"""
How a run starts, in the order that keeps out_dir as it is until the start is accepted: decide() reads out_dir as it
is (resume or not, from which checkpoint, with which settings: init_from="auto", a torchrun restart, the run's own
settings for the keys not given); check_data() checks the dataset's files and token ids; read_resumed() reads the
checkpoint a resume continues; load_model() builds the model init_from names (a fresh GPT, a checkpoint's, GPT-2's);
and accept(), once every check has passed on every rank, moves the run in out_dir aside and writes run.json (a new
run), or keeps its run's (a resume). train.py calls them in that order.

A resume's rules live here too: which settings it takes from its run (settings_of_the_run), and which it cannot
change (resume_changes: the model's shape, its GELU, the optimizer).

Imports the model, config.py, checkpoint.py, checkpoint_manager.py, dataio.py, device.py, distributed.py, errors.py,
hardware.py, hf_gpt2.py, metrics.py, mfu.py, optim.py, outdir.py, parallel.py, step.py and text.py.
"""
from __future__ import annotations

import contextlib
import os
import re
import typing
from dataclasses import dataclass, fields, replace

import torch

from model import GPT
from nanogpt import checkpoint, checkpoint_manager, dataio, outdir, parallel
from nanogpt.checkpoint import checkpoint_model_config
from nanogpt.checkpoint_manager import FoundCheckpoint
from nanogpt.config import TrainConfig, coerce, config_summary, declared_problems, type_name
from nanogpt.device import dtype_reason, resolve_device, resolve_dtype
from nanogpt.hardware import system_info
from nanogpt.mfu import resolve_peak_flops
from nanogpt.distributed import Dist, torchrun_job
from nanogpt.errors import UserError, WriteError
from nanogpt.hf_gpt2 import GPT2_MODELS, pretrained_gpt2
from nanogpt.metrics import Logger
from nanogpt.optim import Optimizers
from nanogpt.step import MODEL_KEYS, model_config, model_settings
from nanogpt.text import plural, shown, size_text

SHAPE_KEYS = ("n_layer", "n_head", "n_embd")  # what pretrained weights decide, whatever the settings say


# ----------------------------------------------------------------------------------------------- deciding


def check_out_dir(cfg: TrainConfig) -> None:
    """Before anything changes there: a resume's folder exists, and where the run writes stands nothing of another
    kind (a link, a folder where a file goes: outdir.check_entries)."""
    if cfg.init_from == "resume" and not os.path.isdir(cfg.out_dir):
        what = "it is a file, not a folder" if os.path.lexists(cfg.out_dir) else "the folder does not exist"
        raise UserError(f"no checkpoint to resume in out_dir={cfg.out_dir!r}: {what}; give the "
                        f"run's folder as --out_dir (or --init_from=scratch to start a run there)")
    if not cfg.eval_only and os.path.isdir(cfg.out_dir):
        outdir.check_entries(cfg.out_dir)


@dataclass
class StartPlan:
    """What a start does, decided once from out_dir as it is, before anything is printed or changed there."""
    cfg: TrainConfig  # init_from resolved ("auto", a torchrun restart), a resume's settings of its run taken
    notes: list[str]  # why, and the settings taken: printed once the log is open
    found: FoundCheckpoint | None  # the checkpoint a resume continues: one of the run in out_dir
    job: str | None  # torchrun's job (distributed.torchrun_job), recorded in run.json


def decide(cfg: TrainConfig, given: set[str] | None = None) -> StartPlan:
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
        return StartPlan(cfg, notes, None, job)
    found = checkpoint_manager.find_checkpoint(cfg.out_dir)
    if given is not None:
        cfg, taken = settings_of_the_run(cfg, given, found.read().get("config") or {})
        if taken:
            notes.append(f"resuming the run's settings (not given here): {', '.join(taken)}")
    if cfg.parallelism == "fsdp":  # a file and a sharded folder at the same iteration: FSDP reads the folder
        found = checkpoint_manager.find_checkpoint(cfg.out_dir, prefer_sharded=True)
    return StartPlan(cfg, notes, found, job)


# What a resume never takes from the checkpoint's run, and never lists as a change: where it runs, what says to resume,
# and whether it only evaluates.
NOT_RESUMED = ("init_from", "out_dir", "device", "backend", "eval_only")


def settings_of_the_run(cfg: TrainConfig, given: set[str], saved: dict) -> tuple[TrainConfig, list[str]]:
    """
    nanoGPT's habit: `--init_from=resume --out_dir=DIR` continues the run without its config file. Every setting
    not given (on the command line or in a config file) is the checkpoint's run's (model shape, optimizer and its
    settings, data, schedule), so the resume continues that run. `saved`: the config the checkpoint records.
    Returns the config and the settings taken.
    """
    hints = typing.get_type_hints(type(cfg))
    taken = {k: v for k, v in saved.items()
             if k in hints and k not in given and k not in NOT_RESUMED and v != getattr(cfg, k)}
    wrong = [f"{k}={shown(v)} (not {type_name(hints[k])})" for k, v in taken.items() if not coerce(v, hints[k])[0]]
    if wrong:  # a checkpoint edited by hand, or of another program
        raise UserError(f"the checkpoint's recorded settings are not a run's: {'; '.join(wrong)}: give these settings "
                        f"on the command line, or restore the checkpoint from a backup")
    taken = {k: coerce(v, hints[k])[1] for k, v in taken.items()}
    out_of_range = [p for p in declared_problems(replace(cfg, **taken)) if p.split("=")[0] in taken]
    if out_of_range:
        raise UserError(f"the checkpoint's recorded settings are not a run's: {'; '.join(out_of_range)}: give these "
                        f"settings on the command line, or restore the checkpoint from a backup")
    notes = []
    if "dtype" in taken:  # a dtype this machine cannot run (nanoGPT's default float16, from a CPU run): auto instead
        try:
            resolve_dtype(taken["dtype"], resolve_device(cfg.device))
        except UserError:
            notes.append(f"dtype: the run's {taken.pop('dtype')!r} cannot run here, so 'auto' "
                         f"({resolve_dtype('auto', resolve_device(cfg.device))}); give --dtype to choose")
    resumed = replace(cfg, **taken)
    cannot = [p for p in resumed.problems(int(os.environ.get("WORLD_SIZE", "1")))
              if any(p.startswith(f"{k}=") or f" {k}=" in p for k in taken)]
    if cannot:  # a run of another machine (flash_impl='fa4', compile_mode='reduce-overhead' on a CPU)
        raise UserError(f"the run's own settings (from its checkpoint: not given here) cannot run here: "
                        f"{'; '.join(cannot)}: give these settings on the command line")
    return resumed, [f"{k}={v!r}" for k, v in taken.items()] + notes


# ----------------------------------------------------------------------------------------------- the data


def log_header(log: Logger, plan: StartPlan, cfg: TrainConfig, dist: Dist, dtype: str, attention: str,
               attention_why: str, accum_steps: int, tokens_per_iter: int) -> float | None:
    """The lines a run begins with: the settings given, why the start is what it is, the machine, what "auto" chose,
    MFU's peak (returned) and the tokens of an iteration."""
    log.print(config_summary(cfg))
    for note in plan.notes:
        log.print(note)
    log.print(" ".join(f"{k}={v}" for k, v in {**system_info(dist.device), "dtype": dtype,
                                               "world_size": dist.world_size}.items()))
    log.print(f"defaults: dtype={dtype} ({dtype_reason(cfg.dtype, dist.device)}); attention={attention} "
              f"({attention_why})")
    peak_flops, peak_source = resolve_peak_flops(dist.device, dtype, cfg.peak_flops)
    log.print(f"MFU peak: {f'{peak_flops / 1e12:.3f} TFLOP/s' if peak_flops else 'n/a'} ({peak_source})")
    log.print(f"tokens per iteration: {tokens_per_iter:,} ({plural(accum_steps, 'micro-step')} x "
              f"{plural(dist.world_size, 'rank')} x {cfg.batch_size} x {cfg.block_size})")
    return peak_flops


def check_data(cfg: TrainConfig) -> tuple[str, dict | None, int | None]:
    """The dataset's folder, its meta.json and the vocabulary its ids are checked against now: checked once up front,
    so a missing file or an id beyond the vocabulary fails before any training, and before out_dir or its metrics
    are touched. The ids are checked here against the dataset's own vocabulary (scratch); against other weights'
    (GPT-2's, a checkpoint's) once those are read (None here)."""
    data_dir = dataio.dataset_dir(cfg.dataset, cfg.data_dir)
    meta = dataio.load_meta(data_dir) if cfg.init_from == "scratch" else dataio.find_meta(data_dir)
    data_vocab = meta["vocab_size"] if cfg.init_from == "scratch" else None
    for split in ("train", "val"):  # before the model is built (or downloaded, or compiled): seconds, not minutes
        dataio.open_split(data_dir, split, data_vocab, meta).check_window(cfg.block_size)
    return data_dir, meta, data_vocab


# ----------------------------------------------------------------------------------------------- a resume


@dataclass
class Resumed:
    """What a resume continues from: the checkpoint, its iteration and best val loss, what changed since."""
    ckpt: dict | None = None
    iter_num: int = 0
    best_val_loss: float = float("inf")
    changes: list[str] | None = None


def read_resumed(plan: StartPlan, cfg: TrainConfig, dist: Dist, log: Logger) -> Resumed:
    """The checkpoint a resume continues from (read, its changed settings printed), or nothing to resume."""
    if plan.found is None:
        return Resumed()
    ckpt, path = plan.found.read(), plan.found.path
    for field in ("iter_num", "best_val_loss", *(() if "sharded" in ckpt else ("optimizer",))):  # stripped to save space
        if field not in ckpt:
            raise UserError(f"checkpoint {path} has no {field}, so a resume cannot continue it: start a new run from "
                            f"its weights with --init_from={path}")
    saved_gelu = checkpoint_model_config(ckpt["model_args"]).gelu
    changes = resume_changes(ckpt.get("config") or {}, saved_gelu, cfg, dist.world_size, ckpt.get("world_size", 1))
    log.print(plan.found.describe("resuming from"))  # once it can: no start announces a resume it then refuses
    for change in changes:
        log.print(f"resuming with a changed setting (it applies from here on): {change}")
    log.continue_from(ckpt.get("elapsed_s", 0.0))
    return Resumed(ckpt, int(ckpt["iter_num"]), float(ckpt["best_val_loss"]), changes)


def resume_changes(saved: dict, saved_gelu: str, cfg: TrainConfig, world_size: int,
                   saved_world_size: int) -> list[str]:
    """Settings of `cfg` that differ from the checkpoint's run (its config `saved`, and the GELU its model was
    trained with). A different model shape (step.MODEL_KEYS) or GELU cannot resume (UserError); anything else is
    allowed and returned, to be printed: it applies from the resume on (the optimizer's settings too:
    load_training_state)."""
    changed = [  # where it runs is no setting of the run, and "auto" is resolved anew on this machine
        f"{k}: {saved[k]!r} -> {getattr(cfg, k)!r}"
        for k in (f.name for f in fields(cfg))
        if k in saved and saved[k] != getattr(cfg, k) and k not in (*NOT_RESUMED, "gelu", "optimizer")
        and getattr(cfg, k) != "auto" and saved[k] != "auto"
    ]
    model = [c for c in changed if c.split(":")[0] in MODEL_KEYS]
    if cfg.gelu is not None and cfg.gelu != saved_gelu:
        model.append(f"gelu: {saved_gelu!r} -> {cfg.gelu!r}")
    if model:
        raise UserError(
            f"cannot resume: the checkpoint's model differs ({'; '.join(model)}): use the run's settings, or a new "
            f"out_dir to start a new run"
        )
    saved_optimizer = saved.get("optimizer", "adamw")  # checkpoints from before the key (and nanoGPT's): AdamW
    if saved_optimizer != cfg.optimizer:
        raise UserError(
            f"cannot resume: the checkpoint was written by optimizer={saved_optimizer!r}, not {cfg.optimizer!r}: "
            f"use --optimizer={saved_optimizer}, or a new out_dir to start a new run"
        )
    if world_size != saved_world_size:
        changed.append(f"world_size: {saved_world_size} -> {world_size}")
    return changed


# ----------------------------------------------------------------------------------------------- the model


def load_model(cfg: TrainConfig, meta: dict | None, ckpt: dict | None) -> GPT:
    """The model init_from names (init_model), on the CPU, once its tokenizer is the dataset's and its context holds
    block_size."""
    if meta is not None and cfg.init_from != "scratch":  # weights train only on data of their own tokenizer
        source = "the checkpoint" if ckpt is not None else f"init_from={cfg.init_from!r}"
        dataio.check_tokenizer(*checkpoint_manager.weights_tokenizer(cfg.init_from, ckpt), meta, source, cfg.dataset)
    try:
        with parallel.same_random_init(cfg.seed, enabled=cfg.parallelism == "fsdp"):  # the shards of one model
            model = init_model(cfg, meta, ckpt)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # the allocator's refusal: a model past this machine's memory
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        what, fix = ((f"the model (n_layer={cfg.n_layer}, n_embd={cfg.n_embd})", "give a smaller n_layer or n_embd")
                     if cfg.init_from == "scratch" else (f"the model of init_from={cfg.init_from!r}",
                                                          "run it on a machine with more memory"))
        asked = re.search(r"allocate (\d+) bytes", str(e))
        why = (f"a tensor of {size_text(int(asked[1]))} could not be allocated" if asked else
               str(e).strip().split(". ")[0][:200])
        raise UserError(f"{what} does not fit in this machine's memory ({why}): {fix}") from None
    if cfg.block_size > model.config.block_size:
        raise UserError(f"block_size={cfg.block_size} is larger than the model's {model.config.block_size}")
    return model


def init_model(cfg: TrainConfig, meta: dict | None, ckpt: dict | None) -> GPT:
    """The model for init_from: a fresh GPT sized by the config and the dataset's vocabulary (padded to a multiple of
    vocab_padding_multiple), the checkpoint's, or GPT-2's weights (cropped to block_size)."""
    settings = model_settings(cfg)
    if cfg.init_from == "scratch":
        if meta is None:
            raise UserError(f"init_from=scratch needs the dataset's meta.json (vocab_size) in "
                            f"{dataio.dataset_dir(cfg.dataset, cfg.data_dir)}")
        return GPT(model_config(cfg, meta["vocab_size"]))
    if cfg.init_from == "resume":
        # every weight is the checkpoint's: here for ckpt.pt, a sharded checkpoint's once the model is sharded
        model = GPT.uninitialized(checkpoint_model_config(ckpt["model_args"], **settings))
        if "model" in ckpt:
            checkpoint.load_model_state(model, ckpt["model"], source=os.path.join(cfg.out_dir, checkpoint.CKPT_NAME))
        return model
    path = checkpoint_manager.checkpoint_path(cfg.init_from)
    if path is not None:  # a checkpoint's weights (not its optimizer or iteration) start this run
        weights = checkpoint_manager.read_weights(path)
        return fit_pretrained(checkpoint.model_from_checkpoint(weights, **settings), cfg)
    if cfg.init_from in GPT2_MODELS or os.path.isdir(cfg.init_from):
        model = pretrained_gpt2(cfg.init_from, settings, vocab_padding_multiple=cfg.vocab_padding_multiple)
        return fit_pretrained(model, cfg)
    raise UserError(
        f"init_from={cfg.init_from!r} is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, gpt2-xl, "
        f"a folder with a HF GPT-2 model, a checkpoint file or sharded folder, or a run's out_dir"
    )


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


def restore_training_state(model: GPT, optimizer: Optimizers, scaler: torch.amp.GradScaler, resumed: Resumed,
                           seed: int, dist: Dist) -> None:
    """What a resume continues besides the weights: the optimizer's state (a sharded checkpoint's weights too: they
    load into the sharded model), the grad scaler's and the dropout RNG."""
    ckpt = resumed.ckpt
    checkpoint_manager.load_training_state(model, optimizer, ckpt)
    if scaler.is_enabled() and ckpt.get("scaler"):  # absent when the run was not float16 (or from nanoGPT)
        scaler.load_state_dict(ckpt["scaler"])
    checkpoint.restore_rng(ckpt, seed, dist, resumed.iter_num)


def shape_of(model: GPT) -> dict[str, int]:
    """The shape keys of the model that trains (the weights'): what its checkpoints and report record."""
    return {k: getattr(model.config, k) for k in SHAPE_KEYS}


# ----------------------------------------------------------------------------------------------- accepting


def accept(plan: StartPlan, resumed: Resumed, dist: Dist, log: Logger) -> str | None:
    """The start is accepted, once every check passed on every rank (a refused start changed nothing in out_dir): a
    new run moves the one there aside whole and writes its run.json; a resume keeps its run's; then the start's line
    opens metrics.jsonl. Rank 0 alone writes, and only for a start that saves (one that evaluates only changes nothing
    there); returns the run's id (None on the other ranks). A write that fails undoes what the start changed (the
    previous run moved back, run.json as it was) and is a WriteError: the folder is as it was."""
    out_dir, ckpt = plan.cfg.out_dir, resumed.ckpt
    if not dist.master:
        log.start(None, resumed.iter_num, plan.cfg.init_from, resumed.changes)
        return None
    if ckpt is not None:
        run = outdir.read_run(out_dir)
        run_id = outdir.continue_run(out_dir, ckpt.get("run_id"), plan.job)
        try:
            log.start(run_id, resumed.iter_num, plan.cfg.init_from, resumed.changes)
        except WriteError:
            outdir.restore_run(out_dir, run)  # run.json as it was, or none where there was none
            raise
        return run_id
    moved = outdir.move_previous_run(out_dir)
    try:
        run_id = outdir.begin_run(out_dir, plan.job)
        log.start(run_id, resumed.iter_num, plan.cfg.init_from, resumed.changes)
    except WriteError:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(out_dir, outdir.RUN_FILE))  # ours: begin_run wrote it (or nothing is there)
        if moved:
            outdir.move_back(out_dir, *moved)
        raise
    if moved:
        dest, names, _ = moved
        where = (f"it resumes from there with --out_dir={dest}" if outdir.has_checkpoint(dest)
                 else "it saved no checkpoint")
        log.print(f"a new run in {out_dir}: the previous run's files ({size_text(outdir.disk_usage(dest))}) moved to "
                  f"{dest} ({where}; {outdir.PREVIOUS}/ keeps every run moved aside, whole: remove those you no longer "
                  f"need)")
    return run_id
