"""How a run starts, in three calls from train.py that leave out_dir as it is until the start is accepted: begin()
checks the settings and out_dir, holds out_dir and decides the start (resume or not, from which checkpoint, with which
settings); load() checks the data, begins the log and builds the model; accept(), once every rank passed every check,
restores a resume's state, or moves the previous run aside for a new one. A resume's rules live here too: which
settings it takes from its run, and which it cannot change (the model's shape, its GELU, the optimizer)."""
from __future__ import annotations

import contextlib
import os
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch

from model import GPT
from nanogpt import checkpoint_file, checkpoints, dataio, hellaswag, outdir, parallel, tokenizers
from nanogpt.checkpoint_file import checkpoint_model_config
from nanogpt.checkpoints import FoundCheckpoint
from nanogpt.config import Machine, TrainConfig, check, coerce, config_summary, declared_problems, type_name
from nanogpt.device import resolve_device, resolve_dtype
from nanogpt.distributed import Dist, check_shared_out_dir, torchrun_job
from nanogpt.hardware import system_info
from nanogpt.mfu import resolve_peak_flops
from nanogpt.errors import UserError, WriteError
from nanogpt.hf_gpt2 import GPT2_MODELS, pretrained_gpt2
from nanogpt.metrics import Logger
from nanogpt.optim import Optimizers
from nanogpt.signals import StopRequest
from nanogpt.step import MODEL_KEYS, model_config, model_settings, set_head_loss
from nanogpt.text import plural, shown, size_text

SHAPE_KEYS = ("n_layer", "n_head", "n_embd")  # what pretrained weights decide, whatever the settings say


def check_out_dir(cfg: TrainConfig) -> None:
    """Before anything changes: a resume's folder exists, and nothing of another kind stands where the run writes."""
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
    machine: Machine  # what "auto" means here (the settings keep "auto": a resume elsewhere decides anew)
    notes: list[str]  # why, and the settings taken: printed once the log is open
    found: FoundCheckpoint | None  # the checkpoint a resume continues: one of the run in out_dir
    job: str | None  # torchrun's job (distributed.torchrun_job), recorded in run.json


