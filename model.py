"""
A GPT-2-style language model in one file that imports torch and the standard library only: GPTConfig,
CausalSelfAttention, MLP, Block and GPT, with nanoGPT's API: `GPT(GPTConfig(...))`, `logits, loss = model(idx,
targets)`, `GPT.from_pretrained("gpt2")`, `model.generate(idx, max_new_tokens)`, `configure_optimizers`, `estimate_mfu`.
References: OpenAI's GPT-2 and HF transformers' port, by way of nanoGPT, whose module and parameter names it keeps, so
GPT-2's weights map onto it one to one.

The speed settings change nothing the model computes beyond float rounding: attention="math" (the reference) or
"sdpa", sdpa_backend (the SDPA kernel), vocab_padding_multiple (50257 -> 50304 rows for GPT-2, the extra logits masked
out), and `model.head_loss`, a loss the caller hands in for the loss-only forward (e.g. the head and cross-entropy
chunk by chunk). gelu changes it slightly: "tanh" (GPT-2's approximation, which its weights need) or "erf" (exact).
A bad argument is a ValueError.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

ATTENTION_CHOICES = ("math", "sdpa")
SDPA_BACKENDS = {"auto": None,  # None: PyTorch picks the fastest kernel that can run
                 "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
GELU_CHOICES = ("tanh", "erf")
# HF transformers' activation_function names of the two GELU forms (GPTConfig.gelu)
HF_ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}
# HF's GPT-2 uses Conv1D modules whose weights are stored (in, out), where nn.Linear's are (out, in)
HF_CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # the tokenizer's real size (GPT-2 BPE: 50257)
    vocab_padding_multiple: int = 64  # pad embedding/head rows up to a multiple of this (1: no padding)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, as GPT-2; False is a bit better and faster
    attention: str = "sdpa"  # "math" (explicit softmax(q·kᵀ/√d)·v) or "sdpa" (F.scaled_dot_product_attention)
    sdpa_backend: str = "auto"  # with attention="sdpa": "auto", "flash", "efficient", "cudnn" or "math"
    gelu: str = "tanh"  # "tanh": GPT-2's approximation (its weights need it); "erf": the exact GELU

    def __post_init__(self) -> None:
        problems = []
        if self.attention not in ATTENTION_CHOICES:
            problems.append(f"attention={self.attention!r} is not one of {', '.join(ATTENTION_CHOICES)}")
        if self.sdpa_backend not in SDPA_BACKENDS:
            problems.append(f"sdpa_backend={self.sdpa_backend!r} is not one of {', '.join(SDPA_BACKENDS)}")
        if self.gelu not in GELU_CHOICES:
            problems.append(f"gelu={self.gelu!r} is not one of {', '.join(GELU_CHOICES)}")
        sizes = ("block_size", "vocab_size", "vocab_padding_multiple", "n_layer", "n_head", "n_embd")
        for name in sizes:
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} must be an int, at least 1")
        if not problems and self.n_embd % self.n_head:
            problems.append(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if type(self.dropout) not in (int, float) or not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout={self.dropout!r} must be in [0, 1)")
        if not isinstance(self.bias, bool):
            problems.append(f"bias={self.bias!r} must be True or False")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_padding_multiple
        return (self.vocab_size + m - 1) // m * m


def hf_config_args(hf_config) -> dict:
    """GPTConfig's architecture arguments for an HF GPT2Config; options this model does not implement are refused."""
    activation = getattr(hf_config, "activation_function", "gelu_new")
    if activation not in HF_ACTIVATIONS:
        raise ValueError(f"unsupported GPT-2 activation {activation!r}: this model supports {', '.join(HF_ACTIVATIONS)}")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"unsupported GPT-2 option {flag}=True")
    return dict(block_size=hf_config.n_positions, vocab_size=hf_config.vocab_size, n_layer=hf_config.n_layer,
                n_head=hf_config.n_head, n_embd=hf_config.n_embd, bias=True, gelu=HF_ACTIVATIONS[activation])


