"""Token generation with torchtune's KV cache: greedy or sampled (temperature, top-k, top-p), stop tokens,
and a per-token callback for streaming."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torchtune.modules.common_utils import delete_kv_caches
from torchtune.modules.transformer import TransformerDecoder

import components.models._compat  # noqa: F401


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> int:
    """Pick the next token from the last position's logits `[v]` (greedy when temperature is 0)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > top_p  # keep the smallest set whose mass reaches top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: TransformerDecoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (),
    seed: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Generate up to `max_new_tokens` after `prompt`; stops after emitting a stop id. Returns new tokens."""
    device = model.tok_embeddings.weight.device
    total = len(prompt) + max_new_tokens
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    dtype = model.tok_embeddings.weight.dtype
    model.setup_caches(batch_size=1, dtype=dtype, decoder_max_seq_len=total)
    causal = torch.tril(torch.ones(total, total, dtype=torch.bool, device=device))
    out: list[int] = []
    try:
        pos = torch.arange(len(prompt), device=device)
        tokens = torch.tensor([list(prompt)], device=device)
        while True:
            logits = model(tokens, input_pos=pos[None], mask=causal[None, pos])
            nxt = sample_next(logits[0, -1], temperature, top_k, top_p, generator)
            out.append(nxt)
            if on_token is not None:
                on_token(nxt)
            if nxt in stop_ids or len(out) >= max_new_tokens:
                return out
            pos = pos[-1:] + 1
            tokens = torch.tensor([[nxt]], device=device)
    finally:
        delete_kv_caches(model)