@contextlib.contextmanager
def begin(cfg: TrainConfig, given: set[str] | None = None) -> Iterator[StartPlan]:
    """The start decided (decide), out_dir held for this run until the block ends (by rank 0, for every rank; not by
    an evaluation that saves nothing). `given`: the keys the user set (None: every key)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check(declared_problems(cfg))  # the values given; what goes together, once a resume took its run's (decide)
    check_out_dir(cfg)
    with outdir.hold(cfg.out_dir, enabled=not cfg.eval_only and int(os.environ.get("RANK", "0")) == 0):
        yield decide(cfg, given, world_size)


def decide(cfg: TrainConfig, given: set[str] | None = None, world_size: int = 1) -> StartPlan:
    """Resume or not, and from which checkpoint, before anything is printed: a resume's checkpoint is found (one of
    the run in out_dir, else a UserError) before its line is, so that no start announces a resume it then refuses."""
    if not cfg.eval_only:
        outdir.read_run(cfg.out_dir)  # a damaged run.json: one line now, not once the start is accepted
    job = torchrun_job()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    init_from, why = outdir.resolve_init_from(cfg.init_from, cfg.out_dir, restart, job)
    cfg = replace(cfg, init_from=init_from)
    notes = [why] if why else []
    found = None
    if init_from == "resume":
        found = checkpoints.find_checkpoint(cfg.out_dir)
        if given is not None:
            cfg, taken = settings_of_the_run(cfg, given, found.read().get("config") or {}, world_size)
            if taken:
                notes.append(f"resuming the run's settings (not given here): {', '.join(taken)}")
        if cfg.parallelism == "fsdp":  # a file and a sharded folder at the same iteration: FSDP reads the folder
            found = checkpoints.find_checkpoint(cfg.out_dir, prefer_sharded=True)
    if init_from != "resume" or given is None:  # else settings_of_the_run checked them, the run's taken (not defaults)
        cfg.check(world_size)
    return StartPlan(cfg, cfg.machine(), notes, found, job)


# What a resume never takes from its run nor lists as a change: where it runs, whether it resumes or only evaluates
NOT_RESUMED = ("init_from", "out_dir", "device", "backend", "eval_only")


def settings_of_the_run(cfg: TrainConfig, given: set[str], saved: dict,
                        world_size: int = 1) -> tuple[TrainConfig, list[str]]:
    """nanoGPT's habit: `--init_from=resume --out_dir=DIR` continues the run without its config file, so every setting
    not given is the checkpoint's run's (`saved`, its recorded config). Returns the config and the settings taken."""
    def refuse(problems: list[str]) -> None:  # a checkpoint edited by hand, or of another program
        if problems:
            raise UserError(f"the checkpoint's recorded settings are not a run's: {'; '.join(problems)}: give these "
                            f"settings on the command line, or restore the checkpoint from a backup")

    hints = typing.get_type_hints(type(cfg))
    taken = {k: v for k, v in saved.items()
             if k in hints and k not in given and k not in NOT_RESUMED and v != getattr(cfg, k)}
    refuse([f"{k}={shown(v)} (not {type_name(hints[k])})" for k, v in taken.items() if not coerce(v, hints[k])[0]])
    taken = {k: coerce(v, hints[k])[1] for k, v in taken.items()}
    refuse([p for p in declared_problems(replace(cfg, **taken)) if p.split("=")[0] in taken])
    notes = []
    if "dtype" in taken:  # a dtype this machine cannot run (nanoGPT's default float16, from a CPU run): auto instead
        try:
            resolve_dtype(taken["dtype"], resolve_device(cfg.device))
        except UserError:
            notes.append(f"dtype: the run's {taken.pop('dtype')!r} cannot run here, so 'auto' "
                         f"({resolve_dtype('auto', resolve_device(cfg.device))}); give --dtype to choose")
    resumed = replace(cfg, **taken)
    problems = resumed.problems(world_size)
    cannot = [p for p in problems if any(p.startswith(f"{k}=") or f" {k}=" in p for k in taken)]
    if cannot:  # a run of another machine (flash_impl='fa4', compile_mode='reduce-overhead' on a CPU)
        raise UserError(f"the run's own settings (from its checkpoint: not given here) cannot run here: "
                        f"{'; '.join(cannot)}: give these settings on the command line")
    check(problems)  # a given setting that the run's rule out (keep_last for an FSDP run's sharded saves)
    return resumed, [f"{k}={v!r}" for k, v in taken.items()] + notes


@dataclass
class Loaded:
    """What load() read: the data, the weights, a resume's state, and MFU's peak."""
    cfg: TrainConfig  # the plan's, with the weights' shape (a checkpoint's, GPT-2's)
    meta: dict | None  # the dataset's meta.json (None for GPT-2's weights on data without one)
    splits: dict[str, dataio.TokenSplit]
    hellaswag_examples: list | None
    model: GPT  # on the CPU
    resumed: Resumed
    eval_only: bool  # evaluate once and save nothing (eval_only, or a resume with nothing left to train)
    peak_flops: float | None


def load(plan: StartPlan, dist: Dist, log: Logger) -> Loaded:
    """The data (its files and token ids checked before anything slow), the run's first lines, a resume's checkpoint,
    and the model init_from names, in that order; nothing in out_dir changes."""
    cfg = plan.cfg
    data_dir, meta, data_vocab = check_data(cfg)
    dist.barrier()  # every rank has decided from out_dir as it was
    peak_flops = log_header(log, plan, dist)
    if not cfg.eval_only or cfg.init_from == "resume":  # what the ranks read there, or rank 0 writes
        check_shared_out_dir(cfg.out_dir, dist)
    resumed = read_resumed(plan, dist, log)
    if nothing_to_train := resumed.iter_num >= cfg.max_iters:  # evaluated only, like eval_only: nothing saved
        at, it, on = (f"the checkpoint is at iter {resumed.iter_num} and ", "it", " on") if resumed.ckpt else \
            ("", "the model", "")
        log.print(f"nothing to train: {at}max_iters={cfg.max_iters}; evaluating {it} only (raise max_iters to "
                  f"train{on})")
    model = load_model(cfg, plan.machine, meta, resumed.ckpt)
    cfg = replace(cfg, **{k: getattr(model.config, k) for k in SHAPE_KEYS})  # checkpoints and the report record it
    splits = {s: dataio.open_split(data_dir, s, None if data_vocab else model.config.vocab_size, meta)
              for s in ("train", "val")}  # the ids checked against the weights' vocabulary where not done yet
    examples = hellaswag.encoded_examples(cfg.hellaswag_path, meta, cfg.block_size) if cfg.hellaswag else None
    return Loaded(cfg, meta, splits, examples, model, resumed, cfg.eval_only or nothing_to_train, peak_flops)


def log_header(log: Logger, plan: StartPlan, dist: Dist) -> float | None:
    """The lines a run begins with: settings, why this start, machine, what "auto" chose, MFU's peak (returned)."""
    cfg, m = plan.cfg, plan.machine
    log.print(config_summary(cfg))
    for note in plan.notes:
        log.print(note)
    log.print(" ".join(f"{k}={v}" for k, v in {**system_info(dist.device), "dtype": m.dtype,
                                               "world_size": dist.world_size}.items()))
    log.print(f"defaults: dtype={m.dtype} ({m.dtype_why}); attention={m.attention} ({m.attention_why})")
    peak_flops, peak_source = resolve_peak_flops(dist.device, m.dtype, cfg.peak_flops)
    log.print(f"MFU peak: {f'{peak_flops / 1e12:.3f} TFLOP/s' if peak_flops else 'n/a'} ({peak_source})")
    log.print(f"tokens per iteration: {cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size:,} ("
              f"{plural(cfg.gradient_accumulation_steps // dist.world_size, 'micro-step')} x "
              f"{plural(dist.world_size, 'rank')} x {cfg.batch_size} x {cfg.block_size})")
    return peak_flops


