"""
The settings: a training step's (StepConfig, which bench.py extends) and a run's (TrainConfig), each key with its type,
default, meaning and the values it may hold beside its type (Range, OneOf, NotEmpty); and every check of them, in one
message before anything slow runs or out_dir is touched. The commands' own configs declare their values the same way.
"""
from __future__ import annotations

import contextlib
import math
import os
import types
import typing
from dataclasses import dataclass, fields
from typing import Annotated, Any, TypeVar

import torch

from model import GELU_CHOICES, SDPA_BACKENDS, GPTConfig
from nanogpt import float8
from nanogpt.device import DTYPES, dtype_reason, resolve_attention, resolve_device, resolve_dtype, resolve_fused_loss
from nanogpt.errors import UserError
from nanogpt.hardware import FLASH_IMPLS, flash_impl_problem
from nanogpt.hf_gpt2 import GPT2_MODELS
from nanogpt.optional import optional_import

T = TypeVar("T")


class Range:
    """The numbers a key may hold: low <= value <= high, an open end excluding its bound (nan and inf are in none).
    `note`: what a message adds, e.g. what 0 means."""

    def __init__(self, low: float, high: float | None = None, low_open: bool = False, high_open: bool = False,
                 note: str = ""):
        self.low, self.high, self.low_open, self.high_open, self.note = low, high, low_open, high_open, note

    def describe(self) -> str:
        """'at least 1', '> 0', 'in [0, 1)': as --help and the messages say it."""
        low, high = (f"{b:g}" if isinstance(b, float) else str(b) for b in (self.low, self.high))
        if self.high is None:
            return f"> {low}" if self.low_open else f"at least {low}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"

    def problem(self, key: str, value) -> str | None:
        if value is None or isinstance(value, bool):  # None where the type allows it; a bool of `bool | int`
            return None
        finite = isinstance(value, int) or isinstance(value, float) and math.isfinite(value)
        holds = finite and (value > self.low if self.low_open else value >= self.low) and (
            self.high is None or (value < self.high if self.high_open else value <= self.high))
        return None if holds else f"{key}={value!r} must be {self.describe()}"


class OneOf:
    """The strings a key may hold."""

    def __init__(self, *choices: str, note: str = ""):
        self.choices, self.note = choices, note

    def describe(self) -> str:
        return f"one of {', '.join(self.choices)}"

    def problem(self, key: str, value) -> str | None:
        return None if value is None or value in self.choices else f"{key}={value!r} is not {self.describe()}"


class NotEmpty:
    """A string that names a folder: an unset shell variable (`--out_dir=$OUT`) must not make a run write into the
    current folder."""
    note = "give a folder: '.' for the current one"

    def describe(self) -> str:
        return "not empty"

    def problem(self, key: str, value) -> str | None:
        return f"{key}='' names no folder" if value == "" else None


# The ranges that most keys take, as types: `batch_size: AtLeast1[int] = 12`
AtLeast1 = Annotated[T, Range(1)]
AtLeast0 = Annotated[T, Range(0)]
Positive = Annotated[T, Range(0, low_open=True)]
Fraction = Annotated[T, Range(0, 1, high_open=True)]  # [0, 1): dropout, momenta
Seed = Annotated[T, Range(0, 2**32 - 1)]  # numpy's SeedSequence takes no negative seed; + rank and step fit int64
Folder = Annotated[str, NotEmpty()]


def declarations(config) -> dict[str, tuple[Any, bool]]:
    """key -> (what its type declares: a Range, OneOf or NotEmpty; whether None is a value too)."""
    hints = typing.get_type_hints(type(config), include_extras=True)
    return {f.name: (meta, type(None) in typing.get_args(typing.get_args(hints[f.name])[0]))
            for f in fields(config) for meta in getattr(hints[f.name], "__metadata__", ()) if hasattr(meta, "problem")}


