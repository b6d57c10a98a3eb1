"""Finding recipes: shipped `recipes/<name>.py` modules (listed without importing them) or a user's `path.py`.

A shipped recipe loads as the module it is, `llm_recipe.recipes.<name>`. A user's file (or a recipe in
`$RECIPE_RECIPES_DIR`) is run from its path with `runpy`, which registers it in sys.modules only while its
top level runs (dataclasses look their module up there); its folder is importable while it loads and runs, as
`python path.py` makes it (`recipe_folder_importable`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.resources
import os
import runpy
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ..components.errors import RecipeError
from ..components.settings import is_config_type

# The order `recipe ls` shows the shipped algorithms in; recipes not named here follow alphabetically.
PREFERRED_ORDER = ("full", "lora", "kd", "kd_logits", "qat", "eval", "quantize", "generate")
# Recipe names that run another recipe's file: LoRA / DoRA / QLoRA is recipes/full.py with a `lora:` section
# (configs/lora/*) and QAT is the same file with a `qat:` section (configs/qat/*), so `recipe run lora` / `qat`
# and `recipe cp lora` / `qat` give that file, loop included.
ALIASES = {"lora": "full", "qat": "full"}
SHIPPED_PACKAGE = "llm_recipe.recipes"


def _shipped_dir() -> Path:
    return Path(str(importlib.resources.files(SHIPPED_PACKAGE)))


def recipes_dir() -> Path:
    """The folder of the shipped recipes: `$RECIPE_RECIPES_DIR`, else the installed `llm_recipe.recipes` package.

    (Always under our package name: torchtune installs a top-level `recipes` package into site-packages.)
    """
    override = os.environ.get("RECIPE_RECIPES_DIR")
    return Path(override) if override else _shipped_dir()


def _defines_recipe(path: Path) -> bool:
    # Parsed, not imported: listing must be fast (no torch import) and must not break on a recipe that
    # fails to import; a recipe is a module that binds CONFIG (its config type; SCHEMA, a dict, in older recipes)
    # and main at top level.
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, OSError, UnicodeDecodeError):
        return False
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return "main" in names and bool(names & {"CONFIG", "SCHEMA"})


def discover_recipes() -> dict[str, Path]:
    """Shipped recipes `{name: file}` in display order: modules in `recipes/` that define CONFIG and main, and
    the `ALIASES` of those."""
    found = {
        p.stem: p for p in recipes_dir().glob("*.py") if not p.name.startswith("_") and _defines_recipe(p)
    }
    found.update({alias: found[target] for alias, target in ALIASES.items() if target in found and alias not in found})
    order = [n for n in PREFERRED_ORDER if n in found] + sorted(n for n in found if n not in PREFERRED_ORDER)
    return {n: found[n] for n in order}


def is_recipe_path(name_or_path: str) -> bool:
    """True when the argument names a user's recipe file rather than a shipped recipe."""
    return name_or_path.endswith(".py")


def recipe_file(name_or_path: str) -> tuple[str, Path]:
    """`(name, file)` for a shipped recipe name or a `path.py`; RecipeError when there is none."""
    if is_recipe_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise RecipeError(f"recipe file '{name_or_path}' not found")
        return path.stem, path.resolve()
    recipes = discover_recipes()
    if name_or_path not in recipes:
        known = ", ".join(recipes) or "none installed"
        raise RecipeError(f"unknown recipe '{name_or_path}' (recipes: {known}; or give a path/to/recipe.py)")
    return name_or_path, recipes[name_or_path]


def load_recipe(name_or_path: str) -> tuple[str, ModuleType]:
    """Import a shipped recipe or run a `path.py`'s top level, and check it defines CONFIG (a config dataclass; or
    SCHEMA, a dict, in recipes written before typed configs) and main."""
    name, path = recipe_file(name_or_path)
    if path.resolve().parent == _shipped_dir().resolve():
        module = importlib.import_module(f"{SHIPPED_PACKAGE}.{path.stem}")  # an alias names another file
    else:
        module = _run_recipe_file(path, name)
    config = recipe_config(module)
    missing = [a for a, value in (("CONFIG", config), ("main", getattr(module, "main", None))) if value is None]
    if missing:
        raise RecipeError(f"recipe '{name_or_path}' does not define {' and '.join(missing)}")
    if not (is_config_type(config) or isinstance(config, dict)) or not callable(module.main):
        raise RecipeError(f"recipe '{name_or_path}': CONFIG must be a dataclass (or SCHEMA a dict) and main a function")
    return name, module


def recipe_config(module: ModuleType) -> Any:
    """A recipe module's config declaration: its `CONFIG` type, else its legacy `SCHEMA` dict."""
    return getattr(module, "CONFIG", None) or getattr(module, "SCHEMA", None)


def _run_recipe_file(path: Path, name: str) -> ModuleType:
    # runpy registers the file under `run_name` only while its top level runs, and restores sys.modules after:
    # nothing of ours stays registered. Its `if __name__ == "__main__":` block does not run.
    module = ModuleType(f"_recipe_{name}")
    with recipe_folder_importable(str(path)):
        module.__dict__.update(runpy.run_path(str(path), run_name=module.__name__))
    return module


@contextlib.contextmanager
def recipe_folder_importable(name_or_path: str) -> Iterator[None]:
    """While a user's recipe file loads and runs in this process, modules next to it are importable, as
    `python path.py` (how torchrun starts it) makes them; nothing for a shipped recipe name.

    The one place the product changes sys.path: Python finds `import my_helper` only through it, and a recipe
    copied next to its helper modules has to run in-process as it runs under torchrun. The folder goes first, as
    for `python path.py`, and is removed again on the way out.
    """
    if not is_recipe_path(name_or_path):
        yield
        return
    folder = str(Path(name_or_path).expanduser().resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # the first entry equal to it: ours (unless the recipe removed it)
            sys.path.remove(folder)
