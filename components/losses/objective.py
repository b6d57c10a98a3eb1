"""The training objective from final hidden states: ``kd_and_ce``, one entry for CE alone, KD from a live teacher
and KD from a cached top-k; and ``chunked_cross_entropy``, the CE sum for evaluation.

Full ``[batch, seq, vocab]`` logits never exist: the output projection runs chunk by chunk inside one of two
drivers. A student head that is a plain weight takes the fused driver (fused.py: the student's gradients are
computed in the same pass, no second projection in backward); any other head (LoRA, QAT, NF4, a bias) takes the
checkpointed driver (checkpointed.py). Both give the same numbers for every divergence and teacher kind
(tests/test_fused_loss.py, tests/test_topk_loss.py); only the cost differs.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from ..errors import RecipeError
from .checkpointed import checkpointed_sums
from .divergences import IGNORE_INDEX
from .fused import fusable_head_weight, fused_loss
from .kd_loss import KDLoss, blend
from .rows import LossRows
from .teachers import Teacher

__all__ = ["chunked_cross_entropy", "kd_and_ce"]


def _check(hidden: Tensor, labels: Tensor, num_chunks: int, vocab_size: int | None,
           teacher: Teacher | None = None, kd_loss: KDLoss | None = None, kd_ratio: float = 0.0) -> None:
    """The loss's arguments, checked once per call, whichever driver runs."""
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise RecipeError(f"loss num_chunks must be a positive integer, got {num_chunks!r}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise RecipeError(f"loss vocab_size must be a positive integer or null, got {vocab_size!r}")
    if not 0.0 <= kd_ratio <= 1.0:
        raise RecipeError(f"kd_ratio must be in [0, 1], got {kd_ratio!r}")
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"expected hidden [b, s, d] and labels [b, s]; got {tuple(hidden.shape)} and "
                         f"{tuple(labels.shape)}")
    if teacher is None:
        return
    if kd_loss is None:
        raise ValueError("a teacher needs a kd_loss (build_kd_loss)")
    for t in teacher.tensors():
        if t.shape[:2] != labels.shape:
            raise ValueError(f"teacher tensor {tuple(t.shape)} and labels {tuple(labels.shape)} must share batch "
                             "and sequence dims")


def kd_and_ce(student_hidden: Tensor, student_head: nn.Module | Callable[[Tensor], Tensor], labels: Tensor,
              teacher: Teacher | None = None, kd_loss: KDLoss | None = None, kd_ratio: float = 0.0,
              num_chunks: int = 8, vocab_size: int | None = None, compile: bool | None = None,
              rows_with_labels: LossRows | None = None) -> dict[str, Tensor]:
    """``{"loss": (1 - kd_ratio) * CE + kd_ratio * KD, "ce", "kd", "n"}``, sums over valid tokens (labels already
    shifted, -100 ignored); only "loss" has grad (divide it by n, or by a global count).

    ``student_hidden [b, s, d]`` are the student's final normed hidden states and ``student_head`` its output
    projection. ``teacher`` is a ``LiveTeacher(hidden, head)`` (its head gets no gradient) or a
    ``CachedTeacher(logp, ids)``; without one the KD term is 0 (CE alone). ``kd_loss`` comes from
    ``build_kd_loss``. Tokens are processed in ``num_chunks`` chunks; ``vocab_size`` slices both sides' logits
    (``shared_vocab``, or a cache's vocabulary); ``compile`` (default: on CUDA) compiles the fused driver's
    closed-form forward-KL kernels (on CUDA, live logits and CE alone take the Triton kernel either way).
    ``rows_with_labels`` (``loss_rows`` of the host labels) lets either driver skip whole chunks of unlabelled
    tokens; the result is the same.
    """
    _check(student_hidden, labels, num_chunks, vocab_size, teacher, kd_loss, kd_ratio)
    weight = fusable_head_weight(student_head)
    if weight is not None:
        loss, ce, kd = fused_loss(student_hidden, weight, labels, teacher, kd_loss, kd_ratio, num_chunks, vocab_size,
                                  student_hidden.is_cuda if compile is None else compile, rows_with_labels)
    else:
        ce, kd = checkpointed_sums(student_hidden, student_head, labels, teacher, kd_loss, num_chunks, vocab_size,
                                   rows_with_labels)
        loss, ce, kd = blend(ce, kd, kd_ratio), ce.detach(), kd.detach()
    return {"loss": loss, "ce": ce, "kd": kd, "n": (labels != IGNORE_INDEX).sum()}


def chunked_cross_entropy(hidden: Tensor, project: Callable[[Tensor], Tensor], labels: Tensor, num_chunks: int = 8,
                          vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Summed token cross-entropy of ``project(hidden)`` vs already-shifted ``labels``, and the valid-token count.

    Returns ``(loss_sum, n_valid)`` (0-dim tensors, no host sync). For evaluation and layer scoring: it always
    takes the checkpointed driver (F.cross_entropy per sequence chunk), whatever the head.
    """
    _check(hidden, labels, num_chunks, vocab_size)
    ce, _ = checkpointed_sums(hidden, project, labels, None, None, num_chunks, vocab_size)
    return ce, (labels != IGNORE_INDEX).sum()