def declared_problems(config) -> list[str]:
    """Every key of `config` whose value is outside what its type declares, one phrase each, with the declaration's
    note (or "or None" where None is a value too: it always passes)."""
    problems = []
    for key, (meta, optional) in declarations(config).items():
        if problem := meta.problem(key, getattr(config, key)):
            note = meta.note or ("or None" if optional else "")
            problems.append(f"{problem} ({note})" if note else problem)
    return problems


def kernel_problem(attention: str, sdpa_backend: str | None) -> str | None:
    """An SDPA kernel chosen for the math attention, which has none: the choice would do nothing."""
    if attention == "math" and sdpa_backend not in (None, "auto"):
        return (f"sdpa_backend={sdpa_backend!r} chooses a kernel of attention=sdpa, not of math: use --attention=sdpa "
                f"(or auto), or drop sdpa_backend")
    return None


def check(problems: list[str]) -> None:
    """One UserError naming every problem, or nothing."""
    if problems:
        raise UserError("; ".join(problems))


# ----------------------------------------------------------------------------------------------- declared types


def coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(accepted, value converted to `tp`): bool, int, float, str, X | None, tuple[...] and list[...] keys.

    Stricter than isinstance on purpose: bool is a subclass of int in Python, but `batch_size=True` or `compile=1` is
    always a mistake, so bools are never numbers and numbers never bools. An int is a float (converted, so
    `learning_rate=1` stores 1.0); an int past 64 bits is none (what torch and numpy hold).
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        accepted = [converted for ok, converted in (coerce(value, arm) for arm in args) if ok]
        same = [c for c in accepted if type(c) is type(value)]  # `int | float` keeps 3 an int
        return bool(accepted), (same or accepted or [value])[0]
    if origin in (tuple, list):
        fixed = origin is tuple and Ellipsis not in args  # tuple[float, float], not tuple[int, ...]
        if not isinstance(value, origin) or fixed and len(value) != len(args):
            return False, value
        items = [coerce(v, t) for v, t in zip(value, args if fixed else args[:1] * len(value))]
        return all(ok for ok, _ in items), origin(c for _, c in items)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return True, float(value)
        except OverflowError:  # an int past a float's range
            return False, value
    if tp is int:
        return type(value) is int and -2**63 <= value < 2**63, value
    if tp is bool or tp is type(None):
        return type(value) is tp, value
    return isinstance(value, tp), value


def type_name(tp: Any) -> str:
    """`int | None`, `tuple[float, float]`: how the annotation is written, without the `typing.` noise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", repr(tp))


def config_summary(config, width: int = 120) -> str:
    """The keys whose values differ from the dataclass's defaults, for the run log: `key=value` (a Python literal, so
    each is a valid --key=value override) in field order, wrapped between keys at `width` columns. The whole config
    is in the checkpoint."""
    defaults = type(config)()
    changed = [f"{f.name}={getattr(config, f.name)!r}" for f in fields(config)
               if getattr(config, f.name) != getattr(defaults, f.name)]
    if not changed:
        return f"config: the defaults ({type(config).__name__})"
    lines = ["config (differs from the defaults):"]
    for piece in [item + "," for item in changed[:-1]] + changed[-1:]:
        if len(lines[-1]) + 1 + len(piece) > width and lines[-1].strip():
            lines.append(" ")  # the next line, indented by two
        lines[-1] += " " + piece
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- a step's settings

ATTENTIONS = ("auto", "math", "sdpa")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")
CUDA_GRAPH_MODES = ("max-autotune", "reduce-overhead")


@dataclass(frozen=True)
class Machine:
    """What the "auto" settings mean on this machine (StepConfig.machine), with the reasons the run's log gives."""
    device: str
    dtype: str
    dtype_why: str
    attention: str
    attention_why: str
    fused_loss: bool