def check_data(cfg: TrainConfig) -> tuple[str, dict | None, int | None]:
    """The dataset's folder, its meta.json, and the vocabulary its ids were checked against (None: other weights',
    checked once read): a missing file or a bad id fails before the model is built and before out_dir is touched."""
    data_dir = dataio.dataset_dir(cfg.dataset, cfg.data_dir)
    meta = dataio.load_meta(data_dir) if cfg.init_from == "scratch" else dataio.find_meta(data_dir)
    data_vocab = meta["vocab_size"] if cfg.init_from == "scratch" else None
    for split in ("train", "val"):  # before the model is built (or downloaded, or compiled): seconds, not minutes
        dataio.open_split(data_dir, split, data_vocab, meta).check_window(cfg.block_size)
    return data_dir, meta, data_vocab


@dataclass
class Resumed:
    """What a resume continues from: the checkpoint, its iteration and best val loss, what changed since."""
    ckpt: dict | None = None
    iter_num: int = 0
    best_val_loss: float = float("inf")
    changes: list[str] | None = None

    @property
    def best_file(self) -> str | None:
        """Which file holds the run's best weights (always_save_checkpoint=False), as the checkpoint records it."""
        return self.ckpt.get("best_file") if self.ckpt else None


def read_resumed(plan: StartPlan, dist: Dist, log: Logger) -> Resumed:
    """The checkpoint a resume continues from (read, its changed settings printed), or nothing to resume."""
    if plan.found is None:
        return Resumed()
    ckpt, path = plan.found.read(), plan.found.path
    # what a resume needs, which a checkpoint stripped to save space may lack
    for field in ("iter_num", "best_val_loss", *(() if "sharded" in ckpt else ("optimizer",))):
        if field not in ckpt:
            raise UserError(f"checkpoint {path} has no {field}, so a resume cannot continue it: start a new run from "
                            f"its weights with --init_from={path}")
    saved_gelu = checkpoint_model_config(ckpt["model_args"]).gelu
    changes = resume_changes(ckpt.get("config") or {}, saved_gelu, plan.cfg, dist.world_size,
                             ckpt.get("world_size", 1))
    log.print(plan.found.describe("resuming from"))  # once it can: no start announces a resume it then refuses
    for change in changes:
        log.print(f"resuming with a changed setting (it applies from here on): {change}")
    log.continue_from(ckpt.get("elapsed_s", 0.0))
    return Resumed(ckpt, int(ckpt["iter_num"]), float(ckpt["best_val_loss"]), changes)


