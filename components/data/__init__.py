"""Datasets, tokenization formats, collation, packing and the resumable loader.

Items are `{"tokens", "labels"}` (labels -100 where no loss is taken); `collate` returns labels already shifted.
"""

from llm_recipe.components.data.collate import (
    PackedDataset,
    collate,
    collate_packed,
    shift_labels,
)
from llm_recipe.components.data.dataset import DATASET_KEYS, TokenizedDataset, build_dataset, build_loader
from llm_recipe.components.data.formats import (
    IGNORE_INDEX,
    ChatFormat,
    InstructFormat,
    TextFormat,
    chat_segments,
    make_format,
    tokenize_segments,
)
from llm_recipe.components.data.loader import StatefulLoader
from llm_recipe.components.data.sources import Rows, load_rows
from llm_recipe.components.data.transfer import transfer_set_path

__all__ = [
    "DATASET_KEYS",
    "IGNORE_INDEX",
    "ChatFormat",
    "InstructFormat",
    "PackedDataset",
    "Rows",
    "StatefulLoader",
    "TextFormat",
    "TokenizedDataset",
    "build_dataset",
    "build_loader",
    "chat_segments",
    "collate",
    "collate_packed",
    "load_rows",
    "make_format",
    "shift_labels",
    "tokenize_segments",
    "transfer_set_path",
]
