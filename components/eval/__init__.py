"""Evaluation with lm-eval 0.4.13: the `recipe` lm-eval model and an offline task pack.

Kept import-light (the CLI imports it for `recipe lm_eval --tasks-path`): the submodules
load lm-eval, torch and our models only when their names are first used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"

__all__ = ["TASKS_DIR", "RecipeLM", "evaluate", "offline_task_names", "task_manager"]


def __getattr__(name: str) -> Any:
    if name == "RecipeLM":
        from . import lm

        return getattr(lm, name)
    if name in ("evaluate", "task_manager", "offline_task_names"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
