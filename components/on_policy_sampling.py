"""The student's sampling for on-policy KD (components/on_policy.py): completions of a batch of prompts with its KV
cache, each token drawn by inverse CDF from a uniform that depends only on the prompt's slot, so a resumed run, N
processes and several micro-batches sampled at once all draw what one process sampling each micro-batch alone
draws (up to the logits' rounding in another batch); and the batches the samples train in (`completion_batch`,
`packed_completion_batch`, `training_batches`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .data.collate import PackedDataset, collate_packed
from .data.formats import IGNORE_INDEX
from .models.generation import StaticDecode, generate_batch


def sample_with_uniforms(logits: Tensor, temperature: float, uniforms: Tensor, block: int = 256) -> Tensor:
    """Next token of each row of `logits [b, v]` at `temperature`, by inverse CDF from one uniform per row: the
    same uniform gives the same token whatever else is in the batch. The CDF is in fp64 (an fp32 running sum over
    a 128k vocabulary drifts by more than its smallest probabilities), in two levels: the blocks' sums (of `block`
    ids each), then the CDF inside the one block the uniform falls in. One fp64 cumsum over the whole vocabulary
    took 0.25 ms of every decode step (one H200, 64 rows of 128,256 ids: torch's scan kernel for fp64). The two
    levels round differently, so a uniform within fp64 rounding (~1e-16) of a block's edge may find the block's
    mass used up: it takes the block's last id with probability (one CDF would take the next one's first); never
    an id of probability 0."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    rows, vocab = probs.shape
    if vocab % block:  # zero-probability ids past the end: never picked (a zero-width step of the CDF)
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))
    blocks = probs.view(rows, -1, block)
    edges = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [b, blocks]: the CDF at each block's end
    u = (uniforms.double() * edges[:, -1]).unsqueeze(-1)
    at = torch.searchsorted(edges, u, right=True).clamp_max(edges.shape[1] - 1)  # [b, 1]: the uniform's block
    before = torch.where(at > 0, edges.gather(1, (at - 1).clamp_min(0)), 0.0)
    chosen = blocks.gather(1, at.unsqueeze(-1).expand(rows, 1, block)).squeeze(1)  # [b, block]
    inside = torch.searchsorted(chosen.double().cumsum(-1) + before, u, right=True).squeeze(-1)  # `block`: used up
    ids = torch.arange(block, device=probs.device)
    last = torch.where(chosen > 0, ids, -1).amax(-1)  # the block's last id with probability (-1: none)
    picked = at.squeeze(-1) * block + torch.minimum(inside, last)
    # a block without probability (edges apart by rounding alone): the row's likeliest id
    return torch.where(last >= 0, picked, probs.argmax(-1)).clamp_max(vocab - 1)


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
    rows = torch.as_tensor(list(rows), dtype=torch.long, device=device)
    padded: dict[int, Tensor] = {}  # `rows` for the decode batch's size, made once per call, not per token

    def pick(logits: Tensor) -> Tensor:
        draws = [torch.rand(width, generator=g, device=device) for g in gens]
        at = padded.get(len(logits))
        if at is None:  # StaticDecode's padding rows (after the prompts) take uniform 0
            at = padded[len(logits)] = torch.nn.functional.pad(rows, (0, len(logits) - len(rows)))
        u = (draws[0] if len(draws) == 1 else torch.cat(draws))[at]
        return sample_with_uniforms(logits[:, :vocab_size], temperature, u)

    training = model.training
    model.eval()  # no dropout (LoRA) while sampling
    try:
        return generate_batch(model, prompts, max_new_tokens, pad_id, stop_ids=stop_ids, keep_stop=True, pick=pick,
                              all_done=all_done, static=static)
    finally:
        model.train(training)


