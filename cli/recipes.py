"""Finding recipes: shipped `recipes/<name>.py` modules (listed without importing them) or a user's `path.py`."""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from llm_recipe.components.errors import RecipeError

# The order `recipe ls` shows the shipped algorithms in; recipes not named here follow alphabetically.
PREFERRED_ORDER = ("full", "lora", "kd", "kd_logits", "qat", "eval", "quantize", "generate")
# Recipe names that run another recipe's file: LoRA / DoRA / QLoRA is recipes/full.py with a `lora:` section
# (configs/lora/*), so `recipe run lora` and `recipe cp lora` give that file, loop included.
ALIASES = {"lora": "full"}


def recipes_dir() -> Path:
    """The folder of the shipped recipes: `$RECIPE_RECIPES_DIR`, else `recipes/` beside `cli/` in the checkout.

    Found by path, never imported as the package `recipes`: torchtune installs a top-level `recipes` package
    into site-packages, which would shadow ours.
    """
    override = os.environ.get("RECIPE_RECIPES_DIR")
    return Path(override) if override else Path(__file__).resolve().parent.parent / "recipes"


def _defines_recipe(path: Path) -> bool:
    # Parsed, not imported: listing must be fast (no torch import) and must not break on a recipe that
    # fails to import; a recipe is a module that binds both SCHEMA and main at top level.
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
    return {"SCHEMA", "main"} <= names


def discover_recipes() -> dict[str, Path]:
    """Shipped recipes `{name: file}` in display order: modules in `recipes/` that define SCHEMA and main, and
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
    """Import a shipped recipe or a `path.py` and check it defines SCHEMA and main."""
    name, path = recipe_file(name_or_path)
    # Shipped recipes load by path too (see recipes_dir).
    mod_name = f"_recipe_{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise RecipeError(f"cannot load recipe file '{name_or_path}'")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
    if is_recipe_path(name_or_path):
        # like `python path.py` (how torchrun runs it): the recipe's folder is importable
        sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    missing = [a for a in ("SCHEMA", "main") if not hasattr(module, a)]
    if missing:
        raise RecipeError(f"recipe '{name_or_path}' does not define {' and '.join(missing)}")
    if not isinstance(module.SCHEMA, dict) or not callable(module.main):
        raise RecipeError(f"recipe '{name_or_path}': SCHEMA must be a dict and main a function")
    return name, module
