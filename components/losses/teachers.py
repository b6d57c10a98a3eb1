"""What the teacher gives the loss, chunk by chunk: a live teacher's logits, its cached top-k, or a cached sample.

Both loss drivers (fused.py, checkpointed.py) are written once against ``Teacher``: they chunk the teacher's
``tensors()`` like the labels, ask ``targets`` for each chunk, and take ``divergence`` (any divergence, with
autograd) or ``forward_kl_kernel`` (forward KL + CE in closed form, the fused driver's fast path) against them.
The kinds differ only in these few lines, so neither driver knows which one it runs with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from ..errors import RecipeError
from .checkpointed import Projection, project
from .fused import Kernel, forward_kl_ce_chunk
from .sampled import forward_kl_sampled_ce_chunk, sampled_forward_kl
from .topk import bucket_divergence, forward_kl_topk_ce_chunk

if TYPE_CHECKING:
    from .kd_loss import KDLoss

__all__ = ["CachedTeacher", "LiveTeacher", "SampledTeacher", "Teacher"]


class Teacher(Protocol):
    """A teacher as the loss drivers see it."""

    def tensors(self) -> tuple[Tensor, ...]:
        """Tensors shaped ``[b, s, ...]`` like the labels, which the drivers split into chunks (no grad)."""

    def targets(self, *chunks: Tensor, vocab_size: int | None) -> Any:
        """The teacher's targets for one chunk of ``tensors()`` (any leading dims), flattened to rows."""

    def divergence(self, student_logits: Tensor, targets: Any, labels: Tensor, kd_loss: KDLoss) -> Tensor:
        """``kd_loss``'s sum over valid rows between ``student_logits [n, v]`` and ``targets``, differentiable."""

    def forward_kl_kernel(self) -> Kernel:
        """Forward KL + CE in closed form against these targets: ``(s, targets, y, ce_w, kd_w, temperature,
        ignore_index) -> (ce_sum, kd_sum, d loss / d s)`` (the fused driver compiles it on CUDA)."""


@dataclass(frozen=True)
class LiveTeacher:
    """A frozen teacher run alongside the student: its final normed hidden states ``[b, s, d]`` and its output head
    (any callable: a plain or quantized linear, an FSDP module). Its logits are built per chunk, without grad."""

    hidden: Tensor
    head: Projection

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.hidden.detach(),)

    def targets(self, hidden: Tensor, *, vocab_size: int | None) -> Tensor:
        with torch.no_grad():
            return project(self.head, hidden, vocab_size)

    def divergence(self, student_logits: Tensor, targets: Tensor, labels: Tensor, kd_loss: KDLoss) -> Tensor:
        return kd_loss(student_logits, targets, labels)

    def forward_kl_kernel(self) -> Kernel:
        return forward_kl_ce_chunk


@dataclass(frozen=True)
class CachedTeacher:
    """The teacher's cached top-k (``recipe run kd_logits``; ``llm_recipe.components.logits_cache`` collates it):
    ``logp [b, s, k + 1]`` (top-k log-probs at the cache's temperature, then the tail's) and ``ids [b, s, k]``.
    The divergence is taken over the k + 1 buckets (topk.py)."""

    logp: Tensor
    ids: Tensor

    def __post_init__(self) -> None:
        if self.logp.shape[:-1] != self.ids.shape[:-1] or self.logp.shape[-1] != self.ids.shape[-1] + 1:
            raise ValueError(f"cached targets {tuple(self.logp.shape)} / {tuple(self.ids.shape)} do not fit: "
                             "expected logp [b, s, k + 1] and ids [b, s, k]")

    def tensors(self) -> tuple[Tensor, ...]:
        return self.logp, self.ids

    def targets(self, logp: Tensor, ids: Tensor, *, vocab_size: int | None) -> tuple[Tensor, Tensor]:
        return logp.flatten(0, -2), ids.flatten(0, -2)

    def divergence(self, student_logits: Tensor, targets: tuple[Tensor, Tensor], labels: Tensor,
                   kd_loss: KDLoss) -> Tensor:
        return bucket_divergence(student_logits, *targets, labels, kd_loss)

    def forward_kl_kernel(self) -> Kernel:
        return forward_kl_topk_ce_chunk


@dataclass(frozen=True)
class SampledTeacher:
    """The teacher's cached sample (``recipe run kd_logits`` with ``cache.mode=sampled``): per row the distinct ids
    among N draws from the teacher's softmax at the cache's temperature, ``ids [b, s, N]``, how often each was drawn,
    ``counts [b, s, N]`` (0: padding), and the teacher's log-probs of them, ``logp [b, s, N]``. The KD term is the
    unbiased forward-KL estimate of sampled.py; no other divergence has one, so the others are refused."""

    logp: Tensor
    ids: Tensor
    counts: Tensor

    def __post_init__(self) -> None:
        if not self.logp.shape == self.ids.shape == self.counts.shape:
            raise ValueError(f"sampled targets {tuple(self.logp.shape)} / {tuple(self.ids.shape)} / "
                             f"{tuple(self.counts.shape)} do not fit: expected logp, ids and counts [b, s, N]")

    def tensors(self) -> tuple[Tensor, ...]:
        return self.logp, self.ids, self.counts

    def targets(self, logp: Tensor, ids: Tensor, counts: Tensor, *,
                vocab_size: int | None) -> tuple[Tensor, Tensor, Tensor]:
        return logp.flatten(0, -2), ids.flatten(0, -2), counts.flatten(0, -2)

    def divergence(self, student_logits: Tensor, targets: tuple[Tensor, Tensor, Tensor], labels: Tensor,
                   kd_loss: KDLoss) -> Tensor:
        check_sampled_loss(kd_loss.kind)
        return sampled_forward_kl(student_logits, *targets, labels, kd_loss.temperature)

    def forward_kl_kernel(self) -> Kernel:
        return forward_kl_sampled_ce_chunk


def check_sampled_loss(kind: str, cache_dir: object = None) -> None:
    """Only forward KL has an unbiased estimate from teacher samples: any other kd.loss is a one-line error."""
    if kind != "forward_kl":
        where = "" if cache_dir is None else f"={cache_dir}"
        raise RecipeError(f"kd.loss={kind} cannot be trained from teacher.logits_dir{where}: a sampled cache "
                          "(cache.mode=sampled, kd_logits' default) estimates forward KL only; use kd.loss=forward_kl, "
                          "or rebuild the cache with `recipe run kd_logits ... cache.mode=topk` (or train from the "
                          "live teacher)")
