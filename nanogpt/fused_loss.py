"""
The fused linear + cross-entropy of the language-model head: the loss of x @ weight.T against the targets, computed
chunk by chunk, with its gradients, so that the (tokens x vocab) logits never exist at once.

GPT.forward (model.py) uses it for the loss of a call that wants no logits (return_logits=False) where it is the
model's head_loss (fused_loss=True: step.set_head_loss): the training step and evaluation. It takes plain tensors, a function of the head's inputs
only: Imports torch alone, nothing of the project's (no model, no script).
"""
from __future__ import annotations

import torch

# Rows (tokens) per chunk of the fused loss. Each chunk holds a (rows, padded vocab) logits block in the compute
# dtype and one in float32; for GPT-2's 50304 rows, 256 tokens are ~50 + 50 MB (bf16) instead of the whole batch's
# logits, log-softmax and their gradient (~2.5 GB per 12 x 1024 micro-batch in float32). Fewer, larger chunks
# keep the weight-gradient matmul (K = rows) efficient and read/write the (vocab, C) gradient fewer times.
LOSS_CHUNK_ROWS = 256


def _loss_chunks(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, compute_dtype: torch.dtype,
    chunk_rows: int, with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """
    Sum over the rows of cross_entropy(x @ weight.T, targets) (targets -1 ignored, the weight rows from vocab_size
    on masked out), chunk by chunk; with_grad also returns its gradients with respect to x and weight, computed
    from each chunk's softmax while it is at hand. Matmuls run in compute_dtype, softmax statistics in float32
    (float64 for a float64 model).
    x (N, C), weight (Vp, C), targets (N,) -> loss_sum (), grad_x (N, C) like x, grad_w (Vp, C) float32.
    """
    N = x.size(0)
    w = weight.to(compute_dtype)  # one cast per call, as autocast's F.linear would do
    acc_dtype = torch.promote_types(compute_dtype, torch.float32)  # float32, or float64 for a float64 model
    loss_sum = torch.zeros((), dtype=acc_dtype, device=x.device)
    grad_x = torch.empty_like(x) if with_grad else None
    # the first chunk writes grad_w (no zero fill first); with no rows there is no chunk, and the gradient is zero
    grad_w = (torch.empty if N else torch.zeros)(weight.shape, dtype=acc_dtype, device=x.device) if with_grad else None
    # One (rows, Vp) block for every chunk: a fresh ~50 MB tensor per chunk would be new memory each time (on the
    # CPU, glibc maps blocks this large afresh, and the page faults cost ~30% of the head matmul).
    block = torch.empty(min(chunk_rows, N), weight.size(0), dtype=acc_dtype, device=x.device)
    for start in range(0, N, chunk_rows):
        xc = x[start : start + chunk_rows].to(compute_dtype)  # (n, C)
        tc = targets[start : start + chunk_rows]  # (n,)
        n = xc.size(0)
        logits = block[:n]  # (n, Vp) in acc_dtype
        if compute_dtype == acc_dtype:
            torch.mm(xc, w.t(), out=logits)
        else:
            logits.copy_(xc @ w.t())
        logits[:, vocab_size:] = float("-inf")  # padded rows: probability 0, hence gradient 0
        valid = tc != -1
        tc_safe = tc.clamp(min=0)  # any real row for the ignored ones; their terms are masked below
        target_logit = logits.gather(1, tc_safe[:, None]).squeeze(1)  # (n,)
        # log-sum-exp in place (torch.logsumexp would write a second (n, Vp) block and exponentiate it again below)
        row_max = logits.amax(dim=1, keepdim=True)  # (n, 1)
        exps = logits.sub_(row_max).exp_()  # (n, Vp), block reused
        sum_exp = exps.sum(dim=1)  # (n,)
        lse = row_max.squeeze(1) + sum_exp.log()  # (n,)
        # not `+=`: an in-place add to the output of the autograd.Function's forward made torch.compile (2.11, CUDA,
        # even with aot_eager) return zero gradients for x and weight; found by the CUDA suite on an H100
        loss_sum = loss_sum + torch.where(valid, lse - target_logit, 0.0).sum()
        if with_grad:
            # d loss / d logits = softmax - onehot(target); ignored rows get 0 (their scale is 0)
            probs = exps.mul_((valid / sum_exp)[:, None])
            grad_logits = probs.scatter_add_(1, tc_safe[:, None], -valid[:, None].to(acc_dtype)).to(compute_dtype)
            grad_x[start : start + n] = grad_logits @ w  # (n, Vp) x (Vp, C) -> (n, C)
            # (Vp, n) x (n, C): the first chunk writes grad_w, the others add to it (addmm_ cannot mix dtypes, so
            # under autocast each chunk's product is made in compute_dtype and summed in float32)
            if compute_dtype == acc_dtype and start == 0:
                torch.mm(grad_logits.t(), xc, out=grad_w)
            elif compute_dtype == acc_dtype:
                grad_w.addmm_(grad_logits.t(), xc)
            elif start == 0:
                grad_w.copy_(grad_logits.t() @ xc)
            else:
                grad_w += grad_logits.t() @ xc
    return loss_sum, grad_x, grad_w


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The gradients are computed in the forward, chunk by chunk (as Liger-Kernel's and PyTorch's chunked
    linear_cross_entropy do), so the backward only scales them: the head costs its three matmuls, as the plain
    path, and no (tokens x vocab) tensor lives until the backward."""

    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size, compute_dtype, chunk_rows):
        loss_sum, grad_x, grad_w = _loss_chunks(x, weight, targets, vocab_size, compute_dtype, chunk_rows, True)
        ctx.save_for_backward(grad_x, grad_w.to(weight.dtype))
        return loss_sum

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_out.to(grad_x.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None


def fused_linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_rows: int = LOSS_CHUNK_ROWS
) -> torch.Tensor:
    """
    Sum over rows of F.cross_entropy(x @ weight.T, targets, ignore_index=-1, reduction="sum"), with the weight's
    rows from vocab_size on (vocabulary padding) excluded, without forming the (N, Vp) logits.
    x (N, C), weight (Vp, C), targets (N,). Under autocast the matmuls run in its dtype (bf16), as F.linear would.
    """
    if x.device.type == "cuda":
        return _eager()(x, weight, targets, vocab_size, chunk_rows)
    return _fused(x, weight, targets, vocab_size, chunk_rows)


def _fused(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk_rows: int):
    device_type = x.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    # Our own casts decide each op's dtype: autocast must not recast the float32 softmax statistics.
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _FusedLinearCrossEntropy.apply(x, weight, targets, vocab_size, compute_dtype, chunk_rows)
        return _loss_chunks(x, weight, targets, vocab_size, compute_dtype, chunk_rows, with_grad=False)[0]


_EAGER: list = []


def _eager():
    """_fused, run eagerly inside a compiled model (made on first use: torch.compiler imports torch._dynamo, which
    a script that never compiles should not pay for). On a GPU, traced, the chunk loop is unrolled and inductor gives
    every chunk's logits block a buffer of its own, all alive at once (more memory than the plain loss); on a CPU
    the traced loss is faster and keeps most of the saving."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_fused))
    return _EAGER[0]
