"""Which positions of a micro-batch carry a label, known on the host, so that the fused loss projects only those.

Under `train_on_input: false` a prompt's tokens have no label, yet both output heads (the student's and a live
teacher's, 128k-wide for Llama 3) would still be computed for them. The host knows the labels before the batch
moves, so it can hand the loss the labelled positions without the loss reading a count back from the GPU, which
would stall the queue of kernels every micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .divergences import IGNORE_INDEX

__all__ = ["LossRows", "covering_positions", "loss_rows"]


@dataclass(frozen=True)
class LossRows:
    """The flattened positions of a micro-batch with the labelled ones first, in order (`order`, on the loss's
    device), and how many carry a label (`labelled`)."""

    order: Tensor
    labelled: int


def loss_rows(labels: Tensor, device: torch.device | str) -> LossRows | None:
    """`LossRows` of host `labels [b, s]`, its order copied to `device`; None when every position has a label."""
    valid = labels.flatten() != IGNORE_INDEX
    labelled = int(valid.sum())
    if labelled == valid.numel():
        return None
    order = torch.cat([valid.nonzero().squeeze(1), (~valid).nonzero().squeeze(1)])
    return LossRows(order.to(device, non_blocking=True), labelled)


def covering_positions(rows: LossRows, positions: int, num_chunks: int, min_chunks: int) -> Tensor | None:
    """The positions, labelled first, that whole chunks of the usual size (``positions / num_chunks``, rounded up:
    compiled kernels keep their shape) need to cover every labelled one, at least ``min_chunks`` of them; None when
    that is every position. Both loss drivers chunk these instead of all positions."""
    if rows.order.shape[0] != positions:
        raise ValueError(f"rows_with_labels is for {rows.order.shape[0]} positions, the hidden states have "
                         f"{positions}: loss_rows of this batch's labels")
    size = -(-positions // num_chunks)
    covered = max(-(-rows.labelled // size), min_chunks) * size
    return None if covered >= positions else rows.order[:covered]