@dataclass
class StepConfig:
    """
    What one training step needs (the batch, the model, the optimizer, device and precision): train.py's TrainConfig
    and bench.py's BenchConfig extend it. The model keys default to GPTConfig's (model.py), the one source, except
    bias, which a model trained from scratch leaves out.
    """
    # data
    dataset: str = "openwebtext"  # data/<dataset>/: train.bin, val.bin, meta.json
    data_dir: str | None = None  # default: data/<dataset> in the repository
    gradient_accumulation_steps: AtLeast1[int] = 5 * 8  # micro-steps per optimizer step, over all DDP ranks together
    batch_size: AtLeast1[int] = 12  # micro-batch size per rank
    block_size: AtLeast1[int] = GPTConfig.block_size  # context length: tokens per sequence

    # model
    n_layer: AtLeast1[int] = GPTConfig.n_layer  # transformer blocks
    n_head: AtLeast1[int] = GPTConfig.n_head  # attention heads per block
    n_embd: AtLeast1[int] = GPTConfig.n_embd  # a multiple of n_head
    dropout: Fraction[float] = GPTConfig.dropout  # 0 for pretraining, try 0.1+ for fine-tuning
    bias: bool = False  # GPTConfig's True is GPT-2's; from scratch False is a bit better and faster
    attention: Annotated[str, OneOf(*ATTENTIONS)] = "auto"  # auto: math on a CPU under bf16 (faster there), else sdpa
    sdpa_backend: Annotated[str, OneOf(*SDPA_BACKENDS)] = GPTConfig.sdpa_backend  # attention=sdpa's kernel
    vocab_padding_multiple: Annotated[int, Range(1, 2**16)] = GPTConfig.vocab_padding_multiple  # 50257 -> 50304 rows
    flash_impl: Annotated[str, OneOf(*FLASH_IMPLS)] = "default"  # fa4: FlashAttention-4 (H100+, flash-attn-4)
    fused_loss: bool | None = None  # head and loss in chunks, no (tokens x vocab) logits; None: fused on a CPU only
    gelu: Annotated[str | None, OneOf(*GELU_CHOICES)] = None  # tanh: GPT-2's; None: erf from scratch, else the weights'

    # optimizer
    optimizer: Annotated[str, OneOf("adamw", "muon")] = "adamw"  # muon: Muon for the blocks' matrices, AdamW the rest
    muon_learning_rate: Positive[float] = 0.02  # Muon's max learning rate; the schedule scales it like AdamW's
    muon_weight_decay: AtLeast0[float] = 0.0  # decoupled: each step multiplies the matrices by 1 - lr * this
    muon_momentum: Fraction[float] = 0.95  # Nesterov momentum of the gradients that Muon orthogonalises
    muon_ns_dtype: Annotated[str, OneOf("auto", "bfloat16", "float32")] = "auto"  # auto: float32 on a CPU without bf16

    # AdamW
    learning_rate: AtLeast0[float] = 6e-4  # max learning rate (with Muon: of the embeddings, head and 1-D parameters)
    weight_decay: AtLeast0[float] = 1e-1  # AdamW's, on the 2-D weights only
    beta1: Fraction[float] = 0.9  # AdamW's betas
    beta2: Fraction[float] = 0.95
    grad_clip: AtLeast0[float] = 1.0  # clip the gradient norm at this value; 0 disables clipping
    fused_adamw: bool | None = None  # None: fused where the device has the kernel

    # system
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N", "mps"
    dtype: Annotated[str, OneOf("auto", *DTYPES)] = "auto"  # autocast's; float16 adds a grad scaler
    tf32: bool = True  # TF32 matmuls on Ampere+ GPUs
    compile: bool = True  # torch.compile the model
    compile_mode: Annotated[str, OneOf(*COMPILE_MODES)] = "default"  # torch.compile's; the last two add CUDA graphs
    fp8: bool = False  # float8 matmuls in the blocks through torchao (GPUs of compute capability 8.9+: float8.py)
    fp8_recipe: Annotated[str, OneOf(*float8.FP8_RECIPES)] = "tensorwise"  # float8 scaling
    fp8_layers: Annotated[str, OneOf(*float8.FP8_LAYERS)] = "auto"  # auto: the layers large enough to pay (float8.py)
    deterministic: bool = False  # bitwise repeatable runs, compiled ones too (torch.use_deterministic_algorithms)
    keep_freed_memory: bool = True  # CPU: glibc malloc keeps freed buffers instead of returning them (faster steps)
    peak_flops: Positive[float | None] = None  # MFU's denominator; None: a known GPU's, or the CPU's measured peak
    seed: Seed[int] = 1337  # the weights' init, dropout and the batches

    def problems(self, world_size: int = 1) -> list[str]:
        """What is wrong with these keys for a run of world_size ranks on this machine, one phrase each: the declared
        values, then the keys together and what the device can run (TrainConfig adds its own)."""
        problems = declared_problems(self)
        if self.gradient_accumulation_steps % world_size:
            problems.append(f"gradient_accumulation_steps={self.gradient_accumulation_steps} is not divisible by the "
                            f"{world_size} DDP processes: make it a multiple of {world_size}")
        if self.n_head >= 1 and self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if (why := kernel_problem(self.attention, self.sdpa_backend)) is not None:
            problems.append(why)
        if self.optimizer == "muon" and self.learning_rate <= 0:  # Muon's schedule is AdamW's, scaled
            problems.append(f"learning_rate={self.learning_rate} must be > 0 with optimizer='muon'")
        return problems + self.machine_problems()

    def machine(self) -> "Machine":
        """What "auto" means on this machine for these settings (a UserError where the device or dtype cannot run
        here): decided here, once, and handed down; the settings keep "auto", which a resume elsewhere decides anew."""
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        attention, attention_why = resolve_attention(self.attention, device, dtype)
        return Machine(device, dtype, dtype_reason(self.dtype, device), attention, attention_why,
                       resolve_fused_loss(self.fused_loss, device))

    def check(self, world_size: int = 1) -> None:
        """One UserError naming every problem of these settings for a run of world_size ranks."""
        check(self.problems(world_size))

    def machine_problems(self) -> list[str]:
        """What this machine cannot run: the device, the dtype on it, CUDA graphs elsewhere than CUDA, float8."""
        try:
            device = resolve_device(self.device)
        except UserError as e:
            return [str(e)]
        problems = []
        dtype = None
        if self.dtype in ("auto", *DTYPES):
            try:
                dtype = resolve_dtype(self.dtype, device)
            except UserError as e:
                problems.append(str(e))
        if self.compile_mode in CUDA_GRAPH_MODES and device.split(":")[0] != "cuda":
            problems.append(f"compile_mode={self.compile_mode!r} records CUDA graphs, which need a CUDA device, not "
                            f"{device!r}: use 'default' or 'max-autotune-no-cudagraphs'")
        if self.fp8:
            problems += fp8_problems(device, dtype)
        if self.flash_impl in FLASH_IMPLS and (why := flash_impl_problem(self.flash_impl, device)) is not None:
            problems.append(why)
        return problems


