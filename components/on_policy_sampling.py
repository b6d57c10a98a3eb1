"""The student's sampling for on-policy KD (components/on_policy.py): completions of a batch of prompts with its KV
cache, each token drawn by inverse CDF from a uniform that depends only on the prompt's slot, so a resumed run, N
processes and several micro-batches sampled at once all draw what one process sampling each micro-batch alone
draws (up to the logits' rounding in another batch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .models.generation import StaticDecode, generate_batch


def sample_with_uniforms(logits: Tensor, temperature: float, uniforms: Tensor) -> Tensor:
    """Next token of each row of `logits [b, v]` at `temperature`, by inverse CDF from one uniform per row: the
    same uniform gives the same token whatever else is in the batch. The CDF is summed in fp64 (an fp32 running
    sum over a 128k vocabulary drifts by more than its smallest probabilities)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    cdf = probs.double().cumsum(-1)
    u = uniforms.double() * cdf[:, -1]
    picked = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp_max(logits.shape[-1] - 1)


@torch.no_grad()
def sample_completions(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                       pad_id: int, stop_ids: Sequence[int], seed: int | Sequence[int], rows: Sequence[int],
                       width: int, vocab_size: int | None = None, all_done: Callable[[Tensor], bool] | None = None,
                       static: StaticDecode | None = None) -> list[list[int]]:
    """The student's completion of each prompt, stop token included, sampled with its KV cache from its training
    weights (eval mode, no grad; no copy of the model). Per token, a generator seeded with `seed` draws `width`
    uniforms and prompt i takes uniform `rows[i]` (its slot in the global batch). Several seeds (the prompts of
    several micro-batches sampled at once): each one's generator draws `width` uniforms, and `rows[i]` indexes
    their concatenation (g * width + slot for a prompt of the g-th), so a prompt takes the uniform it would alone.
    `vocab_size`: sample only ids below it (a head padded past the tokenizer). `all_done`: see generate_batch.
    `static`: the compiled decode step with fixed shapes (generate_batch; its padding rows take uniform 0 and are
    dropped)."""
    device = model.tok_embeddings.weight.device
    gens = [torch.Generator(device=device).manual_seed(s) for s in ([seed] if isinstance(seed, int) else seed)]
    rows = list(rows) + ([0] * (static.rows(len(rows)) - len(rows)) if static is not None else [])
    rows = torch.as_tensor(rows, dtype=torch.long, device=device)

    def pick(logits: Tensor) -> Tensor:
        draws = [torch.rand(width, generator=g, device=device) for g in gens]
        u = (draws[0] if len(draws) == 1 else torch.cat(draws))[rows]
        return sample_with_uniforms(logits[:, :vocab_size], temperature, u)

    training = model.training
    model.eval()  # no dropout (LoRA) while sampling
    try:
        return generate_batch(model, prompts, max_new_tokens, pad_id, stop_ids=stop_ids, keep_stop=True, pick=pick,
                              all_done=all_done, static=static)
    finally:
        model.train(training)
