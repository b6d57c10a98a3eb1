"""Knowledge-distillation divergences over logits chunks, summed over valid (non-ignored) tokens: plain functions.

Every divergence takes ``student_logits [n, v]``, ``teacher_logits [n, v]``, ``labels [n]``, ``temperature`` and its
own options, and returns the SUM over rows whose label is not ``ignore_index`` of a per-token divergence between the
temperature-softened teacher and student distributions, multiplied by ``T**2`` (Hinton et al. 2015), so callers can
divide by a global token count. Math runs in (at least) fp32 and tolerates ``-inf`` logits (masked vocabulary
entries) without producing NaN. The functions do not check their options' ranges: ``build_kd_loss`` (kd_loss.py)
does, once, where a config binds them.

We write these few lines ourselves (instead of torchtune's KD losses) because torchtune's ``ForwardKLLoss`` is a
cross-entropy (teacher entropy not subtracted), returns a mean rather than a sum, and has no JSD/skew variants.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# Same value as llm_recipe.components.data.IGNORE_INDEX (the contract's home for it); repeated here so that the losses do not
# depend on the data package.
IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "KD_LOSSES", "forward_kl", "jsd", "reverse_kl", "skew_kl", "skew_reverse_kl", "symmetric_kl"]


# ----------------------------------------------------------------------------------------------------------------
# Numerically safe building blocks (all operate on log-probabilities along the last dim)
# ----------------------------------------------------------------------------------------------------------------


def _compute_dtype(t: Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 stays fp64 (tests use fp64 for exact comparisons)."""
    return torch.promote_types(t.dtype, torch.float32)


def _kl_rows(logp: Tensor, logq: Tensor) -> Tensor:
    """Per-row KL(p || q) = sum_v p (log p - log q) from log-probabilities, 0*log0 := 0 without NaN (value or grad).

    Entries with p == 0 are replaced by 0 *before* the product (a ``torch.where`` after the product would still
    send 0 * inf = NaN into the backward pass).
    """
    p = logp.exp()
    support = p > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp_s = torch.where(support, logp, zero)
    logq_s = torch.where(support, logq, zero)
    return (p * (logp_s - logq_s)).sum(-1)


def _log_mixture(logp: Tensor, logq: Tensor, weight_p: float) -> Tensor:
    """log(w * p + (1 - w) * q) via logsumexp, with w in [0, 1]; entries where p = q = 0 stay -inf-free in backward.

    Where both inputs are -inf, logsumexp's backward would compute exp(-inf - -inf) = NaN; those entries are replaced
    by 0 before the logsumexp and set back to -inf afterwards (they carry no probability mass, so no gradient).
    """
    if weight_p == 0.0:
        return logq
    if weight_p == 1.0:
        return logp
    both_empty = torch.isneginf(logp) & torch.isneginf(logq)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    a = torch.where(both_empty, zero, logp + math.log(weight_p))
    b = torch.where(both_empty, zero, logq + math.log1p(-weight_p))
    mix = torch.logsumexp(torch.stack([a, b]), dim=0)
    return torch.where(both_empty, torch.full_like(mix, -math.inf), mix)


def _prepare(
    student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Validate shapes; return (student, teacher) log-probs at temperature T of every row, and which rows count (a
    valid label): the divergences sum only those (`_valid_sum`). Every row is computed, the ignored ones from zero
    logits: selecting the valid rows (`logits[valid]`) asked the GPU how many there are, a sync per call that left
    the GPU idle while the host queued the next kernels (on-policy KD's loss runs this on every chunk)."""
    if student_logits.dim() != 2 or teacher_logits.shape != student_logits.shape:
        raise ValueError(
            f"KD losses expect student and teacher logits of the same shape [n, v]; got "
            f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)} (slice both to the shared vocab first)"
        )
    if labels.shape != student_logits.shape[:1]:
        raise ValueError(f"labels must have shape [{student_logits.shape[0]}], got {tuple(labels.shape)}")
    valid = labels != ignore_index
    dtype = _compute_dtype(student_logits)
    keep = valid.unsqueeze(-1)  # an ignored row's logits may be anything (a NaN would reach the gradient)
    s = torch.where(keep, student_logits.to(dtype), 0.0) / temperature
    t = torch.where(keep, teacher_logits.to(dtype), 0.0) / temperature
    return F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1), valid


def _valid_sum(per_token: Tensor, valid: Tensor) -> Tensor:
    """The sum of `per_token [n]` over the valid rows."""
    return torch.where(valid, per_token, 0.0).sum()


# ----------------------------------------------------------------------------------------------------------------
# Functional forms
# ----------------------------------------------------------------------------------------------------------------


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0,
               ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Sum over valid tokens of the true forward KL(p_T || p_S) * T^2 (0 when student equals teacher)."""
    log_s, log_t, valid = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _valid_sum(_kl_rows(log_t, log_s), valid) * temperature**2


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0,
               ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Sum over valid tokens of the reverse KL(p_S || p_T) * T^2 (mode-seeking)."""
    log_s, log_t, valid = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _valid_sum(_kl_rows(log_s, log_t), valid) * temperature**2


def symmetric_kl(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0,
                 ratio: float = 0.5, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Sum over valid tokens of (ratio * KL(p_T||p_S) + (1 - ratio) * KL(p_S||p_T)) * T^2."""
    log_s, log_t, valid = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    per_token = ratio * _kl_rows(log_t, log_s) + (1.0 - ratio) * _kl_rows(log_s, log_t)
    return _valid_sum(per_token, valid) * temperature**2


def jsd(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0, beta: float = 0.5,
        ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Sum over valid tokens of the generalized JSD * T^2, with M = beta*p_T + (1-beta)*p_S.

    JSD_beta = beta * KL(p_T || M) + (1 - beta) * KL(p_S || M), the same formula as TRL's GKD for 0 < beta < 1.
    beta = 0 or 1 makes it identically 0 (build_kd_loss refuses them: use forward_kl / reverse_kl, which TRL
    substitutes there).
    """
    log_s, log_t, valid = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    log_m = _log_mixture(log_t, log_s, beta)
    per_token = beta * _kl_rows(log_t, log_m) + (1.0 - beta) * _kl_rows(log_s, log_m)
    return _valid_sum(per_token, valid) * temperature**2


def skew_kl(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0,
            alpha: float = 0.1, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Sum over valid tokens of DistiLLM's skew forward KL(p_T || alpha*p_T + (1-alpha)*p_S) * T^2.

    alpha = 0 is the plain forward KL; at alpha = 1 the divergence is identically 0.
    """
    log_s, log_t, valid = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _valid_sum(_kl_rows(log_t, _log_mixture(log_t, log_s, alpha)), valid) * temperature**2


def skew_reverse_kl(student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0,
                    alpha: float = 0.1, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Sum over valid tokens of DistiLLM's skew reverse KL(p_S || alpha*p_S + (1-alpha)*p_T) * T^2."""
    log_s, log_t, valid = _prepare(student_logits, teacher_logits, labels, temperature, ignore_index)
    return _valid_sum(_kl_rows(log_s, _log_mixture(log_s, log_t, alpha)), valid) * temperature**2


# The kinds a config names (`kd.loss`), in the order the docs list them.
KD_LOSSES: dict[str, Callable[..., Tensor]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "symmetric_kl": symmetric_kl,
    "jsd": jsd,
    "skew_kl": skew_kl,
    "skew_reverse_kl": skew_reverse_kl,
}