def completion_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                     pad_id: int) -> dict[str, Tensor]:
    """prompt + completion per row (right-padded) with labels on the completion only (already shifted:
    labels[t] = tokens[t + 1] where token t + 1 was sampled, -100 elsewhere), and each row's prompt length. One
    prompt per row: what the held-out score sums per prompt, and a training micro-batch's layout where it holds
    fewer tokens than `packed_completion_batch`'s."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    labels = torch.full((len(prompts), width), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        tokens[i, : len(p) + len(c)] = torch.tensor([*p, *c], dtype=torch.long)
        labels[i, len(p) - 1 : len(p) + len(c) - 1] = torch.tensor(list(c), dtype=torch.long)
    return {"tokens": tokens, "labels": labels, "prompt_lens": torch.tensor([len(p) for p in prompts])}


def packed_completion_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                            pad_id: int, max_seq_len: int,
                            per_row: Sequence[int] | None = None) -> dict[str, Tensor]:
    """`completion_batch`'s sequences packed as the loader packs documents, in rows of max_seq_len tokens with
    `input_pos` restarting at every sequence (the attention mask is built from it on the device). `per_row`: the
    first `per_row[0]` prompts (with their completions) in row 0, the next `per_row[1]` in row 1, ...: a training
    row's prompts and completions fit in max_seq_len (`row_prompts`), so the batch has the loader's shape; None
    (a prompt set's prompts): first fit over rows of max_seq_len. With chat prompts, one per row padded to the
    longest held up to 8x the tokens (one H200, Llama-3.2-1B student of an 8B teacher: 27.4 GiB peak against 17.9
    packed, steps 1.28x slower)."""
    if per_row is not None and sum(per_row) != len(prompts):
        raise ValueError(f"packed_completion_batch: rows of {list(per_row)} prompts for {len(prompts)} prompts")
    seqs = [_sequence(p, c) for p, c in zip(prompts, completions, strict=True)]
    rows, start = [], 0
    for n in per_row if per_row is not None else [len(seqs)]:
        rows += PackedDataset(seqs[start : start + n], max_seq_len, pad_id, open_rows=max(1, n)).rows
        start += n
    return {**collate_packed(rows), "prompt_lens": torch.tensor([len(p) for p in prompts])}


def _sequence(prompt: Sequence[int], completion: Sequence[int]) -> dict:
    """prompt + completion as an example PackedDataset packs: labels on the completion only (collate shifts them)
    and the prompt's length."""
    return {"tokens": [*prompt, *completion], "labels": [IGNORE_INDEX] * len(prompt) + list(completion),
            "prompt": len(prompt)}


def training_batches(samples: Sequence[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], Sequence[int] | None]],
                     pad_id: int, max_seq_len: int, capacity: int,
                     agree: Callable[[Tensor], Tensor] | None = None) -> list[tuple[list[int], dict[str, Tensor]]]:
    """The batches a step's on-policy micro-batches train in, from each one's (prompts, completions, prompts per
    training row): (the micro-batches it holds, the batch). Each micro-batch's samples take the layout with fewer
    tokens (one per row, or packed back into their training rows), and consecutive ones of one sample per row are
    joined while their rows times the widest row fit `capacity` positions (a data micro-batch's): the same tokens
    and gradient (the loss divides by the window's targets) in fewer forward and backward passes, each no larger
    than a data one. Why: an on-policy micro-batch of 16 short samples keeps the GPU waiting on the host for about
    half of its pass (one H200, the shipped 8B -> 1B config: 102 ms for 56 ms of kernels; two: 177 ms). `agree`:
    on several processes, the (rows, width, packed) of every micro-batch reduced to the largest over the ranks, so
    all join alike (each pass runs FSDP's collectives)."""
    layouts = []
    for prompts, completions, per_row in samples:
        padded = completion_batch(prompts, completions, pad_id)
        packed = packed_completion_batch(prompts, completions, pad_id, max_seq_len, per_row)
        layouts.append(packed if packed["tokens"].numel() < padded["tokens"].numel() else padded)
    sizes = torch.tensor([[*b["tokens"].shape, "input_pos" in b] for b in layouts])
    if agree is not None:
        sizes = agree(sizes)
    out = []
    for run in joined_runs(sizes.tolist(), capacity):
        if len(run) == 1:
            out.append((run, layouts[run[0]]))
        else:
            out.append((run, completion_batch([p for g in run for p in samples[g][0]],
                                              [c for g in run for c in samples[g][1]], pad_id)))
    return out