def resume_changes(saved: dict, saved_gelu: str, cfg: TrainConfig, world_size: int, saved_world_size: int) -> list[str]:
    """Settings of `cfg` that differ from the checkpoint's run (`saved`, and its model's GELU), to be printed: they
    apply from the resume on. Another model shape (step.MODEL_KEYS), GELU or optimizer cannot resume (UserError)."""
    changed = [f"{k}: {saved[k]!r} -> {getattr(cfg, k)!r}" for k in (f.name for f in fields(cfg))
               if k in saved and saved[k] != getattr(cfg, k) and k not in (*NOT_RESUMED, "gelu", "optimizer")
               and getattr(cfg, k) != "auto" and saved[k] != "auto"]  # "auto" is resolved anew on this machine
    model = [c for c in changed if c.split(":")[0] in MODEL_KEYS]
    if cfg.gelu is not None and cfg.gelu != saved_gelu:
        model.append(f"gelu: {saved_gelu!r} -> {cfg.gelu!r}")
    if model:
        raise UserError(f"cannot resume: the checkpoint's model differs ({'; '.join(model)}): use the run's settings, "
                        f"or a new out_dir to start a new run")
    saved_optimizer = saved.get("optimizer", "adamw")  # checkpoints from before the key (and nanoGPT's): AdamW
    if saved_optimizer != cfg.optimizer:
        raise UserError(f"cannot resume: the checkpoint was written by optimizer={saved_optimizer!r}, not "
                        f"{cfg.optimizer!r}: use --optimizer={saved_optimizer}, or a new out_dir to start a new run")
    if world_size != saved_world_size:
        changed.append(f"world_size: {saved_world_size} -> {world_size}")
    return changed


def load_model(cfg: TrainConfig, machine: Machine, meta: dict | None, ckpt: dict | None) -> GPT:
    """The model init_from names, on the CPU, once its tokenizer is the dataset's and its context holds block_size."""
    if meta is not None and cfg.init_from != "scratch":  # weights train only on data of their own tokenizer
        source = "the checkpoint" if ckpt is not None else f"init_from={cfg.init_from!r}"
        tokenizers.check_tokenizer(*checkpoints.weights_tokenizer(cfg.init_from, ckpt), meta, source, cfg.dataset)
    try:
        with parallel.same_random_init(cfg.seed, enabled=cfg.parallelism == "fsdp"):  # the shards of one model
            model = init_model(cfg, machine, meta, ckpt)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # the allocator's refusal: a model past this machine's memory
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        what, fix = ((f"the model (n_layer={cfg.n_layer}, n_embd={cfg.n_embd})", "give a smaller n_layer or n_embd")
                     if cfg.init_from == "scratch" else
                     (f"the model of init_from={cfg.init_from!r}", "run it on a machine with more memory"))
        asked = re.search(r"allocate (\d+) bytes", str(e))
        why = (f"a tensor of {size_text(int(asked[1]))} could not be allocated" if asked else
               str(e).strip().split(". ")[0][:200])
        raise UserError(f"{what} does not fit in this machine's memory ({why}): {fix}") from None
    if cfg.block_size > model.config.block_size:
        raise UserError(f"block_size={cfg.block_size} is larger than the model's {model.config.block_size}")
    return set_head_loss(model, machine)


