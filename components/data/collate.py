"""Batch collation (padding, label shifting) and sequence packing.

Labels leave here already shifted: `labels[:, t]` is the target for the logits at position t; the last position
of every sequence (and, when packed, of every document) is IGNORE_INDEX, so no target crosses a document.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .formats import IGNORE_INDEX


def shift_labels(labels: Sequence[int], ignore_index: int = IGNORE_INDEX) -> list[int]:
    """labels[t+1] for each t, and ignore_index at the end: the target of each position."""
    return [*labels[1:], ignore_index] if len(labels) else []


def collate(batch: Sequence[dict], pad_id: int, ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """Pad a list of items to the longest and shift labels; packed items (with `seq_lens`) also get input_pos."""
    if not batch:
        raise ValueError("collate got an empty batch")
    if "seq_lens" in batch[0]:
        return collate_packed(batch, ignore_index)
    width = max(len(item["tokens"]) for item in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), ignore_index, dtype=torch.long)
    for i, item in enumerate(batch):
        n = len(item["tokens"])
        tokens[i, :n] = torch.tensor(item["tokens"], dtype=torch.long)
        labels[i, :n] = torch.tensor(shift_labels(item["labels"], ignore_index), dtype=torch.long)
    return {"tokens": tokens, "labels": labels}


def input_positions(seq_lens: Sequence[int]) -> torch.Tensor:
    """Long [s]: position within each document, restarting at 0."""
    return torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens])


def collate_packed(batch: Sequence[dict], ignore_index: int = IGNORE_INDEX) -> dict[str, torch.Tensor]:
    """Stack packed rows (already padded to one length) into tokens, per-document shifted labels and input_pos
    (positions restart at 0 at each document; the attention mask is built from them on the device:
    llm_recipe.components.models.attention)."""
    tokens = torch.tensor([item["tokens"] for item in batch], dtype=torch.long)
    labels = []
    for item in batch:
        row, start = [], 0
        for n in item["seq_lens"]:
            row += shift_labels(item["labels"][start : start + n], ignore_index)
            start += n
        labels.append(row)
    return {
        "tokens": tokens,
        "labels": torch.tensor(labels, dtype=torch.long),
        "input_pos": torch.stack([input_positions(item["seq_lens"]) for item in batch]),
    }


class PackedDataset(Sequence):
    """Examples packed into rows of exactly max_seq_len tokens, each example into the first of the open rows it fits
    (first fit over a window of `open_rows`; when none has room and the window is full, the fullest row is closed).

    Why not the usual next fit (fill one row in order, pad it when the next example does not fit; torchtune's
    PackedDataset): it pads away half an example per row, 7.6% of the tokens of 2048-token rows of the transfer
    passages and 15% at 1024, which every step computes; first fit over 16 open rows pads 1.1% and 2.9%, so an
    epoch has 6-12% fewer rows. Deterministic for a given order of examples, which stay within a window of rows.
    Each row keeps `seq_lens` (its documents' lengths; trailing padding counts as one extra document that only
    attends to itself, so no attention row is empty). Examples longer than max_seq_len are truncated.
    """

    def __init__(self, examples: Sequence[dict], max_seq_len: int, pad_id: int,
                 ignore_index: int = IGNORE_INDEX, open_rows: int = 16) -> None:
        if max_seq_len < 1:
            raise ValueError("max_seq_len must be positive")
        self.max_seq_len = max_seq_len
        self.rows: list[dict] = []
        rows: list[tuple[list[int], list[int], list[int]]] = []  # open rows: tokens, labels, document lengths

        def close(row: tuple[list[int], list[int], list[int]]) -> None:
            tokens, labels, lens = row
            pad = max_seq_len - len(tokens)
            self.rows.append({
                "tokens": tokens + [pad_id] * pad,
                "labels": labels + [ignore_index] * pad,
                "seq_lens": lens + ([pad] if pad else []),
            })

        for ex in examples:
            t, lab = list(ex["tokens"][:max_seq_len]), list(ex["labels"][:max_seq_len])
            if not t:
                continue
            i = next((i for i, r in enumerate(rows) if len(r[0]) + len(t) <= max_seq_len), None)
            if i is None:
                if len(rows) == open_rows:
                    close(rows.pop(max(range(len(rows)), key=lambda k: len(rows[k][0]))))
                rows.append(([], [], []))
                i = len(rows) - 1
            row = rows[i]
            row[0].extend(t)
            row[1].extend(lab)
            row[2].append(len(t))
            if len(row[0]) == max_seq_len:
                close(rows.pop(i))
        for row in rows:
            close(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        return self.rows[i]

    def lengths(self) -> list[int]:
        """Every row is max_seq_len long (for the bucketing sampler's interface)."""
        return [self.max_seq_len] * len(self.rows)