def fp8_problems(device: str, dtype: str | None) -> list[str]:
    """What stops fp8=True here: a device without float8 matmuls, a dtype other than bf16, or no torchao."""
    low = float8.MIN_CAPABILITY
    problems = []
    if device.split(":")[0] != "cuda":
        problems.append(f"fp8=True needs an NVIDIA GPU of compute capability {low[0]}.{low[1]} or later (H100, H200, "
                        f"L4, RTX 40xx), and device={device!r} is not one: set fp8=False")
    elif (capability := torch.cuda.get_device_capability(torch.device(device))) < low:
        problems.append(f"fp8=True needs compute capability {low[0]}.{low[1]} or later (H100, H200, L4, RTX 40xx), and "
                        f"{torch.cuda.get_device_name(torch.device(device))} has {capability[0]}.{capability[1]}: "
                        f"set fp8=False")
    if dtype is not None and dtype != "bfloat16":
        problems.append(f"fp8=True runs everything else in bf16 autocast, but dtype={dtype!r}: set dtype=bfloat16 "
                        f"(or auto)")
    if not float8.torchao_installed():
        problems.append("fp8=True needs torchao, which is not installed: pip install torchao")
    return problems


# ----------------------------------------------------------------------------------------------- weights to read

@dataclass
class WeightsSource:
    """The weights sample.py and hellaswag.py run (their configs' first keys)."""
    init_from: str = "resume"  # resume (out_dir's checkpoint), gpt2, gpt2-medium, ..., a HF folder or a checkpoint
    out_dir: Folder = "out"  # with init_from=resume: the training run's folder
    ckpt: str | None = None  # in out_dir; None: the newest; ckpt_best.pt or ckpt_sharded_best: the best val loss's

    def weights_problems(self) -> list[str]:
        """An init_from that names no weights: one phrase, found before anything slow (a download, a load)."""
        if self.init_from == "resume" or self.init_from in GPT2_MODELS or os.path.exists(self.init_from):
            return []
        return [f"init_from={self.init_from!r} is not one of resume, {', '.join(GPT2_MODELS)}, a folder with a HF "
                f"GPT-2 model, or a checkpoint file or sharded folder"]


