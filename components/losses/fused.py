"""Fused linear CE + KD: the output projection, the losses and the student's gradients, chunk by chunk, in forward.

For each chunk of tokens the student's (and teacher's) hidden states are projected to logits, CE and the KD
divergence are computed, and the gradient of the weighted loss with respect to the student's logits is turned
into gradients of the student's hidden states and head weight right there. Backward only scales what forward
stored. Compared with ``chunked_kd_and_ce`` (checkpointed chunks) this drops the second projection of both
heads in backward and never keeps logits: one chunk of student and teacher logits is alive at a time.

Why ours and not Liger-Kernel's ``LigerFusedLinearJSD``: it covers forward KL (beta 0) and JSD only (no
reverse/symmetric/skew, no CE in the same pass, so CE needs a second projection of the student's head), and
crashed at 16k tokens on torch 2.11 (issue 9's measurement); docs/losses.md says what is measured. The
forward-KL + CE chunk (the default) has a closed-form gradient and is compiled on CUDA (one fused kernel pass over the logits); the other
divergences reuse their reference implementations in ``divergences.py`` and take the gradient with autograd per chunk,
so every divergence gives the same gradients as the unfused path (tests/test_fused_loss.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.losses.chunked import Projection, _ce_sum, chunked_cross_entropy, chunked_kd_and_ce
from llm_recipe.components.losses.divergences import IGNORE_INDEX
from llm_recipe.components.losses.kd_loss import KDLoss

__all__ = ["fusable_head_weight", "fused_linear_kd_and_ce", "fused_linear_loss", "kd_and_ce"]

# rows i..j of the flattened batch -> the teacher's target for them (logits, or a cached top-k tuple)
TeacherRows = Callable[[int, int], Any]


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


def _fkl_ce_chunk(s: Tensor, t: Tensor | None, y: Tensor, ce_w: float, kd_w: float, temperature: float,
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
def _compiled_fkl_ce_chunk():
    # One compiled graph per chunk shape and loss weights: a fused pass over the logits instead of ~15 eager
    # kernels, each reading or writing a [chunk, vocab] fp32 tensor.
    return torch.compile(_fkl_ce_chunk, dynamic=False, fullgraph=True)


def _autograd_chunk(s: Tensor, t: Tensor | None, y: Tensor, ce_w: float, kd_w: float, kd_loss: KDLoss | None,
                    ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """Any divergence: its reference implementation on the chunk, gradient w.r.t. the logits by autograd."""
    with torch.enable_grad():
        s = s.detach().requires_grad_(True)
        ce = _ce_sum(s, y, ignore_index)
        kd = kd_loss(s, t, y) if kd_loss is not None and t is not None else ce.new_zeros(())
        (grad,) = torch.autograd.grad(ce_w * ce + kd_w * kd, s)
    return ce.detach(), kd.detach(), grad


# ---------------------------------------------------------------------------------------------- autograd op


class _FusedLinearKDCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, teacher_rows: TeacherRows | None, labels: Tensor, chunk_fn,
                rows: int, vocab: int | None, ce_w: float, kd_w: float) -> tuple[Tensor, Tensor, Tensor]:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight if vocab is None else weight[:vocab]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        acc = torch.promote_types(hidden.dtype, torch.float32)
        ce = hidden.new_zeros((), dtype=acc)
        kd = hidden.new_zeros((), dtype=acc)
        for i in range(0, hidden.shape[0], rows):
            h = hidden[i:i + rows]
            s = h @ w.t()
            t = None if teacher_rows is None else teacher_rows(i, i + rows)
            ce_c, kd_c, g = chunk_fn(s, t, labels[i:i + rows])
            del s, t
            ce += ce_c
            kd += kd_c
            if need_h:
                torch.mm(g, w, out=grad_h[i:i + rows])
            if need_w:
                grad_w[: w.shape[0]].addmm_(g.t(), h)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(ce, kd)
        return ce_w * ce + kd_w * kd, ce, kd

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_kd):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * g_total.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = grad_w * g_total.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def fused_linear_loss(hidden: Tensor, weight: Tensor, labels: Tensor, teacher_rows: TeacherRows | None, chunk_fn,
                      num_chunks: int, vocab_size: int | None, ce_w: float,
                      kd_w: float) -> tuple[Tensor, Tensor, Tensor]:
    """The fused loop for any chunk kernel: ``hidden [n, d]`` (flattened tokens) in ``num_chunks`` row chunks;
    ``teacher_rows(i, j)`` gives the teacher's target for rows i..j (its logits, or cached top-k: see
    ``components/losses/topk.py``), ``chunk_fn(s, t, y) -> (ce_sum, kd_sum, d loss / d s)``. Returns the weighted
    loss (with grad) and the two detached sums."""
    rows = -(-hidden.shape[0] // max(1, int(num_chunks)))
    return _FusedLinearKDCE.apply(hidden, weight, teacher_rows, labels, chunk_fn, rows, vocab_size, ce_w, kd_w)


def fused_linear_kd_and_ce(
    student_hidden: Tensor,
    student_weight: Tensor,
    labels: Tensor,
    teacher_hidden: Tensor | None = None,
    teacher_project: Projection | None = None,
    kd_loss: KDLoss | None = None,
    kd_ratio: float = 0.0,
    num_chunks: int = 8,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    compile: bool | None = None,
) -> dict[str, Tensor]:
    """``{"loss": (1-kd_ratio)*CE + kd_ratio*KD, "ce", "kd", "n"}`` as sums over valid tokens; only "loss" has grad.

    ``student_hidden [b, s, d]`` are the student's final normed hidden states, ``student_weight [V, d]`` its plain
    output weight (``fusable_head_weight``); the teacher's hidden states and head (any callable: it gets no
    gradient) are optional (CE only without them). Tokens are
    processed in ``num_chunks`` row chunks of the flattened batch. ``compile`` (default: on CUDA) compiles the
    forward-KL + CE chunk.
    """
    if not 0.0 <= kd_ratio <= 1.0:
        raise RecipeError(f"kd_ratio must be in [0, 1], got {kd_ratio!r}")
    if student_hidden.dim() != 3 or labels.shape != student_hidden.shape[:2]:
        raise ValueError(f"expected hidden [b, s, d] and labels [b, s]; got {tuple(student_hidden.shape)} and "
                         f"{tuple(labels.shape)}")
    if vocab_size is not None and vocab_size > student_weight.shape[0]:
        raise RecipeError(f"loss vocab_size={vocab_size} exceeds the output head's {student_weight.shape[0]} rows")
    teacher = teacher_hidden is not None and kd_loss is not None
    hidden = student_hidden.flatten(0, 1)
    t_hidden = teacher_hidden.detach().flatten(0, 1) if teacher else None
    flat = labels.flatten()
    ce_w, kd_w = 1.0 - kd_ratio, (kd_ratio if teacher else 0.0)
    if compile is None:
        compile = hidden.is_cuda
    if kd_loss is None or (kd_loss.kind == "forward_kl"):
        temperature = kd_loss.temperature if kd_loss is not None else 1.0
        kernel = _compiled_fkl_ce_chunk() if compile else _fkl_ce_chunk
        chunk_fn = functools.partial(kernel, ce_w=ce_w, kd_w=kd_w, temperature=temperature,
                                     ignore_index=ignore_index)
    else:
        chunk_fn = functools.partial(_autograd_chunk, ce_w=ce_w, kd_w=kd_w, kd_loss=kd_loss,
                                     ignore_index=ignore_index)
    teacher_rows = (lambda i, j: _logits(teacher_project, t_hidden[i:j], vocab_size)) if teacher else None
    total, ce, kd = fused_linear_loss(hidden, student_weight, flat, teacher_rows, chunk_fn, num_chunks, vocab_size,
                                      ce_w, kd_w)
    return {"loss": total, "ce": ce, "kd": kd, "n": (labels != ignore_index).sum()}


def _logits(project: Projection, hidden: Tensor, vocab: int | None) -> Tensor:
    logits = project(hidden)
    return logits if vocab is None else logits[:, :vocab]


def kd_and_ce(student_hidden: Tensor, student_head: nn.Module, labels: Tensor, teacher_hidden: Tensor | None = None,
              teacher_head: Projection | None = None, kd_loss: KDLoss | None = None, kd_ratio: float = 0.0,
              num_chunks: int = 8, vocab_size: int | None = None) -> dict[str, Tensor]:
    """The training objective from final hidden states: fused when the student's head is a plain weight, else
    the checkpointed chunked path (LoRA/QAT/NF4 heads). Same keys as ``fused_linear_kd_and_ce``."""
    weight = fusable_head_weight(student_head)
    if weight is not None:
        return fused_linear_kd_and_ce(student_hidden, weight, labels, teacher_hidden, teacher_head, kd_loss,
                                      kd_ratio, num_chunks, vocab_size)
    if teacher_hidden is None or kd_loss is None:
        ce, n = chunked_cross_entropy(student_hidden, student_head, labels, num_chunks, vocab_size)
        return {"loss": (1.0 - kd_ratio) * ce, "ce": ce.detach(), "kd": torch.zeros_like(ce), "n": n}
    # An inference-mode teacher tensor cannot be saved for the checkpointed backward: a normal copy can.
    parts = chunked_kd_and_ce(student_hidden, student_head, teacher_hidden.clone(), teacher_head, labels, kd_loss,
                              num_chunks, vocab_size)
    loss = (1.0 - kd_ratio) * parts["ce"] + kd_ratio * parts["kd"]
    return {"loss": loss, "ce": parts["ce"].detach(), "kd": parts["kd"].detach(), "n": parts["n"]}
