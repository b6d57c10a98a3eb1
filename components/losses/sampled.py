"""KD from a cached teacher sample: forward KL estimated from N tokens drawn from the teacher's distribution.

A sampled cache row holds, per target token, the distinct ids among N draws (with replacement) from the teacher's
softmax at temperature T, how often each was drawn (c_v, summing to N), and the teacher's log-probability of each
(log p_v). With q = softmax(s/T) the student's distribution and w_v = c_v / N:

- the KD value ``T^2 sum_v w_v (log p_v - log q_v)`` is an unbiased estimate of ``T^2 KL(p || q)`` (E[w_v] = p_v);
- its gradient ``d/ds_v = T (q_v - w_v)`` is an unbiased estimate of the full forward-KL gradient ``T (q_v - p_v)``,
  with variance ``T^2 p_v (1 - p_v) / N`` per logit (``T^2 (1 - sum_v p_v^2) / N`` summed over the vocabulary).

A top-k cache's gradient is biased instead (topk.py: inside the tail the target follows the student's own
proportions). Only forward KL has such an estimator; ``SampledTeacher`` (teachers.py) refuses the other divergences.
``teacher_samples`` is what ``recipe run kd_logits`` stores with ``cache.mode=sampled``; docs/losses.md says more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .divergences import IGNORE_INDEX
from .fused import forward_kl_ce_chunk

__all__ = ["compact_draws", "forward_kl_sampled_ce_chunk", "sampled_forward_kl", "teacher_samples"]


def teacher_samples(logits: Tensor, uniforms: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(log-probs [n, N], ids [n, N], counts [n, N])``: N draws per row from ``softmax(logits / T)``, by inverse
    CDF of the given ``uniforms [n, N]`` in [0, 1), compacted to the distinct ids first (``compact_draws``).

    The caller owns the random numbers (one CPU generator per dataset item), so they do not depend on the device,
    the batch size or how rows are chunked; a draw changes only where the logits round differently (a uniform on a
    CDF boundary). The CDF is summed in fp64, and ids of probability 0 are never drawn."""
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    cdf = logp.exp().to(torch.float64).cumsum(-1)
    draws = torch.searchsorted(cdf, uniforms.to(cdf) * cdf[:, -1:], right=True).clamp_(max=logits.shape[-1] - 1)
    ids, counts = compact_draws(draws)
    return torch.where(counts > 0, logp.gather(1, ids), 0.0), ids, counts


def compact_draws(draws: Tensor) -> tuple[Tensor, Tensor]:
    """Drawn ids ``[n, N]`` -> ``(ids, counts)`` ``[n, N]``: each row's distinct ids in ascending order and how often
    each was drawn, then padding (id 0, count 0)."""
    s, _ = draws.sort(dim=-1)
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    slot = first.long().cumsum(-1) - 1  # which distinct id each draw is
    counts = torch.zeros_like(s).scatter_add_(1, slot, torch.ones_like(s))
    ids = torch.zeros_like(s).scatter_(1, slot, s)
    return ids, counts


def _weights(counts: Tensor, dtype: torch.dtype) -> Tensor:
    """c_v / N per slot (N: the row's draws; rows without a target have none and weigh 0)."""
    c = counts.to(dtype)
    return c / c.sum(-1, keepdim=True).clamp_min(1.0)


def sampled_forward_kl(student_logits: Tensor, logp: Tensor, ids: Tensor, counts: Tensor, labels: Tensor,
                       temperature: float, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The estimate ``T^2 sum_v (c_v / N) (log p_v - log q_v)`` summed over valid rows; differentiable (its
    gradient is ``T (q_v - c_v / N)`` per row)."""
    s = student_logits.to(torch.promote_types(student_logits.dtype, torch.float32))
    log_q = torch.log_softmax(s / temperature, dim=-1)
    w = _weights(counts, s.dtype)
    per_row = (w * (logp.to(s.dtype) - log_q.gather(1, ids))).sum(-1)
    return torch.where(labels != ignore_index, per_row, 0.0).sum() * temperature**2


def forward_kl_sampled_ce_chunk(s: Tensor, t: tuple[Tensor, Tensor, Tensor], y: Tensor, ce_w: float, kd_w: float,
                                temperature: float, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """CE sum, the sampled forward-KL estimate (x T^2) and d(ce_w*CE + kd_w*KD)/d(student logits) in closed form:
    the CE part is fused.py's, the KD gradient ``T (q - c / N)``."""
    logp, ids, counts = t
    dtype = torch.promote_types(s.dtype, torch.float32)
    ce, _, grad = forward_kl_ce_chunk(s.to(dtype), None, y, ce_w, kd_w, temperature, ignore_index)
    st = s.to(dtype) / temperature
    log_q = st - torch.logsumexp(st, dim=-1, keepdim=True)
    w = _weights(counts, dtype)
    valid = y != ignore_index
    kl = (w * (logp.to(dtype) - log_q.gather(1, ids))).sum(-1)
    kd = torch.where(valid, kl, 0.0).sum() * temperature**2
    target = torch.zeros_like(log_q).scatter_add_(1, ids, w)
    kd_grad = torch.where(valid.unsqueeze(1), (kd_w * temperature) * (log_q.exp() - target), 0.0)
    return ce, kd, (grad + kd_grad).to(s.dtype)