# ----------------------------------------------------------------------------------------------- a run's settings

@dataclass
class TrainConfig(StepConfig):
    # I/O
    out_dir: Folder = "out"  # the run's folder: checkpoints, metrics.jsonl, report.md
    eval_interval: AtLeast1[int] = 2000  # steps between evals (each may save a checkpoint)
    log_interval: AtLeast1[int] = 1  # steps between loss lines
    eval_iters: AtLeast1[int] = 200  # batches per split in an eval
    eval_only: bool = False  # evaluate once and exit
    always_save_checkpoint: bool = True  # else save only when the val loss improves
    init_from: str = "scratch"  # scratch, resume, auto (resume if out_dir has one), gpt2*, a HF folder, a checkpoint
    keep_last: AtLeast0[int] = 0  # also keep the last K checkpoints as ckpt_0000300.pt (0: only ckpt.pt)
    checkpoint_interval: AtLeast0[int] = 0  # also save every this many iterations between evals (0: at evals only)
    checkpoint_minutes: AtLeast0[float] = 0.0  # also save once this many minutes passed since the last save (0: off)
    async_save: bool = False  # FSDP: write the shards in the background while training goes on (DCP's async_save)
    report: bool = True  # at the end, write out_dir/report.md: command, machine, settings, speed, losses, a sample

    # logging
    wandb_log: bool = False  # log to Weights & Biases too (pip install wandb)
    wandb_project: str = "owt"
    wandb_run_name: str = "gpt2"
    hellaswag: bool = False  # also score HellaSwag (acc, acc_norm; see hellaswag.py) at evals
    hellaswag_interval: AtLeast0[int] = 0  # ... only every this many steps, a multiple of eval_interval (0: every eval)
    hellaswag_path: str | None = None  # a HellaSwag-format file; None: the validation set, downloaded once

    # learning rate schedule: linear warmup, then cosine decay to min_lr
    max_iters: AtLeast0[int] = 600000  # optimizer steps
    decay_lr: bool = True  # warmup, then cosine to min_lr; False: learning_rate throughout
    warmup_iters: AtLeast0[int] = 2000  # linear warmup steps
    lr_decay_iters: AtLeast0[int | None] = None  # None: max_iters (~ Chinchilla: about max_iters)
    min_lr: AtLeast0[float] = 6e-5  # ~ learning_rate / 10
    max_nonfinite_skips: AtLeast0[int] = 0  # steps with a non-finite loss or grad norm skipped per run, then an error

    # system
    backend: Annotated[str, OneOf("auto", "nccl", "gloo")] = "auto"  # DDP's; auto: nccl on CUDA, gloo on the CPU
    parallelism: Annotated[str, OneOf("ddp", "fsdp")] = "ddp"  # ddp: a full copy per rank; fsdp: sharded (FSDP2)
    activation_checkpointing: AtLeast0[bool | int] = False  # recompute activations in the backward: True, or N blocks

    def problems(self, world_size: int = 1) -> list[str]:
        problems = super().problems(world_size)
        if self.async_save and self.parallelism != "fsdp":
            problems.append(f"async_save=True writes FSDP's sharded checkpoints, and parallelism={self.parallelism!r} "
                            f"saves one file: set parallelism='fsdp' or async_save=False")
        if self.init_from not in ("scratch", "resume", "auto", *GPT2_MODELS) and not os.path.exists(self.init_from):
            problems.append(f"init_from={self.init_from!r} is not one of scratch, resume, auto, "
                            f"{', '.join(GPT2_MODELS)}, a folder with a HF GPT-2 model, a checkpoint file or sharded "
                            f"folder, or a run's out_dir")
        if self.eval_interval >= 1 and self.hellaswag_interval % self.eval_interval:
            problems.append(f"hellaswag_interval={self.hellaswag_interval} must be 0 or a multiple of eval_interval="
                            f"{self.eval_interval} (HellaSwag runs at evals)")
        if (wandb := wandb_problem(self)) is not None:
            problems.append(wandb)
        if (type(self.activation_checkpointing) is int and self.activation_checkpointing > self.n_layer
                and self.init_from == "scratch"):  # other starts take their depth from the weights (parallel.py)
            problems.append(f"activation_checkpointing={self.activation_checkpointing} must be True, False or a number "
                            f"of blocks 0..{self.n_layer} (n_layer={self.n_layer})")
        with contextlib.suppress(UserError):  # a device that cannot run here is machine_problems'
            if self.backend == "nccl" and not (device := resolve_device(self.device)).startswith("cuda"):
                problems.append(f"backend='nccl' needs CUDA but device={device!r}: use --backend=gloo (or auto)")
        problems += self.fsdp_problems()
        return problems

    def fsdp_problems(self) -> list[str]:
        """What parallelism="fsdp" cannot do."""
        if self.parallelism != "fsdp":
            return []
        problems = []
        if self.dtype == "float16":
            problems.append("dtype='float16' is not supported with parallelism='fsdp' (no sharded grad scaler here): "
                            "use bfloat16 or float32")
        if self.hellaswag:  # its ranks score different numbers of batches, while FSDP's forwards are collective
            problems.append("hellaswag=True is not supported with parallelism='fsdp' yet: score the checkpoint with "
                            "python hellaswag.py instead")
        if self.keep_last:
            problems.append(f"keep_last={self.keep_last} is not supported with sharded checkpoints: set keep_last=0")
        if self.optimizer == "muon":  # a rank holds shards, Muon needs whole matrices
            problems.append("optimizer='muon' needs whole matrices, and parallelism='fsdp' shards them: use ddp")
        return problems


