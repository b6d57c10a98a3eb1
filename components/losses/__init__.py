"""Losses: fused linear CE/KD, chunked cross-entropy, chunked KD+CE, and KD divergences (see docs/losses.md)."""

from llm_recipe.components.losses.chunked import chunked_cross_entropy, chunked_kd_and_ce, kd_ratio_loss
from llm_recipe.components.losses.divergences import (
    IGNORE_INDEX,
    KD_LOSSES,
    forward_kl,
    jsd,
    reverse_kl,
    skew_kl,
    skew_reverse_kl,
    symmetric_kl,
)
from llm_recipe.components.losses.fused import fusable_head_weight, fused_linear_kd_and_ce, kd_and_ce
from llm_recipe.components.losses.kd_loss import KDLoss, build_kd_loss
from llm_recipe.components.losses.vocab import same_tokenizer, shared_vocab

__all__ = [
    "IGNORE_INDEX",
    "KD_LOSSES",
    "KDLoss",
    "build_kd_loss",
    "chunked_cross_entropy",
    "chunked_kd_and_ce",
    "forward_kl",
    "fusable_head_weight",
    "fused_linear_kd_and_ce",
    "jsd",
    "kd_and_ce",
    "kd_ratio_loss",
    "reverse_kl",
    "same_tokenizer",
    "shared_vocab",
    "skew_kl",
    "skew_reverse_kl",
    "symmetric_kl",
]
