"""KD from a cached teacher top-k: the divergence on the k + 1 buckets "each top-k id" and "everything else".

A cache row holds, per target token, the teacher's k largest log-probabilities at temperature T, their ids, and
the log of the remaining mass (the tail). The student's distribution at T is reduced to the same k + 1 buckets
(its log-probabilities at those ids, and the logsumexp of all other ids as its tail); both are proper
distributions, and every divergence of ``divergences.py`` is taken between them. docs/losses.md says why and how this
differs from the full-vocabulary loss. With k = vocab there is no tail and the loss is the full-vocabulary one
(tests/test_logits_cache.py checks values and gradients in fp64).

Targets travel as two tensors shaped like the labels: ``logp [..., k + 1]`` (top-k log-probs, then the tail's)
and ``ids [..., k]``. The loss plugs into the fused linear path of ``fused.py`` (gradients of the student's hidden
states and head in forward, chunk by chunk): forward KL has a closed-form gradient (compiled on CUDA), the other
divergences go through their reference implementations with autograd per chunk. A student head the fused path
cannot use (LoRA on the head, QAT, NF4) takes checkpointed chunks like ``chunked.py``. Neither keeps more than
one chunk of ``[rows, vocab]`` student logits alive.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.losses.chunked import Projection, _ce_sum, _chunks, _run
from llm_recipe.components.losses.divergences import IGNORE_INDEX
from llm_recipe.components.losses.fused import fusable_head_weight, fused_linear_loss
from llm_recipe.components.losses.kd_loss import KDLoss

__all__ = ["cached_kd_and_ce", "student_buckets", "teacher_buckets", "teacher_topk"]


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


def _fkl_topk_ce_chunk(s: Tensor, t: tuple[Tensor, Tensor], y: Tensor, ce_w: float, kd_w: float, temperature: float,
                       ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
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


@functools.cache
def _compiled_fkl_topk_ce_chunk():
    # As fused.py's forward-KL kernel: one compiled graph instead of ~20 eager passes over [rows, vocab] fp32.
    return torch.compile(_fkl_topk_ce_chunk, dynamic=False, fullgraph=True)


def _bucket_kd(s: Tensor, logp: Tensor, ids: Tensor, y: Tensor, kd_loss: KDLoss) -> Tensor:
    """Any divergence on the buckets: the divergences divide its inputs by T and log-softmaxes them, so bucket
    log-probs are passed multiplied by T (log_softmax of a normalised log-distribution is itself)."""
    temperature = kd_loss.temperature
    s_b = student_buckets(s, ids, temperature)
    t_b = teacher_buckets(logp, s_b.shape[1] > ids.shape[1]).to(s_b.dtype)
    return kd_loss(s_b * temperature, t_b * temperature, y)


def _autograd_topk_chunk(s: Tensor, t: tuple[Tensor, Tensor], y: Tensor, ce_w: float, kd_w: float,
                         kd_loss: KDLoss, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    with torch.enable_grad():
        s = s.detach().requires_grad_(True)
        ce = _ce_sum(s, y, ignore_index)
        kd = _bucket_kd(s, *t, y, kd_loss)
        (grad,) = torch.autograd.grad(ce_w * ce + kd_w * kd, s)
    return ce.detach(), kd.detach(), grad


def _checkpointed_chunk(h: Tensor, logp: Tensor, ids: Tensor, y: Tensor, project: Projection, vocab: int | None,
                        kd_loss: KDLoss, ignore_index: int) -> tuple[Tensor, Tensor]:
    s = project(h)
    s = (s if vocab is None else s[..., :vocab]).flatten(0, 1)
    y = y.flatten()
    return _ce_sum(s, y, ignore_index), _bucket_kd(s, logp.flatten(0, 1), ids.flatten(0, 1), y, kd_loss)


# ---------------------------------------------------------------------------------------------- the loss


def cached_kd_and_ce(student_hidden: Tensor, student_head: nn.Module, labels: Tensor, teacher_logp: Tensor,
                     teacher_ids: Tensor, kd_loss: KDLoss, kd_ratio: float, num_chunks: int = 8,
                     vocab_size: int | None = None, compile: bool | None = None,
                     ignore_index: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """``{"loss", "ce", "kd", "n"}`` like ``kd_and_ce``, against cached teacher targets (``teacher_logp
    [b, s, k + 1]``, ``teacher_ids [b, s, k]``, as ``llm_recipe.components.logits_cache`` collates them) instead of a
    teacher's hidden states. ``vocab_size`` slices the student's logits to the cache's vocabulary."""
    if not 0.0 <= kd_ratio <= 1.0:
        raise RecipeError(f"kd_ratio must be in [0, 1], got {kd_ratio!r}")
    if teacher_ids.shape[:2] != labels.shape or teacher_logp.shape[-1] != teacher_ids.shape[-1] + 1:
        raise ValueError(f"cached targets {tuple(teacher_logp.shape)} / {tuple(teacher_ids.shape)} do not fit "
                         f"labels {tuple(labels.shape)}")
    ce_w, kd_w = 1.0 - kd_ratio, kd_ratio
    weight = fusable_head_weight(student_head)
    if weight is not None:
        hidden = student_hidden.flatten(0, 1)
        logp, ids = teacher_logp.flatten(0, 1), teacher_ids.flatten(0, 1)
        if kd_loss.kind == "forward_kl":
            kernel = _compiled_fkl_topk_ce_chunk() if (hidden.is_cuda if compile is None else compile) \
                else _fkl_topk_ce_chunk
            chunk_fn = functools.partial(kernel, ce_w=ce_w, kd_w=kd_w, temperature=kd_loss.temperature,
                                         ignore_index=ignore_index)
        else:
            chunk_fn = functools.partial(_autograd_topk_chunk, ce_w=ce_w, kd_w=kd_w, kd_loss=kd_loss,
                                         ignore_index=ignore_index)
        total, ce, kd = fused_linear_loss(hidden, weight, labels.flatten(), lambda i, j: (logp[i:j], ids[i:j]),
                                          chunk_fn, num_chunks, vocab_size, ce_w, kd_w)
        return {"loss": total, "ce": ce, "kd": kd, "n": (labels != ignore_index).sum()}
    dtype = torch.promote_types(student_hidden.dtype, torch.float32)
    ce = student_hidden.new_zeros((), dtype=dtype)
    kd = student_hidden.new_zeros((), dtype=dtype)
    for h, lp, ids, y in zip(*(_chunks(x, num_chunks) for x in (student_hidden, teacher_logp, teacher_ids, labels))):
        ce_c, kd_c = _run(_checkpointed_chunk, h, lp, ids, y, student_head, vocab_size, kd_loss, ignore_index)
        ce, kd = ce + ce_c, kd + kd_c
    return {"loss": ce_w * ce + kd_w * kd, "ce": ce.detach(), "kd": kd.detach(), "n": (labels != ignore_index).sum()}