def causal_mask(T: int, device: torch.device | str) -> torch.Tensor:
    """The (T, T) boolean "may attend" mask: query i sees keys 0..i. Built where needed, not a (block_size,
    block_size) buffer per layer: plain causal SDPA needs none (is_causal), a KV cache masks by position."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.attention = config.attention
        self.sdpa_backend = config.sdpa_backend
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = True  # a residual projection: GPT-2 scales its init by 1/sqrt(2 * n_layer)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, kv_cache=None,
                pos: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """kv_cache: keys and values of earlier positions (update(layer, k, v, pos) stores this layer's and returns
        what attention reads; static: it returns every slot, written or not). pos: (T,) the positions of x's rows.
        last_only: the output of the last position only, (B, 1, C): every row's key and value, one query."""
        B, T, C = x.size()  # batch, sequence length, n_embd
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        if last_only:  # the last query sees every key: no mask
            assert key_padding_mask is None and kv_cache is None, "last_only is a whole window's last position"
            q, T = q[:, -1:], 1
        q = q.reshape(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, -1, self.n_head, hs).transpose(1, 2)  # (B, nh, S, hs)
        v = v.view(B, -1, self.n_head, hs).transpose(1, 2)  # (B, nh, S, hs)

        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, pos)  # (B, nh, S, hs): S = cache size, or slots written
            if kv_cache.static or T not in (1, k.size(2)):
                # the query at position p sees slots 0..p: those written so far, never the unwritten rest
                slots = torch.arange(k.size(2), device=x.device)  # (S,)
                mask = (slots <= pos[:, None]).view(1, 1, T, -1)  # (1, 1, T, S)
            else:  # eager: one new query sees every slot read, or a prefill from 0 is plain causal attention
                mask = None
        else:
            mask = self._mask(T, key_padding_mask, x.device)  # None (plain causal), or (B, 1, T, T) bool

        if self.attention == "math":
            y = self._math_attention(q, k, v, mask)
        else:
            y = self._sdpa(q, k, v, mask, is_causal=mask is None and T > 1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def _mask(self, T: int, key_padding_mask: torch.Tensor | None, device) -> torch.Tensor | None:
        """The boolean "may attend" mask, or None where plain causal attention is exact. key_padding_mask: (B, T),
        HF's attention_mask (right padding), for batches of sequences of different lengths."""
        if key_padding_mask is None:
            return None
        causal = causal_mask(T, device)  # (T, T)
        mask = causal & key_padding_mask.bool()[:, None, None, :]  # (B, 1, T, T)
        # A padding query with no real key before it would see nothing, and softmax over nothing is NaN;
        # letting every query see itself keeps it finite and changes no real token (they see themselves anyway).
        return mask | torch.eye(T, dtype=torch.bool, device=mask.device)

    def _math_attention(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """The reference: softmax(q·kᵀ/√hs, the scores of keys a query may not see set to -inf)·v."""
        T = q.size(-2)
        if mask is None and T > 1:  # plain causal (one query, a window's last or a cached step's, sees every key)
            mask = causal_mask(T, q.device)  # (T, T)
        att = (q * (1.0 / math.sqrt(q.size(-1)))) @ k.transpose(-2, -1)  # (B, nh, T, S)
        if mask is not None:  # replaced, not added to: a float16 score that overflowed to inf would give NaN
            att = att.masked_fill(~mask, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        return att @ v  # (B, nh, T, S) x (B, nh, S, hs) -> (B, nh, T, hs)

    def _sdpa(self, q, k, v, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        dropout_p = self.dropout if self.training else 0.0
        backend = SDPA_BACKENDS[self.sdpa_backend]
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        with sdpa_kernel(backend):
            try:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                      is_causal=is_causal)
            except RuntimeError as e:  # PyTorch's refusal names no kernel: its CPU and CUDA wordings
                if not any(s in str(e) for s in ("No viable backend", "No available kernel")):
                    raise  # another error (out of memory, a shape): as it is
                raise RuntimeError(
                    f"sdpa_backend={self.sdpa_backend!r} cannot run this attention on {q.device.type} with dtype "
                    f"{q.dtype}{' and dropout' if dropout_p else ''}: choose another sdpa_backend, or 'auto' "
                    f"(PyTorch: {e})") from None


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh" if config.gelu == "tanh" else "none")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.SCALE_INIT = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, key_padding_mask=None, kv_cache=None, pos=None, last_only=False):
        """last_only: the last position's output only (B, 1, C), which needs every position's keys and values but
        one query, one attention row and one MLP row (the last block of a window whose next token is wanted)."""
        h = self.attn(self.ln_1(x), key_padding_mask, kv_cache, pos, last_only)  # (B, T or 1, C)
        x = (x[:, -1:] if last_only else x) + h
        x = x + self.mlp(self.ln_2(x))
        return x


class _SkippedInit(TorchFunctionMode):
    """Inside it, torch.nn.init's random and constant initialisers (normal_, uniform_, kaiming_uniform_, constant_:
    what nn.Linear, nn.Embedding and GPT._init_weights call) return their tensor as it is: allocated, not written,
    and the RNG not drawn from. Every other torch call runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The plain loss: the sum of cross_entropy over the targets that are not -1. logits (..., padded vocab) are
    overwritten in the padding columns: padded rows are not tokens, and -inf logits give them zero probability and
    zero gradient, so the loss equals that of the unpadded model while the matmul keeps its fast multiple-of-64
    shape. targets (...) of any strides."""
    if logits.size(-1) > vocab_size:
        logits[..., vocab_size:] = float("-inf")
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction="sum")


class GPT(nn.Module):
    @classmethod
    def uninitialized(cls, config: GPTConfig) -> "GPT":
        """A GPT of `config` whose weights are allocated but not initialised, for a caller that writes every one of
        them next (a checkpoint's, GPT-2's): the random init is most of the time a build takes, and a load throws it
        away. The global RNG is left as it was; the head stays tied to the token embedding."""
        with _SkippedInit():
            return cls(config)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        with _SkippedInit():  # the tied table: drawn by _init_weights, for its real rows only
            wte = nn.Embedding(config.padded_vocab_size, config.n_embd)
            lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.transformer = nn.ModuleDict(dict(
            wte=wte, wpe=nn.Embedding(config.block_size, config.n_embd), drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = lm_head
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        # The loss of a forward that wants no logits (return_logits=False): None, cross_entropy_sum of the full
        # logits; or the caller's (x (N, C), lm_head.weight, targets (N,), vocab_size) -> the same sum, e.g. the
        # head and loss chunk by chunk, which never holds the (N, padded vocab) logits.
        self.head_loss = None

    def _init_weights(self, module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        if weight is self.lm_head.weight:  # the padding rows are zeros, and no random number is drawn for them: the
            torch.nn.init.zeros_(weight)  # same seed gives the same model whatever vocab_padding_multiple is
            weight = weight.detach()[: self.config.vocab_size]
        if isinstance(module, nn.Linear):
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if getattr(module, "SCALE_INIT", False) else 0.02
            torch.nn.init.normal_(weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the position embeddings are left out by default (the token embedding is the
        head's weight, so it counts as compute)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache=None,
                return_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx: (B, T) token ids. targets: (B, T) ids, -1 where the loss ignores a position.
        attention_mask: optional (B, T), 1/True for real tokens, 0/False for padding (padding on the right).
        kv_cache: optional KV cache (CausalSelfAttention.forward); idx then holds only the positions after those
        already cached. Returns logits (B, T, vocab_size) over the real vocabulary, and the mean loss over non-ignored
        targets (None without targets), as nanoGPT's `logits, loss = model(X, Y)`. return_logits=False, for callers
        that need only the loss: (None, loss), computed by self.head_loss where one is set."""
        x = self._hidden(idx, attention_mask, kv_cache)  # (B, T, C)
        # mean over the targets that count; a batch with none (all -1) has loss 0 and no gradient, not NaN
        n_targets = None if targets is None else (targets != -1).sum().clamp(min=1)
        if targets is not None and not return_logits and self.head_loss is not None:
            C, V = x.size(-1), self.config.vocab_size
            return None, self.head_loss(x.view(-1, C), self.lm_head.weight, targets.reshape(-1), V) / n_targets
        logits = self.lm_head(x)  # (B, T, padded_vocab_size)
        loss = None if targets is None else cross_entropy_sum(logits, targets, self.config.vocab_size) / n_targets
        return (logits[..., : self.config.vocab_size] if return_logits else None), loss

    def _hidden(self, idx, attention_mask=None, kv_cache=None) -> torch.Tensor:
        B, T = idx.size()
        past = kv_cache.pos if kv_cache is not None else 0
        if past + T > self.config.block_size:
            raise ValueError(f"sequence of {past + T} tokens is longer than block_size={self.config.block_size}: "
                             f"crop the input to the last {self.config.block_size} tokens")
        if kv_cache is not None and past + T > kv_cache.size:
            raise ValueError(f"{past + T} positions do not fit the KV cache, which holds {kv_cache.size}")
        if attention_mask is not None and kv_cache is not None:
            raise ValueError("attention_mask and kv_cache cannot be combined: generate one sequence length at a time")
        pos = torch.arange(past, past + T, dtype=torch.long, device=idx.device)  # (T,)
        if kv_cache is not None:
            kv_cache.length = past + T
        x = self._blocks(idx, pos, attention_mask, kv_cache)
        if kv_cache is not None:
            kv_cache.pos += T
        return x

    def _blocks(self, idx, pos, attention_mask=None, kv_cache=None, last_only=False) -> torch.Tensor:
        """The hidden states (B, T, C) after ln_f of ids idx (B, T) at positions pos (T,), a tensor: the
        compiled decoding step calls this with the same shapes at every position. last_only: (B, 1, C), the last
        position's, whose last block runs for that position alone."""
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        *blocks, last = self.transformer.h
        for block in blocks:
            x = block(x, attention_mask, kv_cache, pos)
        x = last(x, attention_mask, kv_cache, pos, last_only)  # (B, T, C), or (B, 1, C) if last_only
        return self.transformer.ln_f(x)

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the context (e.g. GPT-2's 1024) to a smaller block_size, for fine-tuning on short sequences."""
        if not 1 <= block_size <= self.config.block_size:
            raise ValueError(f"block_size={block_size} must be between 1 and the model's {self.config.block_size}")
        self.config.block_size = block_size
        # a copy, not a view: a view would keep the whole larger table alive
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size].clone())
        self.transformer.wpe.num_embeddings = block_size

    def set_attention(self, attention: str) -> None:
        """Run every layer's attention through `attention` ("math" or "sdpa"): the same weights, another path."""
        self.config = replace(self.config, attention=attention)  # GPTConfig checks the name
        for block in self.transformer.h:
            block.attn.attention = attention

    # ------------------------------------------------------------------------------------------- GPT-2 weights

    @classmethod
    def from_pretrained(cls, model_type: str, override_args: dict | None = None,
                        vocab_padding_multiple: int = 64) -> "GPT":
        """GPT-2's weights through HF transformers (imported here): "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", or a
        local folder written by `save_pretrained`. Only `dropout`, `attention` and `sdpa_backend` may be overridden."""
        override_args = dict(override_args or {})
        allowed = {"dropout", "attention", "sdpa_backend"}
        if set(override_args) - allowed:
            raise ValueError(f"cannot override {sorted(set(override_args) - allowed)} of GPT-2; only {sorted(allowed)}")
        from transformers import GPT2LMHeadModel

        hf_model = GPT2LMHeadModel.from_pretrained(model_type)
        return cls.from_hf_model(hf_model, vocab_padding_multiple=vocab_padding_multiple, **override_args)

    @classmethod
    def from_hf_model(cls, hf_model, vocab_padding_multiple: int = 64, **overrides) -> "GPT":
        """Our GPT with the config and weights of an HF GPT2LMHeadModel: every key and shape checked, HF's Conv1D
        weights transposed, the padding rows of the embedding zeroed."""
        model = cls.uninitialized(GPTConfig(**hf_config_args(hf_model.config),
                                            vocab_padding_multiple=vocab_padding_multiple, **overrides))
        sd = model.state_dict()
        sd_hf = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        ours = set(sd) - {"lm_head.weight"}  # tied to transformer.wte.weight
        theirs = set(sd_hf) - {"lm_head.weight"}
        if ours != theirs:
            raise ValueError(f"GPT-2 checkpoint keys differ: missing {sorted(ours - theirs)[:5]}, "
                             f"unexpected {sorted(theirs - ours)[:5]}")
        vocab_size = model.config.vocab_size
        with torch.no_grad():
            for k in sorted(theirs):
                src = sd_hf[k].t() if k.endswith(HF_CONV1D_WEIGHTS) else sd_hf[k]  # (in, out) -> (out, in)
                dst = sd[k]
                if k == "transformer.wte.weight":  # our table may have extra (padding) rows: copy the real ones
                    dst = dst[:vocab_size]
                    sd[k][vocab_size:].zero_()
                if src.shape != dst.shape:
                    raise ValueError(f"GPT-2 checkpoint key {k} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(src)
        return model

    # ------------------------------------------------------------------------------------------- training helpers

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str, fused: bool | None = None, verbose: bool = True,
                             params: list[nn.Parameter] | None = None) -> torch.optim.AdamW:
        """AdamW with weight decay on 2-D weights (matmuls, embeddings) only; biases and LayerNorms are not decayed.
        fused=None: the fused kernel on CUDA, as nanoGPT's. params: a subset to optimize (default: all)."""
        if params is None:
            params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if fused is None:
            fused = device_type == "cuda"
        optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)
        if verbose:
            impl = "fused" if fused else ("foreach" if device_type == "cuda" else "for-loop")
            print(f"optimizer: AdamW ({impl}), {len(decay)} decayed tensors ({sum(p.numel() for p in decay):,} "
                  f"params), {len(no_decay)} not decayed ({sum(p.numel() for p in no_decay):,} params)")
        return optimizer

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token (forward + backward), PaLM appendix B: 6N for the matmuls with the weights,
        plus 12·L·H·Q·T for attention scores and values."""
        cfg = self.config
        T = seq_len or cfg.block_size
        N = self.get_num_params()
        return 6 * N + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    def estimate_mfu(self, fwdbwd_per_iter: int, dt: float, peak_flops: float | None,
                     seq_len: int | None = None) -> float | None:
        """Model FLOPs utilisation: achieved FLOP/s over the device's peak `peak_flops` (bf16 dense: an A100's is
        312e12). None where no peak is known: nanoGPT's took an A100's for every device, a CPU too."""
        if peak_flops is None or dt <= 0:
            return None
        T = seq_len or self.config.block_size
        return self.flops_per_token(T) * T * fwdbwd_per_iter / dt / peak_flops

    # ------------------------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """nanoGPT's loop: idx (B, T) extended by max_new_tokens tokens, each drawn from softmax(logits / temperature)
        over the top_k most likely (temperature 0: the most likely one), the whole context (its last block_size
        tokens) run through the model again for every token: the reference a KV cache's decoding must match.
        Call model.eval() first."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)  # (B, T, vocab_size)
            logits = logits[:, -1, :].float()  # (B, vocab_size)
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                probs = F.softmax(logits, dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
