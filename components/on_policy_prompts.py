"""Which micro-batches of a KD run go on-policy, and which prompts they sample (`kd.on_policy`; the rest of it is
components/on_policy.py).

- `is_on_policy` / `on_policy_index`: micro-batch k goes on-policy when floor(k * fraction + phase) steps up; the
  count below k says which prompts it is dealt; `on_policy_plan` says how many a run holds.
- Prompts from the training rows (the default): `row_prompts` / `prompts_of`, one per document of a packed row.
- Prompts from a set of their own (`kd.on_policy.prompts`): `load_prompt_set` tokenizes it, one prompt per row
  (an instruct/chat row may be prompt-only: no response), and `deal_prompts` deals the rows statelessly
  (`prompt_order`: a seeded permutation per pass, cut into whole micro-batches), so resume is bit-identical, ranks
  never overlap and a micro-batch never repeats a prompt.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from torch import Tensor

from .data.dataset import TokenizedDataset, build_dataset
from .errors import RecipeError
from .models.generation import decode_capacity

IGNORE_INDEX = -100
PROMPTS_KEY = "kd.on_policy.prompts"
# the dataset keys a prompt set takes; the others are fixed (unpacked, uncut, no shuffle or bucketing: the dealing
# orders the rows; train_on_input false: the prompt is what precedes the first target)
PROMPT_SET_KEYS = ("source", "format", "split", "name", "data_files", "column_map", "limit", "use_chat_template")
_WHOLE = 2**31 - 1  # tokenize prompt set rows whole: a prompt is cut to the budget, never dropped for its length


def is_on_policy(seed: int, step: int, micro: int, accum: int, fraction: float) -> bool:
    """Whether micro-batch `micro` of optimizer step `step` (0-based) goes on-policy: micro-batch k = step * accum
    + micro is when floor(k * fraction + phase) steps up, so any k consecutive micro-batches hold k * fraction of
    them (rounded either way); the phase in [0, 1) comes from the seed."""
    k = step * accum + micro
    phase = _key("phase", seed) / 2**63
    return math.floor((k + 1) * fraction + phase) > math.floor(k * fraction + phase)


def on_policy_index(seed: int, k: int, fraction: float) -> int:
    """How many micro-batches before global micro-batch k (= step * accum + micro) went on-policy (`is_on_policy`):
    floor(k * fraction + phase), the same float expression is_on_policy compares, so the count telescopes exactly;
    for an on-policy micro-batch, its 0-based rank among them (m: which prompts it is dealt)."""
    phase = _key("phase", seed) / 2**63
    return math.floor(k * fraction + phase)


def share_for_one(micro_batches: int) -> float:
    """The smallest share of two significant digits that puts at least one of `micro_batches` on-policy (any k
    consecutive micro-batches hold at least floor(k * fraction)): 1/3 -> 0.34, not 0.33."""
    need = 1 / max(micro_batches, 1)
    share = float(f"{need:.2g}")
    return share if share >= need else float(f"{share + 10 ** (math.floor(math.log10(share)) - 1):.2g}")


def on_policy_plan(seed: int, fraction: float, accum: int, start: int, steps: int) -> str | None:
    """The line a run logs before its first step: how many of its micro-batches (steps start+1..steps) go on-policy;
    a warning when a share above 0 puts none there (a small share in a short run), so an off-policy run does not pass
    for an on-policy one. None with fraction 0 (the off-policy baseline, asked for) or nothing left to train."""
    total = (steps - start) * accum
    if fraction == 0 or total <= 0:
        return None
    n = on_policy_index(seed, steps * accum, fraction) - on_policy_index(seed, start * accum, fraction)
    which = f"this run's {total} micro-batches" if start == 0 else f"the {total} micro-batches of the steps left"
    if n == 0:
        return (f"warning: kd.on_policy.fraction={fraction:g} puts none of {which} ({steps - start} steps x {accum}) "
                f"on-policy, so they train off-policy (only the held-out score samples): raise "
                f"kd.on_policy.fraction to at least {share_for_one(total):g}, or run more steps")
    return f"on-policy: {n} of {which} (kd.on_policy.fraction={fraction:g}, spread evenly)"


def sampling_groups(sizes: Sequence[Sequence[int]], max_rows: int, max_tokens: int) -> list[list[int]]:
    """Consecutive on-policy micro-batches sampled at once: `sizes[i]` = (prompts, padded prompt width + new tokens)
    of the i-th. A group grows while its prompts fit one decode batch of its widest row (`decode_capacity`: at most
    `max_rows`, spanning at most `max_tokens` positions: the compiled sampler's padded batch for that width); a
    micro-batch alone is always a group."""
    groups: list[list[int]] = []
    rows = wide = 0
    for i, (n, w) in enumerate(sizes):
        if groups and rows + n <= decode_capacity(max(wide, w), max_rows, max_tokens):
            groups[-1].append(i)
            rows, wide = rows + n, max(wide, w)
        else:
            groups.append([i])
            rows, wide = n, w
    return groups


@lru_cache(maxsize=4)
def prompt_order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """Pass `epoch` over the n prompt rows: a permutation seeded by (seed, epoch) alone (random.Random's shuffle,
    as the data loader's), so every rank and every resume orders them alike."""
    order = list(range(n))
    random.Random(_key("prompts", seed, epoch)).shuffle(order)
    return tuple(order)


def deal_prompts(seed: int, n: int, m: int, rank: int, world: int, rows: int) -> list[int]:
    """The prompt rows (indices below n) of the m-th on-policy micro-batch on `rank` of `world`, `rows` each.

    All ranks' micro-batch m takes g = world * rows prompts, rank r the r-th `rows` of them. A pass is the
    permutation prompt_order(seed, pass) of the n rows cut into k = max(1, n // g) micro-batches of g consecutive
    positions, and micro-batch m is the (m % k)-th of pass m // k: whole micro-batches, so none straddles two passes
    (a straddling one could take a row at the end of one pass and again at the start of the next). So when n >= g,
    a micro-batch's prompts are distinct, on all ranks together, and no row is dealt twice within a pass; the
    n - k * g rows left at a pass's end wait for a later one (each pass reshuffles: every row keeps equal odds), as a
    shuffled loader with drop_last leaves them. When n < g (k = 1), rank r takes positions (r * rows + j) mod n of
    its pass: still distinct while rows <= n, the ranks then overlapping (they must). A function of its arguments
    only, so resume is bit-identical; rank r's prompts are slots r * rows + j of what one process with world x the
    batch takes."""
    g = world * rows
    k = max(1, n // g)
    order, start = prompt_order(seed, m // k, n), (m % k) * g + rank * rows
    return [order[(start + j) % n] for j in range(rows)]


def _key(*parts: Any) -> int:
    """A 63-bit seed from `parts` (stable across processes and Python versions, unlike hash())."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_prompts(batch: dict[str, Tensor], prompt_tokens: int | None, budget: int, per_row: int = 1,
                max_new_tokens: int = 0) -> list[list[list[int]]]:
    """Each row's prompts, one per document, in order, from the documents that carry a target (a packed row's
    documents restart `input_pos` at 0, and its trailing padding is a document without targets; an unpacked row
    is one document, ending after its last target): at most `per_row`, and only while the row's prompts plus
    `max_new_tokens` each fit in budget + max_new_tokens (max_seq_len: an on-policy micro-batch then holds no more
    tokens than the loader's); a row's first document always gives one.
    `prompt_tokens`: text rows, the document's first N tokens (never its last, the end-of-text); None:
    instruct/chat rows, the tokens before the first one that carries a loss. At most `budget` tokens
    (max_seq_len - max_new_tokens): a longer instruct/chat prompt keeps its end."""
    tokens, labels, pos = batch["tokens"], batch["labels"], batch.get("input_pos")
    out = []
    for i, row in enumerate(tokens.tolist()):
        if pos is not None:
            starts = [0, *((pos[i, 1:] == 0).nonzero().flatten() + 1).tolist()]
            ends = [*starts[1:], len(row)]
        else:
            targets = (labels[i] != IGNORE_INDEX).nonzero()
            starts, ends = [0], [int(targets[-1]) + 2 if len(targets) else len(row)]
        prompts: list[list[int]] = []
        room = budget + max_new_tokens
        for start, end in zip(starts, ends):
            targets = (labels[i, start:end] != IGNORE_INDEX).nonzero()
            if not len(targets) and start > 0:
                continue  # padding, or a document whose targets were cut off
            if prompt_tokens is not None:
                prompt = row[start : start + max(1, min(prompt_tokens, end - start - 1, budget))]
            else:  # labels[t] is the target of token t + 1
                first = start + int(targets[0]) + 1 if len(targets) else end
                prompt = row[start:first][-budget:]
            room -= len(prompt) + max_new_tokens
            if prompts and room < 0:
                break
            prompts.append(prompt)
            if len(prompts) == per_row:
                break
        out.append(prompts)
    return out


def prompts_of(batch: dict[str, Tensor], prompt_tokens: int | None, budget: int, per_row: int = 1,
               max_new_tokens: int = 0) -> list[list[int]]:
    """`row_prompts`, row after row, in one list."""
    return [p for prompts in row_prompts(batch, prompt_tokens, budget, per_row, max_new_tokens) for p in prompts]


@dataclass(frozen=True)
class PromptSet:
    """`kd.on_policy.prompts` tokenized, one prompt per row in row order: `train` (dealt to on-policy
    micro-batches), `held` (its last held_out rows: the end-of-run score), where it came from, and how many prompts
    were longer than the budget (cut, as row_prompts cuts); `held_whole`: the held prompts uncut (what a training
    document that holds one begins with: `prompts_in_documents`)."""

    train: list[list[int]]
    held: list[list[int]]
    origin: str
    cut: int
    held_whole: list[list[int]]

    def micro_batch_tokens(self, rows: int, max_new_tokens: int) -> int:
        """Tokens of an on-policy micro-batch of `rows` prompts at most: each row padded to the longest prompt
        plus its completion (what the student's activations scale with; the loader's rows may hold fewer)."""
        return rows * (max(map(len, self.train + self.held)) + max_new_tokens)


def reads_training_rows(prompts: Any, dataset: Any) -> bool:
    """Whether a prompt set (`kd.on_policy.prompts`) reads the training rows themselves, however each section
    renders them (chat template, column_map): the same source (a file spelled two ways counts as one), split, config
    name and data files, and no `limit` on the training rows that would stop before the prompt set's last
    (held-out) rows. Overlaps these keys do not show (two slices, a copy) are found token for token
    (`prompts_in_documents`)."""
    import os

    from .data.sources import resolve_source

    def same_source(a: str, b: str) -> bool:
        a, b = resolve_source(a), resolve_source(b)
        try:
            return a == b or os.path.samefile(os.path.expanduser(a), os.path.expanduser(b))
        except OSError:
            return False

    return (same_source(prompts.source, dataset.source) and prompts.split == dataset.split
            and prompts.name == dataset.name and prompts.data_files == dataset.data_files
            and (dataset.limit is None or prompts.limit is not None and prompts.limit <= dataset.limit))


def prompts_in_documents(prompts: list[list[int]], dataset: Any) -> int:
    """How many of `prompts` begin a document of `dataset` (each document of a packed row on its own): prompts a run
    trains on off-policy. Token for token, so it holds whatever the two sections say (a file spelled two ways, two
    overlapping split slices, a copy of the file, a limit)."""
    by_length: dict[int, set[tuple[int, ...]]] = {}
    for q in prompts:
        by_length.setdefault(len(q), set()).add(tuple(q))
    last = {n: {q[-1] for q in qs} for n, qs in by_length.items() if n}  # a cheap test before a slice is compared
    found: set[tuple[int, ...]] = set()
    for item in dataset.items:
        tokens, start = item["tokens"], 0
        for n_doc in item.get("seq_lens", [len(tokens)]):
            for n, ends in last.items():
                if n <= n_doc and tokens[start + n - 1] in ends:
                    head = tuple(tokens[start : start + n])
                    if head in by_length[n]:
                        found.add(head)
            start += n_doc
    return sum(tuple(q) in found for q in prompts)


def _prompt_rows(s: Any, tokenizer: Any) -> TokenizedDataset:
    """The prompt set's rows tokenized whole and unpacked, instruct/chat rows with or without a response
    (`prompt_only`); its errors (a missing column, an empty prompt, an empty split) as one line naming
    kd.on_policy.prompts and the row."""
    d = replace(s.prompts, max_seq_len=_WHOLE, packed=False, shuffle=False, bucket=False, train_on_input=False)
    try:
        return build_dataset(tokenizer, d, prompt_only=True)
    except RecipeError as e:
        raise RecipeError(f"{PROMPTS_KEY}: {e}") from None


def _whole_prompts(data: TokenizedDataset, text: int | None) -> list[list[int]]:
    """Each row's prompt, uncut: a prompt-only row (no target: the format rendered its prompt alone) is all its
    tokens; any other row's, `row_prompts`' rule (instruct/chat: the tokens before the response)."""
    out = []
    for i in range(0, len(data), 256):
        chunk = data.items[i : i + 256]
        found = prompts_of(data.collate(chunk), text, _WHOLE)  # unpacked: one prompt per row
        out += [q if any(lab != IGNORE_INDEX for lab in x["labels"]) else list(x["tokens"])
                for x, q in zip(chunk, found, strict=True)]
    return out


def load_prompt_set(s: Any, max_seq_len: int, tokenizer: Any) -> PromptSet:
    """`kd.on_policy.prompts` as prompts (module docstring): each row's prompt (`_whole_prompts`), cut to
    max_seq_len - max_new_tokens (instruct/chat keep their end, text its first `prompt_tokens`); a set with no row
    left to train on after `held_out` is a one-line error with the counts."""
    data, p = _prompt_rows(s, tokenizer), s.prompts
    text = s.prompt_tokens if p.format == "text" else None
    whole = _whole_prompts(data, text)
    budget = max_seq_len - s.max_new_tokens
    prompts = [q[:budget] if text is not None else q[-budget:] for q in whole]
    origin = f"{p.source}, split {p.split}" + (f", limit {p.limit}" if p.limit is not None else "")
    n = len(prompts) - s.held_out
    if n < 1:
        raise RecipeError(f"{PROMPTS_KEY}: {len(prompts)} prompt rows in {origin}, and kd.on_policy.held_out="
                          f"{s.held_out} holds them all out: none left to train on (lower held_out or add rows)")
    return PromptSet(prompts[:n], prompts[n:], origin, sum(len(q) > budget for q in whole), whole[n:])
