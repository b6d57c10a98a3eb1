"""Token generation with torchtune's KV cache: greedy or sampled (temperature, top-k, top-p), stop tokens,
and a per-token callback for streaming."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .tune import import_torchtune

if TYPE_CHECKING:
    from torchtune.modules.transformer import TransformerDecoder


def delete_kv_caches(model: TransformerDecoder) -> None:
    """Drop the KV caches `setup_caches` allocated (torchtune's `delete_kv_caches`)."""
    import_torchtune()
    from torchtune.modules.common_utils import delete_kv_caches as delete

    delete(model)


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
    with device:  # torchtune allocates the cache buffers (and their positions) on the default device
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


def sample_batch(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token of each row from last-position logits `[b, v]` (greedy when temperature is 0). Returns `[b]`."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and 0 < top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, dim=-1)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_batch(
    model: TransformerDecoder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    compile_mode: str | None = None,
    keep_stop: bool = False,
    pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
    all_done: Callable[[torch.Tensor], bool] | None = None,
) -> list[list[int]]:
    """Generate for a batch of prompts at once with one KV cache: prompts are left-padded, each row gets its own
    positions and a mask that hides its padding. Returns each row's new tokens, cut before its first stop id
    (`keep_stop`: just after it, the stop id included).
    `compile_mode` ("default", "reduce-overhead", ...): torch.compile the one-token decode step (static shapes:
    the batch, one token, the full mask width); None runs it eagerly.
    `pick(logits [b, v]) -> [b]` replaces the sampling rule (temperature, top_k, top_p, generator are then unused);
    `all_done(done [b]) -> bool` replaces "every row has stopped" (several processes running one sharded model
    must agree on it, or their forward passes, and so their collectives, would differ in number).

    Ours rather than `torchtune.generation.generate`: that one keeps every step's full logits
    (`[b, steps, vocab]`, tens of GB for a large batch) and finds padding by comparing token ids with `pad_id`.
    """
    import_torchtune()
    from torchtune.generation import get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask

    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate_batch: every prompt needs at least one token")
    device = model.tok_embeddings.weight.device
    b, width = len(prompts), max(len(p) for p in prompts)
    if compile_mode is not None:  # the compiled step's shapes follow the width: round it up to few distinct ones
        width = -(-width // 64) * 64
    total = width + max_new_tokens
    tokens = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((b, total), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        real[i, width - len(p):] = True  # prompt tokens and every generated position
    masks = get_causal_mask_from_padding_mask(real, target_seq_len=total)  # [b, total, total]
    positions = get_position_ids_from_padding_mask(real)  # [b, total]
    stops = torch.as_tensor(list(stop_ids) or [-1], device=device)
    with device:  # torchtune allocates the cache buffers (and their positions) on the default device
        model.setup_caches(batch_size=b, dtype=model.tok_embeddings.weight.dtype, decoder_max_seq_len=total)
    out = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.full((b,), max_new_tokens, dtype=torch.long, device=device)
    decode = _last_logits if compile_mode is None else _compiled_decode(compile_mode)
    try:
        logits = _last_logits(model, tokens, positions[:, :width], masks[:, :width])
        for t in range(max_new_tokens):
            nxt = sample_batch(logits, temperature, top_k, top_p, generator) if pick is None else pick(logits)
            out[:, t] = nxt
            hit = torch.isin(nxt, stops) & ~done
            lengths = torch.where(hit, t + int(keep_stop), lengths)
            done |= hit
            # whether every row has stopped costs a device sync: ask every 16 steps, not every step
            if t + 1 == max_new_tokens or (t % 16 == 15 and (bool(done.all()) if all_done is None else all_done(done))):
                break
            pos = width + t
            logits = decode(model, nxt[:, None], positions[:, pos : pos + 1], masks[:, pos : pos + 1])
    finally:
        delete_kv_caches(model)
    return [row[:n].tolist() for row, n in zip(out.cpu(), lengths.cpu().tolist())]


def _last_logits(model: TransformerDecoder, tokens: torch.Tensor, input_pos: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """The logits of each row's last position (the model's forward with the KV cache)."""
    return model(tokens, input_pos=input_pos, mask=mask)[:, -1]


@functools.cache
def _compiled_decode(mode: str) -> Callable[..., torch.Tensor]:
    """One compiled decode step per mode and process (compiling it again per call would recompile)."""
    return torch.compile(_last_logits, mode=None if mode == "default" else mode, dynamic=False)
