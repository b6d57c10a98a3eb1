"""Losses (docs/losses.md): ``kd_and_ce``, the one training objective (CE alone, KD from a live teacher, from a
cached top-k or from a cached teacher sample); ``chunked_cross_entropy`` for evaluation; the KD divergences as
plain functions, bound to a config by ``build_kd_loss``; and the student/teacher vocabulary checks."""

from .divergences import (
    IGNORE_INDEX,
    KD_LOSSES,
    forward_kl,
    jsd,
    reverse_kl,
    skew_kl,
    skew_reverse_kl,
    symmetric_kl,
)
from .kd_loss import KDLoss, build_kd_loss
from .objective import chunked_cross_entropy, kd_and_ce
from .teachers import CachedTeacher, LiveTeacher, SampledTeacher, check_sampled_loss
from .vocab import same_tokenizer, shared_vocab

__all__ = [
    "IGNORE_INDEX",
    "KD_LOSSES",
    "CachedTeacher",
    "KDLoss",
    "LiveTeacher",
    "SampledTeacher",
    "build_kd_loss",
    "check_sampled_loss",
    "chunked_cross_entropy",
    "forward_kl",
    "jsd",
    "kd_and_ce",
    "reverse_kl",
    "same_tokenizer",
    "shared_vocab",
    "skew_kl",
    "skew_reverse_kl",
    "symmetric_kl",
]
