"""`build_dataset`: the one entry point recipes call; a YAML `dataset:` section (`DatasetConfig`) maps 1:1 onto its
keywords."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..launch import is_rank0
from ..schema import Choice, Range
from ..settings import REQUIRED, check_fields, setting
from .collate import PackedDataset, collate
from .formats import FORMATS, IGNORE_INDEX, RowError, make_format
from .loader import StatefulLoader
from .sources import load_rows

if TYPE_CHECKING:
    from ..models.tokenizer import Tokenizer


log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """The `dataset:` section: where the rows come from and how they become token rows (`build_dataset`'s
    keywords: their one home, defaults included)."""

    source: str = setting(REQUIRED, str, "file (.json/.jsonl/.csv/.parquet), save_to_disk dir, HF dataset or "
                          "transfer:passages|chat")
    format: str = setting("text", Choice(*FORMATS), "how a row becomes tokens and targets")
    split: str = setting("train", str, "split name; slices like train[:90%] work")
    name: str | None = setting(None, (str, type(None)), "HF dataset config name")
    data_files: Any = setting(None, (str, list, dict, type(None)), "passed to datasets.load_dataset")
    column_map: dict | None = setting(None, (dict, type(None)), "rename columns, e.g. {text: passage}")
    max_seq_len: int = setting(2048, Range(int, ge=2), "truncate (and pack) to this many tokens")
    train_on_input: bool = setting(False, bool, "instruct/chat: the prompt carries a loss too")
    use_chat_template: bool = setting(False, bool, "instruct format: render prompts with the model's chat "
                                    "template (chat rows always use it)")
    packed: bool = setting(False, bool, "fill every row with max_seq_len tokens (no cross-document attention)")
    limit: int | None = setting(None, Range(int, ge=1, optional=True), "keep only the first N rows")
    shuffle: bool = setting(True, bool, "reshuffle each epoch (deterministic from seed)")
    bucket: bool = setting(False, bool, "group similar lengths to reduce padding")

    def __post_init__(self) -> None:
        check_fields(self, "dataset.")  # `build_dataset(tok, source, **keys)` builds it from plain arguments

    def kwargs(self) -> dict[str, Any]:
        """The section as `build_dataset` keywords (a plain dict, also what a logits cache records)."""
        return asdict(self)


class TokenizedDataset(Sequence):
    """Tokenized (optionally packed) examples plus the batching options chosen in the config."""

    def __init__(self, items: Sequence[dict], pad_id: int, max_seq_len: int, packed: bool, shuffle: bool,
                 bucket: bool, origin: str) -> None:
        self.items = items
        self.pad_id = pad_id
        self.max_seq_len = max_seq_len
        self.packed = packed
        self.shuffle = shuffle
        self.bucket = bucket
        self.origin = origin

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        return self.items[i]

    def lengths(self) -> list[int]:
        """Token count of each item (used by the bucketing sampler)."""
        return [len(x["tokens"]) for x in self.items]

    def num_loss_tokens(self) -> int:
        """Positions that carry a target after shifting (for logging / sanity checks)."""
        return sum(loss_tokens(x) for x in self.items)

    def collate(self, batch: list[dict]) -> dict:
        """Collate with this dataset's pad id (see `llm_recipe.components.data.collate.collate`)."""
        return collate(batch, self.pad_id)


def loss_tokens(item: dict) -> int:
    """Positions of one item that carry a target after shifting (each packed document on its own)."""
    if "seq_lens" in item:
        total, start = 0, 0
        for n in item["seq_lens"]:
            total += sum(lab != IGNORE_INDEX for lab in item["labels"][start + 1 : start + n])
            start += n
        return total
    return _targets(item["labels"])


def _targets(labels: list[int]) -> int:
    """Positions of a row's labels that carry a target after shifting (counted in C: rows of thousands of labels)."""
    shifted = labels[1:]
    return len(shifted) - shifted.count(IGNORE_INDEX)


def _lost_targets(ex: dict, item: dict, max_seq_len: int) -> int:
    """Targets of row `ex` past max_seq_len (`item` is its kept part): counted when the row was tokenized whole,
    the format's estimate when its tail never was (formats.tokenize_segments)."""
    if "lost_targets_estimate" in ex:
        return ex["lost_targets_estimate"]
    if len(ex["tokens"]) <= max_seq_len:
        return 0
    return _targets(ex["labels"]) - _targets(item["labels"])


