"""The fused driver: the output projection, CE, KD and the student's gradients, chunk by chunk, in forward.

For each chunk of tokens the student's hidden states are projected to logits, the teacher gives its targets for
the same rows (a live teacher's logits or a cached top-k: teachers.py), CE and the KD divergence are computed, and
the gradient of the blended loss with respect to the student's logits is turned into gradients of the student's
hidden states and head weight right there. Backward only scales what forward stored. Compared with the
checkpointed driver (checkpointed.py) this drops the second projection of both heads in backward and never keeps
logits: one chunk of student and teacher logits is alive at a time. It needs the student's head as a plain
weight (``fusable_head_weight``); ``kd_and_ce`` (objective.py) picks the driver.

Why ours and not Liger-Kernel's ``LigerFusedLinearJSD``: it covers forward KL (beta 0) and JSD only (no
reverse/symmetric/skew, no CE in the same pass, so CE needs a second projection of the student's head), and
crashed at 16k tokens on torch 2.11 (issue 9's measurement); docs/losses.md says what is measured. Forward KL
+ CE (the default; CE alone too) has a closed-form gradient per teacher kind (``forward_kl_ce_chunk`` here for
logits, topk.py's for a cache), compiled on CUDA, where live logits take two Triton passes instead
(logits_kernel.py); the other divergences run their reference implementations on the chunk and take the gradient
with autograd, so every divergence gives the same gradients as the checkpointed path (tests/test_fused_loss.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..errors import RecipeError
from .checkpointed import ce_sum
from .divergences import IGNORE_INDEX
from .kd_loss import blend
from .logits_kernel import forward_kl_ce_logits, logits_kernel_available
from .rows import covering_positions

if TYPE_CHECKING:
    from .kd_loss import KDLoss
    from .rows import LossRows
    from .teachers import Teacher

__all__ = ["forward_kl_ce_chunk", "fusable_head_weight", "fused_loss"]

# rows of the flattened batch (a slice, or positions) -> the teacher's targets for them (logits, or a cached top-k)
TeacherRows = Callable[[slice | Tensor], Any]
# (student logits, teacher targets or None, labels) -> (ce_sum, kd_sum, d loss / d student logits)
ChunkFn = Callable[[Tensor, Any, Tensor], tuple[Tensor, Tensor, Tensor]]
# a closed-form chunk: ChunkFn with the loss weights, temperature and ignore_index as keywords
Kernel = Callable[..., tuple[Tensor, Tensor, Tensor]]


def fusable_head_weight(head: nn.Module) -> Tensor | None:
    """The plain weight of an output projection the fused loss can use, or None (LoRA, QAT, NF4, bias...)."""
    tied = getattr(head, "tied_module", None)  # torchtune's TiedLinear (output = input embedding)
    if tied is not None:
        weight = tied.weight
    elif type(head) is nn.Linear and head.bias is None:
        weight = head.weight
    else:
        return None
    return weight if type(weight) in (Tensor, nn.Parameter) else None


# ---------------------------------------------------------------------------------------------- chunk kernels


def forward_kl_ce_chunk(s: Tensor, t: Tensor | None, y: Tensor, ce_w: float, kd_w: float, temperature: float,
                        ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """CE sum, forward-KL sum (x T^2) and d(ce_w*CE + kd_w*KD)/d(student logits), all in closed form.

    d CE / ds = softmax(s) - onehot(y); d (T^2 KL(p_t^T || p_s^T)) / ds = T (softmax(s/T) - softmax(t/T)).
    Rows whose label is ignore_index contribute nothing (masked, so shapes stay static for compile).
    """
    dtype = torch.promote_types(s.dtype, torch.float32)
    s32 = s.to(dtype)
    valid = y != ignore_index
    vmask = valid.unsqueeze(1)
    lse = torch.logsumexp(s32, dim=-1, keepdim=True)
    log_ps = s32 - lse
    onehot = torch.arange(s.shape[1], device=s.device) == torch.where(valid, y, 0).unsqueeze(1)
    ce = torch.where(vmask & onehot, -log_ps, 0.0).sum()
    grad = ce_w * (log_ps.exp() - onehot.to(dtype))
    kd = ce.new_zeros(())
    if t is not None:
        if temperature == 1.0:
            log_qs = log_ps
        else:
            st = s32 / temperature
            log_qs = st - torch.logsumexp(st, dim=-1, keepdim=True)
        tt = t.to(dtype) / temperature
        log_pt = tt - torch.logsumexp(tt, dim=-1, keepdim=True)
        pt = log_pt.exp()
        # 0 * log 0 := 0 (masked teacher entries are -inf): where() before the product keeps NaN out.
        kl = torch.where(pt > 0, pt * (log_pt - torch.where(pt > 0, log_qs, 0.0)), 0.0)
        kd = torch.where(vmask, kl, 0.0).sum() * temperature**2
        grad = grad + (kd_w * temperature) * (log_qs.exp() - pt)
    grad = torch.where(vmask, grad, 0.0)
    return ce, kd, grad.to(s.dtype)


@functools.cache
def _compiled(kernel: Kernel) -> Kernel:
    # One compiled graph per chunk shape and loss weights: a fused pass over the logits instead of ~15-20 eager
    # kernels, each reading or writing a [chunk, vocab] fp32 tensor.
    return torch.compile(kernel, dynamic=False, fullgraph=True)


def _autograd_chunk(s: Tensor, t: Any, y: Tensor, kd_ratio: float, divergence: Callable[[Tensor, Any, Tensor], Tensor],
                    ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """Any divergence against any teacher's targets: its reference implementation on the chunk, the gradient of
    the blended loss w.r.t. the logits by autograd."""
    with torch.enable_grad():
        s = s.detach().requires_grad_(True)
        ce = ce_sum(s, y, ignore_index)
        kd = divergence(s, t, y)
        (grad,) = torch.autograd.grad(blend(ce, kd, kd_ratio), s)
    return ce.detach(), kd.detach(), grad


# ---------------------------------------------------------------------------------------------- autograd op


class _FusedLinearKDCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, teacher_rows: TeacherRows | None, labels: Tensor,
                chunk_fn: ChunkFn, rows: int, vocab: int | None, kd_ratio: float,
                order: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight if vocab is None else weight[:vocab]
        # with `order`, only those rows are projected: the others (no label) get a zero gradient
        grad_h = (torch.empty_like(hidden) if order is None else torch.zeros_like(hidden)) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        acc = torch.promote_types(hidden.dtype, torch.float32)
        ce = hidden.new_zeros((), dtype=acc)
        kd = hidden.new_zeros((), dtype=acc)
        for i in range(0, hidden.shape[0] if order is None else order.shape[0], rows):
            sel = slice(i, i + rows) if order is None else order[i:i + rows]
            h = hidden[sel]
            s = h @ w.t()
            t = None if teacher_rows is None else teacher_rows(sel)
            ce_c, kd_c, g = chunk_fn(s, t, labels[sel])
            del s, t
            ce += ce_c
            kd += kd_c
            if need_h:
                if order is None:
                    torch.mm(g, w, out=grad_h[sel])
                else:
                    grad_h.index_copy_(0, sel, g @ w)
            if need_w:
                grad_w[: w.shape[0]].addmm_(g.t(), h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(ce, kd)
        return blend(ce, kd, kd_ratio), ce, kd

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_kd):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * g_total.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = grad_w * g_total.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def fused_loss(hidden: Tensor, weight: Tensor, labels: Tensor, teacher: Teacher | None, kd_loss: KDLoss | None,
               kd_ratio: float, num_chunks: int, vocab_size: int | None, compile: bool,
               rows_with_labels: LossRows | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, ce_sum, kd_sum)`` for ``hidden [b, s, d]`` and the student's plain head ``weight [V, d]``, in
    ``num_chunks`` row chunks of the flattened batch; only the loss has grad. Arguments are checked by the caller
    (objective.py); ``compile`` compiles the closed-form forward-KL kernel. With ``rows_with_labels`` (rows.py),
    chunks of the same size run over the labelled rows first, and whole chunks of rows without a label are skipped:
    neither head is projected for them."""
    if vocab_size is not None and vocab_size > weight.shape[0]:
        raise RecipeError(f"loss vocab_size={vocab_size} exceeds the output head's {weight.shape[0]} rows")
    hidden = hidden.flatten(0, 1)
    if teacher is None or kd_loss.kind == "forward_kl":
        kernel = forward_kl_ce_chunk if teacher is None else teacher.forward_kl_kernel()
        if kernel is forward_kl_ce_chunk and logits_kernel_available(hidden):
            kernel = forward_kl_ce_logits  # CUDA: two Triton passes over the logits (logits_kernel.py)
        elif compile:
            kernel = _compiled(kernel)
        chunk_fn = functools.partial(kernel, ce_w=1.0 - kd_ratio, kd_w=kd_ratio,
                                     temperature=1.0 if kd_loss is None else kd_loss.temperature,
                                     ignore_index=IGNORE_INDEX)
    else:
        chunk_fn = functools.partial(_autograd_chunk, kd_ratio=kd_ratio,
                                     divergence=functools.partial(teacher.divergence, kd_loss=kd_loss),
                                     ignore_index=IGNORE_INDEX)
    teacher_rows = None if teacher is None else _rows_of(teacher, vocab_size)
    rows = -(-hidden.shape[0] // num_chunks)
    # whole chunks (the same shape as without, so compiled kernels are reused) cover the labelled rows
    order = None if rows_with_labels is None else covering_positions(rows_with_labels, hidden.shape[0], num_chunks, 0)
    return _FusedLinearKDCE.apply(hidden, weight, teacher_rows, labels.flatten(), chunk_fn, rows, vocab_size,
                                  kd_ratio, order)


def _rows_of(teacher: Teacher, vocab_size: int | None) -> TeacherRows:
    """Rows of the flattened batch (a slice, or positions) -> the teacher's targets for them."""
    flat = [t.flatten(0, 1) for t in teacher.tensors()]
    return lambda sel: teacher.targets(*(t[sel] for t in flat), vocab_size=vocab_size)
