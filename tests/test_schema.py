"""Value specs (components/schema.py) and how validation uses them: ranges, choices, lists, the component
allow-list (checked before any import), errors that name the override, and every recipe declaring its folders."""

from pathlib import Path

import pytest

from llm_recipe.cli.recipes import discover_recipes, load_recipe
from llm_recipe.components.component import COMPONENT
from llm_recipe.components.config import load_config, validate_config
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.schema import Choice, ListOf, ModelDir, OutputDir, Pattern, Range, spec_problem
from llm_recipe.components.settings import schema_of


@pytest.mark.parametrize("spec, value, problem", [
    (Range(float, ge=0, le=1), 0, None),
    (Range(float, ge=0, le=1), 1, None),
    (Range(float, ge=0, le=1), 1.5, "must be a number in [0, 1], got 1.5"),
    (Range(float, gt=0, lt=1), 0.0, "must be a number in (0, 1), got 0.0"),
    (Range(float, gt=0), float("nan"), "must be a number > 0, got nan"),
    (Range(float, gt=0), float("inf"), "must be a number > 0, got inf"),
    (Range(float, le=2), -5, None),
    (Range(int, ge=1), 2.0, "must be an int >= 1, got float 2.0"),
    (Range(int, ge=1), True, "must be an int >= 1, got bool True"),
    (Range(int, ge=1, optional=True), None, None),
    (Range(int, ge=1), None, "must be an int >= 1, got null"),
    (Choice("a", "b"), "c", "must be one of a, b, got 'c'"),
    (Choice("a", "b", optional=True), None, None),
    (Choice(True, False, "auto"), 1, "must be one of true, false, auto, got int 1"),  # 1 == True, yet not a bool
    (Choice(True, False, "auto"), False, None),
    (Pattern(r"cuda(:\d+)?", "cuda or cuda:N"), "cuda:1", None),
    (Pattern(r"cuda(:\d+)?", "cuda or cuda:N"), "cuda:x", "must be cuda or cuda:N, got 'cuda:x'"),
    (ListOf(Range(int, ge=0), min_len=1, unique=True), [0, 2], None),
    (ListOf(Range(int, ge=0), min_len=1, unique=True), [], "must be a non-empty list of distinct items "
                                                            "(an int >= 0 each), got 0 item(s)"),
    (ListOf(Range(float, ge=0, lt=1), min_len=2, max_len=2), [0.9], "must be a list of 2 items (a number in [0, 1) "
                                                                    "each), got 1 item(s)"),
    (ListOf(str), "abc", "must be a list (str each), got str 'abc'"),
    (ModelDir(), "", "must be a model folder path, got str ''"),
    (OutputDir(), 3, "must be a folder path, got int 3"),
    ((int, type(None)), "x", "must be int or null, got str 'x'"),
])
def test_spec_problems(spec, value, problem):
    assert spec_problem(spec, value) == problem


def _cfg(tmp_path: Path, text: str, overrides=()):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return load_config(str(path), overrides)


def test_a_value_set_in_the_file_is_blamed_on_its_line(tmp_path):
    cfg = _cfg(tmp_path, "# x\nkd:\n  kd_ratio: 1.5\n")
    with pytest.raises(RecipeError) as e:
        validate_config(cfg, {"kd": {"kd_ratio": Range(float, ge=0, le=1)}})
    assert str(e.value).endswith("c.yaml:3: key 'kd.kd_ratio' must be a number in [0, 1], got 1.5")


def test_an_override_that_creates_an_unknown_section_is_blamed_not_the_file(tmp_path):
    cfg = _cfg(tmp_path, "# x\nkd:\n  kd_ratio: 0.5\n", ["a.b==c"])
    with pytest.raises(RecipeError) as e:
        validate_config(cfg, {"kd": {"kd_ratio": float}}, recipe="kd")
    assert str(e.value) == "override 'a.b==c': unknown key 'a' (recipe kd reads: kd)"


def test_component_allow_list_is_checked_before_importing(tmp_path):
    schema = {"optimizer": COMPONENT(allow=("torch.optim.",), lr=Range(float, gt=0))}
    # a module that does not exist: refused by the allow-list, not by a failed import
    cfg = _cfg(tmp_path, "optimizer:\n  _component_: no_such_package_xyz.Evil\n")
    with pytest.raises(RecipeError, match="'no_such_package_xyz.Evil' is not allowed here: name a class under "
                                          r"torch\.optim\.$"):
        validate_config(cfg, schema)
    cfg = _cfg(tmp_path, "optimizer:\n  _component_: torch.optim.__builtins__.eval\n")
    with pytest.raises(RecipeError, match="is not allowed here"):
        validate_config(cfg, schema)
    cfg = _cfg(tmp_path, "optimizer:\n  _component_: torch.optim.SGD\n  lr: -1\n")
    with pytest.raises(RecipeError, match=r"key 'optimizer.lr' must be a number > 0, got -1$"):
        validate_config(cfg, schema)
    validate_config(_cfg(tmp_path, "optimizer:\n  _component_: torch.optim.SGD\n  lr: 0.1\n"), schema)


@pytest.mark.parametrize("name", list(discover_recipes()))
def test_every_recipe_declares_its_folders(name):
    """Folder checks and the output_dir lock are driven by the schema: a recipe that reads `output_dir` or a
    `checkpoint_dir` must declare it as OutputDir / ModelDir, or `recipe run` would skip the checks."""
    _, module = load_recipe(name)

    def walk(schema, prefix=""):
        for k, v in schema.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    for key, spec in walk(schema_of(module.CONFIG)):
        if key == "output_dir":
            assert isinstance(spec, OutputDir), f"{name}: {key}"
        if key.endswith("checkpoint_dir"):
            assert isinstance(spec, ModelDir), f"{name}: {key}"
