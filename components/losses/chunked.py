"""Cross-entropy and KD+CE over sequence chunks, so full ``[b, s, v]`` logits never exist at once.

The model returns normed hidden states (``model.skip_output = True``) and its output projection is passed as a
plain callable. Each chunk projects, computes its loss sums and is wrapped in non-reentrant activation
checkpointing: only the chunk's hidden states are kept for backward, and the chunk's logits are recomputed there,
so at most one chunk of logits per model is alive at any time (forward or backward). The price is one extra
projection per chunk in backward (student and teacher), small next to the transformer itself.

We write this ourselves rather than use torchtune's ``CEWithChunkedOutputLoss`` because that one needs the model to
return a list of chunked logits (all alive at once until backward) and has no KD counterpart with a no-grad teacher.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.losses.divergences import IGNORE_INDEX

__all__ = ["chunked_cross_entropy", "chunked_kd_and_ce", "kd_ratio_loss"]

Projection = Callable[[Tensor], Tensor]
KDFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def _chunks(x: Tensor, num_chunks: int) -> list[Tensor]:
    """Split along the sequence dim into at most ``num_chunks`` balanced, non-empty pieces (views, no copy)."""
    return [c for c in torch.tensor_split(x, num_chunks, dim=1) if c.shape[1] > 0]


def _check_args(hidden: Tensor, labels: Tensor, num_chunks: int, vocab_size: int | None) -> None:
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise RecipeError(f"loss num_chunks must be a positive integer, got {num_chunks!r}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
        raise RecipeError(f"loss vocab_size must be a positive integer or null, got {vocab_size!r}")
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden [b, s, d] and labels [b, s]; got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )


def _logits(project: Projection, hidden: Tensor, vocab_size: int | None) -> Tensor:
    """Project a [b, c, d] chunk to [b*c, v] logits, trimmed to ``vocab_size`` (padding rows of the head dropped)."""
    logits = project(hidden)
    if vocab_size is not None:
        if logits.shape[-1] < vocab_size:
            raise RecipeError(
                f"loss vocab_size={vocab_size} exceeds the output head's {logits.shape[-1]} rows"
            )
        logits = logits[..., :vocab_size]
    return logits.flatten(0, 1)


def _ce_sum(logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    """Summed cross-entropy over valid tokens, computed in at least fp32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(dtype), labels, ignore_index=ignore_index, reduction="sum")


def _ce_chunk(
    hidden: Tensor, labels: Tensor, project: Projection, vocab_size: int | None, ignore_index: int
) -> Tensor:
    return _ce_sum(_logits(project, hidden, vocab_size), labels.flatten(), ignore_index)


def _kd_ce_chunk(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    labels: Tensor,
    student_project: Projection,
    teacher_project: Projection,
    kd_loss: KDFn,
    vocab_size: int | None,
    ignore_index: int,
) -> tuple[Tensor, Tensor]:
    student_logits = _logits(student_project, student_hidden, vocab_size)
    with torch.no_grad():
        teacher_logits = _logits(teacher_project, teacher_hidden, vocab_size)
    flat = labels.flatten()
    return _ce_sum(student_logits, flat, ignore_index), kd_loss(student_logits, teacher_logits, flat)


def _run(fn: Callable[..., object], *args: object) -> object:
    """Run a chunk under non-reentrant activation checkpointing when autograd is recording, else directly."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def chunked_cross_entropy(
    hidden: Tensor,
    project: Projection,
    labels: Tensor,
    num_chunks: int = 8,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Tensor, Tensor]:
    """Summed token cross-entropy of ``project(hidden)`` vs already-shifted ``labels``, and the valid-token count.

    Returns ``(loss_sum, n_valid)`` (0-dim tensors, no host sync); divide by n_valid, or by a global count.
    """
    _check_args(hidden, labels, num_chunks, vocab_size)
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for h, y in zip(_chunks(hidden, num_chunks), _chunks(labels, num_chunks)):
        total = total + _run(_ce_chunk, h, y, project, vocab_size, ignore_index)
    return total, (labels != ignore_index).sum()


def chunked_kd_and_ce(
    student_hidden: Tensor,
    student_project: Projection,
    teacher_hidden: Tensor,
    teacher_project: Projection,
    labels: Tensor,
    kd_loss: KDFn,
    num_chunks: int = 8,
    vocab_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Tensor]:
    """Student CE and student-vs-teacher KD sums over chunks: ``{"ce": sum, "kd": sum, "n": n_valid}``.

    The teacher gets no gradient (its hidden states are detached, its logits built under no_grad). ``vocab_size``
    slices both heads' logits (see ``shared_vocab``). ``kd_loss(student_logits, teacher_logits, labels)`` must
    return a sum over valid tokens, like every divergence in ``llm_recipe.components.losses.divergences``.
    """
    _check_args(student_hidden, labels, num_chunks, vocab_size)
    if teacher_hidden.shape[:2] != student_hidden.shape[:2]:
        raise ValueError(
            f"teacher hidden {tuple(teacher_hidden.shape)} and student hidden {tuple(student_hidden.shape)} "
            "must share batch and sequence dims"
        )
    teacher_hidden = teacher_hidden.detach()
    dtype = torch.promote_types(student_hidden.dtype, torch.float32)
    ce = student_hidden.new_zeros((), dtype=dtype)
    kd = student_hidden.new_zeros((), dtype=dtype)
    pieces = zip(
        _chunks(student_hidden, num_chunks), _chunks(teacher_hidden, num_chunks), _chunks(labels, num_chunks)
    )
    for sh, th, y in pieces:
        ce_c, kd_c = _run(
            _kd_ce_chunk, sh, th, y, student_project, teacher_project, kd_loss, vocab_size, ignore_index
        )
        ce = ce + ce_c
        kd = kd + kd_c
    return {"ce": ce, "kd": kd, "n": (labels != ignore_index).sum()}


def kd_ratio_loss(parts: dict[str, Tensor], kd_ratio: float, n: Tensor | int | None = None) -> Tensor:
    """``(1 - kd_ratio) * ce / n + kd_ratio * kd / n``; ``n`` defaults to ``parts["n"]`` (clamped to >= 1).

    Pass a global token count as ``n`` when accumulating gradients or averaging across ranks.
    """
    if not (0.0 <= kd_ratio <= 1.0):
        raise RecipeError(f"kd_ratio must be in [0, 1], got {kd_ratio!r}")
    count = parts["n"] if n is None else n
    count = torch.as_tensor(count, device=parts["ce"].device).clamp(min=1).to(parts["ce"].dtype)
    return ((1.0 - kd_ratio) * parts["ce"] + kd_ratio * parts["kd"]) / count
