"""
The optimizer train.py steps: AdamW for every parameter (nanoGPT's), or Muon for the weight matrices inside the
transformer blocks and AdamW for the rest (embeddings, the tied head, LayerNorms and biases), as modded-nanogpt
and nanochat split them.

Muon (torch.optim.Muon, torch >= 2.9) replaces each matrix's update by its momentum orthogonalised with a few
Newton-Schulz iterations, so every direction of the matrix moves by about the same amount. It suits the hidden
matrices only: the embedding table's rows are looked up one token at a time, not multiplied as a whole.

Both are held by one `Optimizers` object, which looks like a torch optimizer to the rest of train.py
(param_groups, step, zero_grad, state_dict, load_state_dict), so the grad scaler, gradient clipping, the
non-finite guard, accumulation, DDP and checkpoints treat it as one. Under DDP the gradients are all-reduced
in backward, before the step, so every rank orthogonalises the same full gradient and the ranks stay equal.
"""
from __future__ import annotations

import math

import torch

from nanogpt.text import plural
from nanogpt.errors import UserError
from nanogpt.hardware import fused_adamw_available

OPTIMIZERS = ("adamw", "muon")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Optimizers:
    """Torch optimizers over disjoint parameters, stepped together. `set_lr(lr)` sets each group's learning rate
    to lr times the group's scale (1 for AdamW; muon_learning_rate / learning_rate for Muon), so one schedule
    drives them all."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], lr_scales: dict[str, float]):
        self.optimizers = optimizers
        self.lr_scales = lr_scales

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def as_torch(self):
        """The torch optimizer itself where there is one (AdamW): what torch.distributed.checkpoint's state dicts
        (FSDP) take; else this object."""
        return self.optimizers["adamw"] if list(self.optimizers) == ["adamw"] else self

    def set_lr(self, lr: float) -> None:
        for name, opt in self.optimizers.items():
            for group in opt.param_groups:
                group["lr"] = lr * self.lr_scales[name]

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        # AdamW alone saves its own state dict, as nanoGPT's checkpoints hold it (they resume here, and back)
        if list(self.optimizers) == ["adamw"]:
            return self.optimizers["adamw"].state_dict()
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        if list(self.optimizers) == ["adamw"]:
            self.optimizers["adamw"].load_state_dict(state)
            return
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state[name])


def hidden_matrices(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 2-D weights inside the transformer blocks (attention and MLP projections): Muon's parameters."""
    return [p for p in model.transformer.h.parameters() if p.requires_grad and p.dim() == 2]


def muon_class() -> type[torch.optim.Optimizer]:
    """torch.optim.Muon, with a choice of the dtype its Newton-Schulz iteration runs in. Torch's runs it in bfloat16,
    which CPUs without bf16 instructions (AVX2-only ones, e.g. AMD Zen 3) emulate, far slower than float32."""
    if not hasattr(torch.optim, "Muon"):
        raise UserError(
            f"optimizer='muon' needs torch.optim.Muon (torch >= 2.9), and this is torch {torch.__version__}: "
            f"upgrade torch, or use optimizer='adamw'"
        )

    class Muon(torch.optim.Muon):
        reads_skip = True  # step(skip=) decides on the device (step_unless)

        def __init__(self, params, ns_dtype: torch.dtype = torch.bfloat16, **kw):
            super().__init__(params, **kw)
            self.ns_dtype = ns_dtype

        @torch.no_grad()
        def step(self, skip: torch.Tensor | None = None) -> None:
            """skip: a 0-dim tensor on the parameters' device, nonzero to leave parameters and momentum as they are:
            the step is computed and then not kept, so deciding never waits for the device."""
            # torch.optim._muon._single_tensor_muon (2.9-2.13), with newton_schulz in ns_dtype
            keep_old = None if skip is None else skip.bool()
            for group in self.param_groups:
                lr, momentum = group["lr"], group["momentum"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad)
                    buf = state["momentum_buffer"]
                    new_buf = buf.lerp(p.grad, 1 - momentum)
                    update = p.grad.lerp(new_buf, momentum) if group["nesterov"] else new_buf
                    update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"],
                                           self.ns_dtype)
                    new_p = p.mul(1 - lr * group["weight_decay"])
                    new_p.add_(update, alpha=-muon_lr(lr, group["adjust_lr_fn"], p.shape))
                    if keep_old is not None:
                        new_buf, new_p = torch.where(keep_old, buf, new_buf), torch.where(keep_old, p, new_p)
                    buf.copy_(new_buf)
                    p.copy_(new_p)

    return Muon