def joined_runs(sizes: Sequence[Sequence[int]], capacity: int) -> list[list[int]]:
    """Consecutive micro-batches trained as one (`training_batches`): `sizes[i]` = (rows, width, packed) of the
    i-th's layout. A run grows while neither is packed and its rows times its widest width stay within
    `capacity`."""
    runs: list[list[int]] = []
    rows = wide = 0
    for i, (n, w, packed) in enumerate(sizes):
        if runs and not packed and rows and (rows + n) * max(wide, w) <= capacity:
            runs[-1].append(i)
            rows, wide = rows + n, max(wide, w)
        else:
            runs.append([i])
            rows, wide = (0, 0) if packed else (n, w)  # rows 0: a packed run takes no more
    return runs


def loader_shaped_batches(samples: Sequence[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]], object]],
                          pad_id: int, max_seq_len: int, batch_size: int,
                          agree: Callable[[Tensor], Tensor] | None = None) -> list[dict[str, Tensor]]:
    """A step's on-policy samples (each micro-batch's (prompts, completions, _)) in passes of the loader's rows of
    max_seq_len with `input_pos` restarting at each sequence, batch_size rows or half of them (rounded up): what
    `training_batches` makes instead when every data micro-batch has one shape (packed data, compiled layers). Why:
    from a second shape on, Dynamo compiles the layers for dynamic sizes and then also picks that graph for every
    later data micro-batch (the most recently used entry is tried first): on one H200 the SmolLM2 study's off-policy
    steps ran ~25% slower after the first on-policy step. With two shapes, compiled static (`static_shapes`), the
    data micro-batches keep their graph, and a step whose samples fill one row of two does not compute an empty one.
    Sequences go first fit into rows, in order; the rows are cut into as many passes as the most any rank needs
    (`agree`: the counts reduced to the largest over ranks, since each pass runs FSDP's collectives), rows of several
    split where a rank has fewer rows than passes (a pass without samples only where it has fewer samples), the
    rest of a pass empty rows."""
    seqs = [_sequence(p, c) for prompts, completions, _ in samples for p, c in zip(prompts, completions, strict=True)]
    rows: list[list[dict]] = []  # first fit: each sequence into the first row with room
    used: list[int] = []
    for s in seqs:
        n = len(s["tokens"])
        i = next((i for i, u in enumerate(used) if u + n <= max_seq_len), len(rows))
        if i == len(rows):
            rows.append([])
            used.append(0)
        rows[i].append(s)
        used[i] += n
    passes = -(-len(rows) // batch_size)
    if agree is not None:
        passes = int(agree(torch.tensor([[passes]]))[0, 0])
    while rows and len(rows) < passes and max(map(len, rows)) > 1:  # samples in every pass: split a row of several
        fullest = max(rows, key=len)
        rows.insert(rows.index(fullest) + 1, [fullest.pop()])
    empty = {"tokens": [pad_id] * max_seq_len, "labels": [IGNORE_INDEX] * max_seq_len, "seq_lens": [max_seq_len]}
    half, out, start = -(-batch_size // 2), [], 0
    for i in range(passes):
        chunk = rows[start : start + len(rows) // passes + (i < len(rows) % passes)]
        start += len(chunk)
        packed = [PackedDataset(r, max_seq_len, pad_id, open_rows=1).rows[0] for r in chunk]
        height = half if len(chunk) <= half else batch_size
        out.append({**collate_packed(packed + [empty] * (height - len(chunk))),
                    "prompt_lens": torch.tensor([s["prompt"] for r in chunk for s in r])})
    return out


def static_shapes() -> contextlib.AbstractContextManager:
    """Dynamo specializes what it compiles in this context to the shapes it sees (automatic dynamic shapes off), for
    the kd loop with `loader_shaped_batches`: the layers then hold one static graph per pass shape, two with the
    data micro-batches' (2-3 entries each: the teacher, the student's layers, its first layer apart on a GPU;
    Dynamo's limit is 8 per function), and none for dynamic sizes."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)


def in_window(window: list[dict], chosen: Sequence[int], passes: list[dict]) -> list[dict]:
    """`window` with the micro-batches at `chosen` replaced by `passes` in order: the i-th pass at the i-th chosen
    place, passes beyond them after the last one, chosen places beyond them dropped."""
    out, last = [], chosen[-1]
    for m, b in enumerate(window):
        k = chosen.index(m) if m in chosen else -1
        out += [b] if k < 0 else passes[k : k + 1] + (passes[len(chosen):] if m == last else [])
    return out
