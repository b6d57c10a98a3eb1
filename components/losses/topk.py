"""KD from a cached teacher top-k: the divergence on the k + 1 buckets "each top-k id" and "everything else".

A cache row holds, per target token, the teacher's k largest log-probabilities at temperature T, their ids, and
the log of the remaining mass (the tail). The student's distribution at T is reduced to the same k + 1 buckets
(its log-probabilities at those ids, and the logsumexp of all other ids as its tail); both are proper
distributions, and every divergence of divergences.py is taken between them (``bucket_divergence``); forward
KL also has a closed-form gradient (``forward_kl_topk_ce_chunk``, compiled on CUDA) for the fused driver. docs/losses.md
says why and how this differs from the full-vocabulary loss. With k = vocab there is no tail and the loss is the
full-vocabulary one (tests/test_topk_loss.py checks values and gradients in fp64). ``CachedTeacher``
(teachers.py) hands these to ``kd_and_ce``; ``teacher_topk`` is what ``recipe run kd_logits`` stores.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .kd_loss import KDLoss

__all__ = ["bucket_divergence", "forward_kl_topk_ce_chunk", "student_buckets", "teacher_buckets", "teacher_topk"]


def teacher_topk(logits: Tensor, k: int, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(top-k log-probs [n, k], ids [n, k], tail log-mass [n])`` of ``softmax(logits / T)``, in fp32 or wider.

    The tail is the logsumexp of the other ids' log-probs (exact, not ``log(1 - sum)``); -inf when k = vocab.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    values, ids = logp.topk(k, dim=-1)
    tail = torch.logsumexp(logp.scatter(1, ids, float("-inf")), dim=-1)
    return values, ids, tail


def teacher_buckets(logp: Tensor, has_tail: bool) -> Tensor:
    """The cached ``[n, k + 1]`` log-probs renormalised over the buckets (fp16 storage leaves them a hair off 1);
    without a tail (k = vocab) the tail column is dropped."""
    logp = logp.to(torch.promote_types(logp.dtype, torch.float32))
    return torch.log_softmax(logp if has_tail else logp[:, :-1], dim=-1)


def student_buckets(logits: Tensor, ids: Tensor, temperature: float) -> Tensor:
    """The student's ``[n, k (+1)]`` bucket log-probs at T: its log-probs at ``ids``, then (when k < vocab) the
    logsumexp over every other id. Differentiable; one ``[n, vocab]`` temporary per step."""
    log_q = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    top = log_q.gather(1, ids)
    if ids.shape[1] >= logits.shape[1]:
        return top
    tail = torch.logsumexp(log_q.scatter(1, ids, float("-inf")), dim=-1, keepdim=True)
    return torch.cat([top, tail], dim=1)


# ---------------------------------------------------------------------------------------------- chunk kernels


def forward_kl_topk_ce_chunk(s: Tensor, t: tuple[Tensor, Tensor], y: Tensor, ce_w: float, kd_w: float,
                             temperature: float, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """CE sum, bucket forward-KL sum (x T^2) and d(ce_w*CE + kd_w*KD)/d(student logits) in closed form.

    With q = softmax(s/T), buckets b (each top-k id, and the tail), p_b the teacher's bucket mass:
    d [T^2 sum_b p_b log(p_b / q_b)] / ds_v = T (q_v - r_v), where r_v = p_v for a top-k id and
    r_v = q_v * p_tail / q_tail for the others (the tail's target mass spread in the student's own proportions).
    """
    logp, ids = t
    dtype = torch.promote_types(s.dtype, torch.float32)
    s32 = s.to(dtype)
    valid = y != ignore_index
    vmask = valid.unsqueeze(1)
    log_ps = s32 - torch.logsumexp(s32, dim=-1, keepdim=True)
    onehot = torch.arange(s.shape[1], device=s.device) == torch.where(valid, y, 0).unsqueeze(1)
    ce = torch.where(vmask & onehot, -log_ps, 0.0).sum()
    grad = ce_w * (log_ps.exp() - onehot.to(dtype))
    st = s32 / temperature
    log_q = st - torch.logsumexp(st, dim=-1, keepdim=True)
    has_tail = ids.shape[1] < s.shape[1]
    lp = teacher_buckets(logp, has_tail).to(dtype)
    p = lp.exp()
    lq_top = log_q.gather(1, ids)
    kl = torch.where(p[:, : ids.shape[1]] > 0, p[:, : ids.shape[1]] * (lp[:, : ids.shape[1]] - lq_top), 0.0).sum(-1)
    target = torch.zeros_like(log_q).scatter(1, ids, p[:, : ids.shape[1]])
    if has_tail:
        rest = log_q.scatter(1, ids, float("-inf"))  # the student's log-probs off the top-k
        lq_tail = torch.logsumexp(rest, dim=-1, keepdim=True)
        p_tail, lp_tail = p[:, -1:], lp[:, -1:]
        kl = kl + torch.where(p_tail > 0, p_tail * (lp_tail - lq_tail), 0.0).squeeze(1)
        target = target + torch.where(p_tail > 0, (rest + lp_tail - lq_tail).exp(), 0.0)
    kd = torch.where(valid, kl, 0.0).sum() * temperature**2
    grad = grad + (kd_w * temperature) * (log_q.exp() - target)
    grad = torch.where(vmask, grad, 0.0)
    return ce, kd, grad.to(s.dtype)


def bucket_divergence(s: Tensor, logp: Tensor, ids: Tensor, y: Tensor, kd_loss: KDLoss) -> Tensor:
    """Any divergence on the buckets of student logits ``s [n, v]`` and cached ``logp [n, k + 1]``, ``ids [n, k]``:
    the divergences divide their inputs by T and log-softmax them, so bucket log-probs are passed multiplied by
    T (log_softmax of a normalised log-distribution is itself)."""
    temperature = kd_loss.temperature
    s_b = student_buckets(s, ids, temperature)
    t_b = teacher_buckets(logp, s_b.shape[1] > ids.shape[1]).to(s_b.dtype)
    return kd_loss(s_b * temperature, t_b * temperature, y)
