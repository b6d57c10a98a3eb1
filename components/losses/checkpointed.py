"""The checkpointed driver: CE and KD sums over sequence chunks, so full ``[b, s, v]`` logits never exist at once.

The model returns normed hidden states (``model.skip_output = True``) and its output projection is passed as a
plain callable. Each chunk projects, computes its loss sums and is wrapped in non-reentrant activation
checkpointing: only the chunk's hidden states are kept for backward, and the chunk's logits are recomputed there,
so at most one chunk of logits per model is alive at any time (forward or backward). The price is one extra
projection per chunk in backward (student and live teacher), small next to the transformer itself.

``kd_and_ce`` uses it for student heads the fused driver cannot see through (LoRA, QAT, NF4, a bias), and
``chunked_cross_entropy`` for evaluation. The teacher is any ``Teacher`` (teachers.py): a live teacher's hidden
states or a cached top-k, chunked like the labels.

We write this ourselves rather than use torchtune's ``CEWithChunkedOutputLoss`` because that one needs the model to
return a list of chunked logits (all alive at once until backward) and has no KD counterpart with a no-grad teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..errors import RecipeError
from .divergences import IGNORE_INDEX
from .rows import covering_positions

if TYPE_CHECKING:
    from .kd_loss import KDLoss
    from .rows import LossRows
    from .teachers import Teacher

__all__ = ["checkpointed_sums", "ce_sum", "project"]

Projection = Callable[[Tensor], Tensor]


def project(head: Projection, hidden: Tensor, vocab_size: int | None) -> Tensor:
    """``head(hidden)`` as ``[rows, v]`` logits (any leading dims flattened), trimmed to ``vocab_size`` (padding rows
    of the head dropped)."""
    logits = head(hidden)
    if vocab_size is not None:
        if logits.shape[-1] < vocab_size:
            raise RecipeError(f"loss vocab_size={vocab_size} exceeds the output head's {logits.shape[-1]} rows")
        logits = logits[..., :vocab_size]
    return logits.flatten(0, -2)


def ce_sum(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Summed cross-entropy over valid tokens, computed in at least fp32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(dtype), labels, ignore_index=ignore_index, reduction="sum")


def _chunks(x: Tensor, num_chunks: int) -> list[Tensor]:
    """Split along the sequence dim into at most ``num_chunks`` balanced, non-empty pieces (views, no copy)."""
    return [c for c in torch.tensor_split(x, num_chunks, dim=1) if c.shape[1] > 0]


def _chunk(hidden: Tensor, labels: Tensor, head: Projection, teacher: Teacher | None, kd_loss: KDLoss | None,
           vocab_size: int | None, *teacher_chunks: Tensor) -> tuple[Tensor, Tensor]:
    student_logits = project(head, hidden, vocab_size)
    labels = labels.flatten()
    ce = ce_sum(student_logits, labels)
    if teacher is None:
        return ce, ce.new_zeros(())
    targets = teacher.targets(*teacher_chunks, vocab_size=vocab_size)
    return ce, teacher.divergence(student_logits, targets, labels, kd_loss)


def _run(fn: Callable[..., tuple[Tensor, Tensor]], *args: object) -> tuple[Tensor, Tensor]:
    """Run a chunk under non-reentrant activation checkpointing when autograd is recording, else directly."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def checkpointed_sums(hidden: Tensor, head: Projection, labels: Tensor, teacher: Teacher | None,
                      kd_loss: KDLoss | None, num_chunks: int, vocab_size: int | None,
                      rows_with_labels: LossRows | None = None) -> tuple[Tensor, Tensor]:
    """``(ce_sum, kd_sum)`` over valid tokens (0-dim, with grad), ``num_chunks`` sequence chunks at a time; the KD
    sum is 0 without a teacher. Arguments are checked by the caller (objective.py). With ``rows_with_labels``
    (rows.py) the chunks keep their size but cover the labelled positions first, and whole chunks of positions
    without a label are not projected, as in the fused driver."""
    tensors = () if teacher is None else teacher.tensors()
    if rows_with_labels is not None:
        hidden, labels, tensors, num_chunks = _labelled_first(hidden, labels, tensors, num_chunks, rows_with_labels)
    # An inference-mode teacher tensor cannot be saved for the checkpointed backward: a normal copy can.
    tensors = tuple(t.clone() if t.is_inference() else t for t in tensors)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    ce = hidden.new_zeros((), dtype=dtype)
    kd = hidden.new_zeros((), dtype=dtype)
    for h, y, *t in zip(_chunks(hidden, num_chunks), _chunks(labels, num_chunks),
                        *(_chunks(x, num_chunks) for x in tensors)):
        ce_c, kd_c = _run(_chunk, h, y, head, teacher, kd_loss, vocab_size, *t)
        ce = ce + ce_c
        kd = kd + kd_c
    return ce, kd


def _labelled_first(hidden: Tensor, labels: Tensor, tensors: tuple[Tensor, ...], num_chunks: int,
                    rows: LossRows) -> tuple[Tensor, Tensor, tuple[Tensor, ...], int]:
    """The positions that whole chunks of the usual size need to cover every labelled one, as one row ``[1, n]``
    (labelled first), and the number of such chunks; the inputs unchanged when they cover everything."""
    positions = hidden.shape[0] * hidden.shape[1]
    keep = covering_positions(rows, positions, num_chunks, 1)  # one chunk at least: the loss keeps its graph
    if keep is None:
        return hidden, labels, tensors, num_chunks

    def pick(x: Tensor) -> Tensor:
        return x.flatten(0, 1).index_select(0, keep).unsqueeze(0)

    return pick(hidden), pick(labels), tuple(pick(t) for t in tensors), keep.shape[0] // -(-positions // num_chunks)