WANDB_FIX = ("run `wandb login` once, or log offline with WANDB_MODE=offline (upload later with `wandb sync`), or set "
             "--wandb_log=False")


def wandb_problem(cfg: TrainConfig) -> str | None:
    """Why wandb_log=True would fail, asked before anything slow: wandb not installed, or (logging online) no API key
    for its server, which wandb.init would ask for once the run is under way. wandb answers by its own rules (the
    environment, the netrc entry `wandb login` writes, its settings files), without a prompt or the network."""
    if not cfg.wandb_log:
        return None
    try:
        optional_import("wandb", "wandb_log=True")
    except UserError as e:
        return f"{e} (or --wandb_log=False)"
    try:  # wandb's own reading of its credentials; a wandb of another shape than 0.31's: its init will tell
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings  # what wandb.init reads: WANDB_MODE, WANDB_BASE_URL, its files
        if settings.mode in ("offline", "dryrun", "disabled"):
            return None
        if wbauth.authenticate_session(host=settings.base_url, source="train.py", prompt=False, update_session=False):
            return None
    except (ImportError, AttributeError, TypeError):
        return None
    except AuthenticationError as e:  # a key of the wrong form
        return f"wandb_log=True but wandb cannot use its credentials ({e}): {WANDB_FIX}"
    return f"wandb_log=True but wandb has no API key for {settings.base_url}: {WANDB_FIX}"