def step_unless(optimizer, skip: torch.Tensor) -> None:
    """
    optimizer.step(), skipped where `skip` (a float32 0-dim tensor on the device, 1.0 or 0.0) says so, leaving the
    parameters and the optimizer's state as they were. The flag is read on the device, so the host queues the step
    without waiting: torch's fused optimizers (AdamW's default on CUDA and CPUs) take it as their found_inf, as the
    grad scaler passes it; Muon selects with it. An optimizer that can do neither (AdamW with fused_adamw=False, a
    plain torch optimizer) is stepped after reading the flag, which waits for the device.
    """
    if isinstance(optimizer, Optimizers):
        for opt in optimizer.optimizers.values():
            step_unless(opt, skip)
    elif getattr(optimizer, "reads_skip", False):
        optimizer.step(skip=skip)
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = skip  # what torch.amp.GradScaler sets for these optimizers
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif not skip.item():
        optimizer.step()


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """About U V^T of g = U S V^T (singular values pushed into ~[0.7, 1.2]): Keller Jordan's quintic iteration, as
    torch.optim.Muon runs it, in `dtype`. Returns `dtype`."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the wide form: the Gram matrix x @ x.T is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.T  # (m, m), m = min(rows, cols)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for a matrix of `shape` (rows, cols)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":  # Keller Jordan's: larger steps for tall matrices
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":  # Moonshot's: an update RMS like AdamW's
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def ns_dtype_for(setting: str, device_type: str) -> torch.dtype:
    """muon_ns_dtype: "auto" is bfloat16 (torch's choice) on GPUs and on CPUs with bf16 matmul kernels (oneDNN has
    them for AVX-512 and SVE), else float32."""
    if setting != "auto":
        return NS_DTYPES[setting]
    if device_type == "cpu" and torch.backends.cpu.get_cpu_capability() not in ("AVX512", "SVE256"):
        return torch.float32
    return torch.bfloat16


def build_optimizer(model, cfg, device_type: str, verbose: bool = True) -> Optimizers:
    """The optimizer that cfg.optimizer names (its settings checked: config.py), over `model`'s parameters
    (cfg: a StepConfig, config.py's TrainConfig or bench.py's BenchConfig)."""
    betas = (cfg.beta1, cfg.beta2)
    fused = cfg.fused_adamw if cfg.fused_adamw is not None else fused_adamw_available(device_type)
    if cfg.optimizer == "adamw":
        adamw = model.configure_optimizers(
            cfg.weight_decay, cfg.learning_rate, betas, device_type, fused=fused, verbose=verbose
        )
        return Optimizers({"adamw": adamw}, {"adamw": 1.0})
    muon_type = muon_class()
    hidden = hidden_matrices(model)
    hidden_ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden_ids]
    ns_dtype = ns_dtype_for(cfg.muon_ns_dtype, device_type)
    muon = muon_type(hidden, ns_dtype=ns_dtype, lr=cfg.muon_learning_rate, weight_decay=cfg.muon_weight_decay,
                     momentum=cfg.muon_momentum, nesterov=True)
    adamw = model.configure_optimizers(  # quiet: its line would describe AdamW as if it were the optimizer
        cfg.weight_decay, cfg.learning_rate, betas, device_type, fused=fused, verbose=False, params=rest,
    )
    if verbose:
        impl = "fused" if adamw.defaults.get("fused") else ("foreach" if device_type == "cuda" else "for-loop")
        print(f"optimizer: Muon on {len(hidden)} block matrices ({sum(p.numel() for p in hidden):,} params) at lr "
              f"{cfg.muon_learning_rate:g} (Newton-Schulz in {str(ns_dtype).removeprefix('torch.')}); AdamW ({impl}) "
              f"on the other {plural(len(rest), 'tensor')} (the embeddings and 1-D weights: "
              f"{sum(p.numel() for p in rest):,} params) at lr {cfg.learning_rate:g}")
    return Optimizers({"muon": muon, "adamw": adamw}, {"muon": cfg.muon_learning_rate / cfg.learning_rate,
                                                       "adamw": 1.0})
