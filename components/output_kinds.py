"""Which recipe's outputs a folder holds, so that one recipe never writes into another recipe's `output_dir`.

A training run, a `kd_logits` cache, `quantize` exports, a `transfer` set and `eval` results each have their own
rules for a folder that already holds their outputs (resume or overwrite, resume shard by shard, write again for
the same run: components/result_runs.py), but none of
them knows the others' files: a KD run into a cache folder, or `quantize` into a training run's folder, would
leave two recipes' outputs mixed, and `overwrite=true` would delete only its own half. So a recipe is refused
an `output_dir` that holds another recipe's outputs, recognised by the names each one writes at the top level.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import RecipeError

# kind -> (in words, the top-level names its recipe writes; globs allowed)
KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "training": ("a training run", ("checkpoints", "model", "adapter", "quantized", "metrics.jsonl", "run.json")),
    "kd_logits": ("a kd_logits cache", ("manifest.json", "shard_*.safetensors")),
    "quantize": ("quantize exports", ("report.json", "hf", "model-*.gguf", "model.pte")),
    "transfer": ("a transfer set", ("transfer.json", "passages.jsonl", "chat.jsonl")),
    "eval": ("eval results", ("results.json",)),
}
# kind -> the file that says a folder really is its recipe's output folder (the names above alone are common words)
RECORDS = {"training": "run.json", "kd_logits": "manifest.json", "quantize": "report.json",
           "transfer": "transfer.json", "eval": "results.json"}
RECIPE_KINDS = {"full": "training", "lora": "training", "qat": "training", "kd": "training",
                "kd_logits": "kd_logits", "quantize": "quantize", "transfer": "transfer", "eval": "eval"}

__all__ = ["KINDS", "RECIPE_KINDS", "check_output_kind", "free_folder", "kinds_in"]


def kinds_in(folder: str | os.PathLike) -> dict[str, list[str]]:
    """The kinds of outputs `folder` holds: kind -> the names that show it (empty when it holds none)."""
    out = Path(folder)
    if not out.is_dir():
        return {}
    found: dict[str, list[str]] = {}
    for kind, (_, names) in KINDS.items():
        hits = sorted({p.name for name in names for p in out.glob(name)})
        if hits:
            found[kind] = hits
    return found


def check_output_kind(recipe: str, output_dir: str | os.PathLike | None) -> None:
    """RecipeError when `output_dir` holds the outputs of a recipe of another kind than `recipe` (a recipe we do
    not know, e.g. a user's own, is not checked)."""
    own = RECIPE_KINDS.get(recipe)
    if own is None or output_dir is None:
        return
    _check_not_inside_outputs(recipe, Path(output_dir))
    for kind, names in kinds_in(output_dir).items():
        if kind != own:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise RecipeError(f"{output_dir} holds {KINDS[kind][0]} ({shown}): recipe run {recipe} writes "
                              f"{KINDS[own][0]}, and two recipes' outputs in one folder would mix; choose another "
                              "output_dir (e.g. a subfolder)")


def _check_not_inside_outputs(recipe: str, out: Path) -> None:
    """RecipeError when `out` lies inside an output of a recipe's folder (a training run's model/, adapter/ or
    checkpoints/, quantize's hf/): that run's resume or overwrite deletes or outdates whatever is written there
    (eval results in a run's model/ vanished at its next resume=true, with no message)."""
    path = out.expanduser().absolute()
    for folder in path.parents:
        child = path.relative_to(folder).parts[0]
        for kind, record in RECORDS.items():
            if child != record and child in KINDS[kind][1] and (folder / record).is_file():
                raise RecipeError(f"{out} is inside {folder / child}, an output of {KINDS[kind][0]} in {folder}: "
                                  f"that run's resume or overwrite would delete or outdate what recipe run {recipe} "
                                  "writes there; choose an output_dir outside it")


def free_folder(path: str, suffix: str) -> str:
    """`path` when it holds no recipe's outputs, else the first of `path + suffix`, `path + suffix + "_2"`, ... that
    holds none: where a printed command can start a new run without being refused."""
    if not kinds_in(path):
        return path
    base, n = path.rstrip("/") + suffix, 1
    while kinds_in(candidate := base if n == 1 else f"{base}_{n}"):
        n += 1
    return candidate
