"""Perplexity of a model on held-out text: a quick before/after number for quantization and distillation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from ..data.collate import collate
from ..losses import chunked_cross_entropy
from ..training import hidden_states


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer, texts: Sequence[str], max_seq_len: int = 256, batch_size: int = 8,
               device: torch.device | str | None = None) -> float:
    """exp(mean next-token cross-entropy) over `texts`, each truncated to `max_seq_len` tokens."""
    device = device or next(p for p in model.parameters()).device
    items = []
    for text in texts:
        ids = tokenizer.encode(text, add_bos=True)[:max_seq_len]
        if len(ids) >= 2:
            items.append({"tokens": ids, "labels": ids})
    total, count = 0.0, 0
    model.eval()
    for i in range(0, len(items), batch_size):
        batch = {k: v.to(device) for k, v in collate(items[i : i + batch_size], tokenizer.pad_id).items()}
        loss_sum, n = chunked_cross_entropy(hidden_states(model, batch), model.output, batch["labels"], num_chunks=4)
        total += float(loss_sum)
        count += int(n)
    return math.exp(total / max(count, 1))


def held_out_texts(limit: int | None = 200) -> list[str]:
    """LAMBADA test passages (from the offline eval data; never used for training by our configs)."""
    from .offline import lambada_openai

    texts = lambada_openai()["test"]["text"]
    return list(texts[:limit] if limit else texts)
