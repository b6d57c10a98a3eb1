"""The shipped transfer set: small, redistributable (CC BY-SA / CC BY) text that the embedded configs train on.

Configs name it as `source: transfer:passages` or `source: transfer:chat`; see README.md here for provenance.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import RecipeError

TRANSFER_DIR = Path(__file__).resolve().parent
TRANSFER_SETS = {"passages": "passages.jsonl", "chat": "chat.jsonl"}


def transfer_set_path(name: str) -> Path:
    """Path of a shipped transfer file by short name (`passages`: {"text"} rows, `chat`: {"messages"} rows)."""
    if name not in TRANSFER_SETS:
        raise RecipeError(f"unknown transfer set 'transfer:{name}'; choose one of "
                          + ", ".join(f"transfer:{n}" for n in TRANSFER_SETS))
    path = TRANSFER_DIR / TRANSFER_SETS[name]
    if not path.is_file():
        raise RecipeError(f"{path}: missing from the installation; rebuild it with "
                          "`python -m llm_recipe.components.data.transfer.build_transfer_set`")
    return path