def _cut_message(truncated: int, estimated: int, rows: int, max_seq_len: int, lost: int, targets: int) -> str:
    """The warning for rows cut at max_seq_len: exact counts, or "about" when some rows' tails were not tokenized
    (counting them exactly would take the whole-text tokenization the cut avoids)."""
    about = "about " if estimated else ""
    was = "was" if estimated == 1 else "were"
    how = (f" ({estimated} of those rows {was} tokenized only a little past the cut: the tokens of the rest are "
           "estimated from its characters at the row's own tokens per character)") if estimated else ""
    return (f"dataset: {truncated} of {rows} rows are longer than max_seq_len={max_seq_len} and were cut there: "
            f"{about}{lost:,} of the data's {about}{targets:,} target tokens ({100 * lost / max(targets, 1):.0f}%) "
            f"are not trained on{how}; raise dataset.max_seq_len to keep them")


def build_dataset(tokenizer: Tokenizer, source: str | DatasetConfig, *, prompt_only: bool = False,
                  **options: Any) -> TokenizedDataset:
    """Load rows, tokenize them in `format`, truncate to max_seq_len and optionally pack.

    `source`: a `DatasetConfig` (a `dataset:` section), or its `source` key with any of its other keys as keywords
    (`build_dataset(tok, "rows.jsonl", format="chat")`; DatasetConfig holds their defaults and docs). source: file,
    `save_to_disk` folder, HF dataset name/path, or `transfer:passages|chat`. split may slice (`train[:90%]`,
    `train[-200:]`). limit keeps the first N rows after slicing. shuffle/bucket are read by `build_loader`. A
    malformed row raises RecipeError naming `file:line` (or `row N`). `prompt_only` (an on-policy prompt set, not
    a `dataset:` key): instruct/chat rows may lack a response, and are then their prompt with no target (formats.py).
    """
    d = replace(source, **options) if isinstance(source, DatasetConfig) else DatasetConfig(source=source, **options)
    source, split, max_seq_len, limit = d.source, d.split, d.max_seq_len, d.limit
    fmt = make_format(d.format, tokenizer, d.column_map, d.train_on_input, d.use_chat_template, prompt_only,
                      max_tokens=max_seq_len)
    rows = load_rows(source, split=split, name=d.name, data_files=d.data_files)
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    if len(rows) == 0:
        raise RecipeError(f"dataset source '{source}' split '{split}' has no rows")
    items = []
    truncated, lost, targets = 0, 0, 0  # rows cut at max_seq_len, and the target tokens cut off with them
    estimated = 0  # cut rows whose tail was never tokenized: their lost targets are an estimate (formats.py)
    for i in range(len(rows)):
        row = rows[i]
        if not isinstance(row, Mapping):
            raise RecipeError(f"{rows.where(i)}: expected an object with columns, got {type(row).__name__}")
        try:
            ex = fmt(row)
        except RowError as e:
            raise RecipeError(f"{rows.where(i)}: {e}") from None
        item = {"tokens": ex["tokens"][:max_seq_len], "labels": ex["labels"][:max_seq_len]}
        row_lost = _lost_targets(ex, item, max_seq_len)
        targets += _targets(item["labels"]) + row_lost
        lost += row_lost
        truncated += len(ex["tokens"]) > max_seq_len or "lost_targets_estimate" in ex
        estimated += "lost_targets_estimate" in ex
        # A row whose every target fell past max_seq_len teaches nothing: drop it (and say how many); a prompt-only
        # row has none by design.
        if prompt_only or any(lab != IGNORE_INDEX for lab in item["labels"][1:]):
            items.append(item)
    dropped = len(rows) - len(items)
    if dropped and is_rank0():  # every rank builds the same rows: said once
        log.warning("dataset: dropped %d of %d rows with no target tokens within max_seq_len=%d",
                    dropped, len(rows), max_seq_len)
    if lost and is_rank0():  # rows are cut, not split (packing fills rows with whole documents): said, not silent
        log.warning(_cut_message(truncated, estimated, len(rows), max_seq_len, lost, targets))
    if not items:
        raise RecipeError(f"dataset '{source}': no row has a target token within max_seq_len={max_seq_len}; "
                          "raise dataset.max_seq_len")
    if d.packed:
        items = PackedDataset(items, max_seq_len, tokenizer.pad_id)
    return TokenizedDataset(items, tokenizer.pad_id, max_seq_len, d.packed, d.shuffle, d.bucket, rows.origin)




def build_loader(dataset: TokenizedDataset, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False) -> StatefulLoader:
    """A StatefulLoader over `dataset` using its shuffle/bucket options and its `collate` (a subclass may add
    to the batch: llm_recipe.components.logits_cache)."""
    return StatefulLoader(dataset, batch_size, shuffle=dataset.shuffle, seed=seed,
                          collate_fn=dataset.collate, drop_last=drop_last,
                          rank=rank, world_size=world_size, bucket=dataset.bucket)