def init_model(cfg: TrainConfig, machine: Machine, meta: dict | None, ckpt: dict | None) -> GPT:
    """The model for init_from: a fresh GPT for the dataset's vocabulary, the checkpoint's, or pretrained weights."""
    settings = model_settings(cfg, machine)
    if cfg.init_from == "scratch":
        if meta is None:
            raise UserError(f"init_from=scratch needs the dataset's meta.json (vocab_size) in "
                            f"{dataio.dataset_dir(cfg.dataset, cfg.data_dir)}")
        return GPT(model_config(cfg, meta["vocab_size"], machine))
    if cfg.init_from == "resume":
        # every weight is the checkpoint's: here for ckpt.pt, a sharded checkpoint's once the model is sharded
        model = GPT.uninitialized(checkpoint_model_config(ckpt["model_args"], **settings))
        if "model" in ckpt:
            checkpoint_file.load_model_state(model, ckpt["model"], source=os.path.join(cfg.out_dir, outdir.CKPT))
        return model
    path = checkpoints.checkpoint_path(cfg.init_from)
    if path is not None:  # a checkpoint's weights (not its optimizer or iteration) start this run
        weights = checkpoints.read_weights(path)
        return fit_pretrained(checkpoint_file.model_from_checkpoint(weights, **settings), cfg)
    if cfg.init_from in GPT2_MODELS or os.path.isdir(cfg.init_from):
        model = pretrained_gpt2(cfg.init_from, settings, vocab_padding_multiple=cfg.vocab_padding_multiple)
        return fit_pretrained(model, cfg)
    raise UserError(f"init_from={cfg.init_from!r} is not one of scratch, resume, gpt2, gpt2-medium, gpt2-large, "
                    f"gpt2-xl, a folder with a HF GPT-2 model, a checkpoint file or sharded folder, or a run's out_dir")


def fit_pretrained(model: GPT, cfg: TrainConfig) -> GPT:
    """Pretrained weights for a new run: shape and GELU as the config sets them, context cropped to block_size."""
    defaults = TrainConfig()
    wrong = [f"{k}={getattr(cfg, k)} (the weights have {getattr(model.config, k)})" for k in SHAPE_KEYS
             if getattr(cfg, k) not in (getattr(defaults, k), getattr(model.config, k))]
    if wrong:
        raise UserError(f"init_from={cfg.init_from!r}: {', '.join(wrong)}: the model's shape is its weights'; remove "
                        f"{'these settings' if len(wrong) > 1 else 'this setting'}")
    if cfg.gelu is not None and cfg.gelu != model.config.gelu:
        raise UserError(f"gelu={cfg.gelu!r} does not match the weights of {cfg.init_from!r}, which were trained with "
                        f"gelu={model.config.gelu!r}: remove the gelu setting")
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    return model


def accept(plan: StartPlan, loaded: Loaded, model: GPT, optimizer: Optimizers, scaler: torch.amp.GradScaler,
           dist: Dist, log: Logger, stop: StopRequest) -> str | None:
    """The start accepted. A resume's training state is restored first (optimizer, a sharded checkpoint's weights,
    grad scaler, dropout RNG). Then, once every rank got here (none refuses the start once rank 0 accepted it), a
    signal stops the run with a checkpoint, a new run moves the previous one aside and writes its run.json, a resume
    keeps its run's, and the start's line opens metrics.jsonl. Rank 0 alone writes, only for a start that saves; a
    failed write undoes what the start changed (a WriteError). Returns the run's id (None on the other ranks)."""
    resumed = loaded.resumed
    if resumed.ckpt is not None:
        checkpoints.load_training_state(model, optimizer, resumed.ckpt)
        if scaler.is_enabled() and resumed.ckpt.get("scaler"):  # absent when the run was not float16 (or nanoGPT's)
            scaler.load_state_dict(resumed.ckpt["scaler"])
        checkpoint_file.restore_rng(resumed.ckpt, plan.cfg.seed, dist, resumed.iter_num)
    dist.barrier()
    if loaded.eval_only:
        log.start(None, resumed.iter_num, plan.cfg.init_from, saves=False)  # its figures on screen (and wandb) only
        return None
    stop.arm()
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
            outdir.restore_run(out_dir, run)
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
