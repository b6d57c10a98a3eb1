"""Datasets, tokenization formats, collation, packing and the resumable loader.

Items are `{"tokens", "labels"}` (labels -100 where no loss is taken); `collate` returns labels already shifted.
"""

from .collate import (
    PackedDataset,
    collate,
    collate_packed,
    shift_labels,
)
from .dataset import TokenizedDataset, build_dataset, build_loader
from .formats import (
    IGNORE_INDEX,
    ChatFormat,
    InstructFormat,
    TextFormat,
    chat_segments,
    make_format,
    tokenize_segments,
)
from .loader import StatefulLoader
from .sources import Rows, load_rows
from .transfer import transfer_set_path

__all__ = [
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
