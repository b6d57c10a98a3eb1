"""Config loading, overrides, interpolation, schema validation (file:line errors) and instantiation."""

from pathlib import Path

import pytest

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.component import COMPONENT, instantiate
from llm_recipe.components.config import (
    load_config,
    validate_config,
)
from llm_recipe.components.errors import RecipeError

FIXTURES = Path(__file__).parent / "fixtures"

CFG = """\
# a test config
model:
  name: tiny
  dim: 64
  dropout: null
lr: 0.001
steps: 10
tags: [a, b]
out_dir: runs/${model.name}
optimizer:
  _component_: cli_components.Outer
  scale: 2
  inner:
    _component_: cli_components.Inner
    a: 1
"""

SCHEMA = {
    "model": {"name": str, "dim": int, "dropout": (float, type(None))},
    "lr": float,
    "steps": int,
    "tags": list,
    "out_dir": str,
    "optimizer": COMPONENT,
    "extra": (int, type(None)),
}


@pytest.fixture(autouse=True)
def _components_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def _write(tmp_path: Path, text: str = CFG, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_overrides_are_typed_like_yaml(tmp_path):
    path = _write(tmp_path)
    cfg = load_config(
        str(path),
        [
            "model.dim=128",
            "lr=1e-5",
            "tags=[1,2]",
            "model.dropout=0.1",
            "model.name=big",
            "steps=null",
            "extra=3",
        ],
    )
    assert cfg.model.dim == 128 and isinstance(cfg.model.dim, int)
    assert cfg.lr == pytest.approx(1e-5) and isinstance(cfg.lr, float)
    assert list(cfg.tags) == [1, 2]
    assert cfg.model.dropout == 0.1
    assert cfg.steps is None
    assert cfg.extra == 3
    # the interpolation sees the overridden value
    assert cfg.out_dir == "runs/big"
    cfg = load_config(str(path), ["model.name=true", "tags=[]", "lr=1"])
    assert cfg.model.name is True and list(cfg.tags) == [] and cfg.lr == 1


def test_tilde_deletes_and_missing_delete_is_an_error(tmp_path):
    path = _write(tmp_path)
    cfg = load_config(str(path), ["~model.dropout", "~optimizer.inner"])
    assert "dropout" not in cfg.model and "inner" not in cfg.optimizer
    with pytest.raises(RecipeError, match=r"cannot delete 'model\.nope'"):
        load_config(str(path), ["~model.nope"])
    with pytest.raises(RecipeError, match=r"bad override 'lr'"):
        load_config(str(path), ["lr"])


def test_override_value_that_is_not_yaml_is_one_error(tmp_path):
    """A section override whose string holds brackets unquoted is a RecipeError naming the override, not a YAML
    traceback; quoted, it parses."""
    path = _write(tmp_path)
    with pytest.raises(RecipeError, match=r"^override 'data=\{split: train\[1:\]\}': the value is not valid "
                                          r"YAML \(expected ',' or '\}', but got '\['\); quote strings"):
        load_config(str(path), ["data={split: train[1:]}"])
    assert load_config(str(path), ['data={split: "train[1:]"}']).data.split == "train[1:]"


def test_a_hash_that_yaml_would_read_as_a_comment_is_refused_not_dropped(tmp_path):
    """`model.name=What does #include do?`: YAML reads ' #...' as a comment and kept 'What does' (a folder
    'runs #2/kd' became 'runs'); it is one line saying to quote the value, and a quoted or glued '#' is kept."""
    path = _write(tmp_path)
    with pytest.raises(RecipeError, match=r"^override 'model.name=What does #include do\?': ' #' starts a YAML "
                                          r"comment there, which would drop the rest of the value; quote it"):
        load_config(str(path), ["model.name=What does #include do?"])
    assert load_config(str(path), ['model.name="What does #include do?"']).model.name == "What does #include do?"
    assert load_config(str(path), ["model.name=C#"]).model.name == "C#"
    assert list(load_config(str(path), ['tags=["a #b", c]']).tags) == ["a #b", "c"]


def test_broken_interpolation_names_key_and_line(tmp_path):
    path = _write(tmp_path, CFG.replace("runs/${model.name}", "runs/${model.nme}"))
    with pytest.raises(RecipeError) as e:
        load_config(str(path))
    msg = str(e.value)
    assert "cfg.yaml:9" in msg and "key 'out_dir'" in msg and "${model.nme}" in msg
    with pytest.raises(RecipeError, match=r"override 'lr=\$\{nope\}': key 'lr'"):
        load_config(str(_write(tmp_path)), ["lr=${nope}"])


def test_unknown_key_names_key_line_and_what_the_recipe_reads(tmp_path):
    text = CFG.replace("  dim: 64\n", "  dim: 64\n  foo: 1\n")
    path = _write(tmp_path, text)
    cfg = load_config(str(path))
    with pytest.raises(RecipeError) as e:
        validate_config(cfg, SCHEMA, path, recipe="kd")
    msg = str(e.value)
    assert f"{path.name}:5: unknown key 'model.foo'" in msg
    assert "(recipe kd reads: model.name, model.dim, model.dropout)" in msg


def test_unknown_top_level_key_line(tmp_path):
    path = _write(tmp_path, CFG + "\nbatch_sise: 4\n")
    cfg = load_config(str(path))
    with pytest.raises(
        RecipeError, match=r"cfg\.yaml:17: unknown key 'batch_sise' \(this recipe reads: model, lr,"
    ):
        validate_config(cfg, SCHEMA, path)


def test_override_of_unknown_key_names_the_override(tmp_path):
    path = _write(tmp_path)
    cfg = load_config(str(path), ["model.bar=1"])
    with pytest.raises(RecipeError, match=r"^override 'model\.bar=1': unknown key 'model\.bar'"):
        validate_config(cfg, SCHEMA, path)


def test_types_are_checked_int_counts_as_float(tmp_path):
    path = _write(tmp_path)
    validate_config(load_config(str(path), ["lr=1"]), SCHEMA, path)  # int is a valid float
    with pytest.raises(RecipeError, match=r"cfg\.yaml:7: key 'steps' must be int, got str 'ten'"):
        validate_config(
            load_config(str(_write(tmp_path, CFG.replace("steps: 10", "steps: ten")))), SCHEMA, path
        )
    with pytest.raises(
        RecipeError, match=r"override 'model\.dim=true': key 'model\.dim' must be int, got bool"
    ):
        validate_config(load_config(str(path), ["model.dim=true"]), SCHEMA, path)
    with pytest.raises(RecipeError, match=r"key 'model\.dropout' must be float or null"):
        validate_config(load_config(str(path), ["model.dropout=high"]), SCHEMA, path)
    with pytest.raises(RecipeError, match=r"key 'model' must be a section"):
        validate_config(load_config(str(path), ["~out_dir", "model=3"]), SCHEMA, path)


def test_component_bad_argument_names_key_line_and_signature(tmp_path):
    path = _write(tmp_path, CFG.replace("    a: 1\n", "    a: 1\n    c: 5\n"))
    with pytest.raises(RecipeError) as e:
        validate_config(load_config(str(path)), SCHEMA, path)
    msg = str(e.value)
    assert "cfg.yaml:16: key 'optimizer.inner.c'" in msg
    assert "cli_components.Inner has no argument 'c' (it takes: a, b)" in msg


def test_component_missing_import_names_key_and_path(tmp_path):
    path = _write(tmp_path, CFG.replace("cli_components.Outer", "cli_componentz.Outer"))
    with pytest.raises(RecipeError) as e:
        validate_config(load_config(str(path)), SCHEMA, path)
    msg = str(e.value)
    assert "cfg.yaml:11" in msg and "optimizer._component_" in msg and "cli_componentz.Outer" in msg
    with pytest.raises(RecipeError, match=r"'cli_components' has no attribute 'Nope'"):
        validate_config(load_config(str(path), ["optimizer._component_=cli_components.Nope"]), SCHEMA, path)


def test_component_must_be_a_component_node(tmp_path):
    path = _write(tmp_path)
    with pytest.raises(RecipeError, match=r"key 'optimizer' must be a mapping with '_component_"):
        validate_config(load_config(str(path), ["optimizer=adam"]), SCHEMA, path)
    validate_config(load_config(str(path), ["optimizer=null"]), SCHEMA, path)  # null: recipe default
    with pytest.raises(RecipeError, match=r"key 'optimizer' has no '_component_': name the class to build"):
        validate_config(load_config(str(path), ["optimizer={}"]), SCHEMA, path)  # said "..., got a mapping"


def test_an_override_without_a_value_is_refused():
    """`max_steps=` was read as null by YAML: `recipe validate` said OK and the run trained whole epochs."""
    with pytest.raises(RecipeError) as e:
        load_config("full/smollm2", ["max_steps="])
    assert str(e.value) == ("override 'max_steps=': no value; write max_steps=null for null, max_steps='\"\"' for "
                            "an empty string, or ~max_steps for the recipe's default")


def test_instantiate_nested_components_with_kwargs(tmp_path):
    text = CFG + "  parts:\n    - _component_: cli_components.make_pair\n      x: 7\n"
    cfg = load_config(str(_write(tmp_path, text)))
    validate_config(cfg, SCHEMA, None)
    obj = instantiate(cfg.optimizer, scale=0.5)
    assert type(obj).__name__ == "Outer" and obj.scale == 0.5
    assert type(obj.inner).__name__ == "Inner" and (obj.inner.a, obj.inner.b) == (1, 2)
    assert obj.parts == [(7, 0)]


def test_instantiate_bind_failure_names_key(tmp_path):
    cfg = load_config(str(_write(tmp_path)), ["~optimizer.inner.a"])
    with pytest.raises(
        RecipeError, match=r"config key 'optimizer\.inner': cannot call cli_components\.Inner: .*'a'"
    ):
        instantiate(cfg.optimizer)
    with pytest.raises(RecipeError, match=r"config key 'optimizer\._component_': cannot import 'nope\.X'"):
        instantiate(load_config(str(_write(tmp_path)), ["optimizer._component_=nope.X"]).optimizer)


def test_yaml_syntax_error_has_file_line(tmp_path):
    path = _write(tmp_path, "a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(RecipeError) as e:
        load_config(str(path))
    # the parser notices the unclosed `[` of line 2 on line 3: both lines are named
    assert str(e.value).endswith("cfg.yaml:3: invalid YAML: expected ',' or ']', but got ':' "
                                 "(while parsing a flow sequence at line 2)")
    path = _write(tmp_path, "a: 1\na: 2\n", name="dup.yaml")
    with pytest.raises(RecipeError, match=r"dup\.yaml:2: invalid YAML"):
        load_config(str(path))


def test_missing_config_suggests_recipe_ls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"'kd/nope'.*recipe ls"):
        load_config("kd/nope")
    with pytest.raises(RecipeError, match=r"'missing\.yaml' not found.*recipe ls"):
        load_config("missing.yaml")


def test_shipped_names_resolve_in_configs_package(tmp_path, monkeypatch):
    import llm_recipe.components.config as config

    (tmp_path / "kd").mkdir()
    (tmp_path / "kd" / "demo.yaml").write_text("lr: 2\n")
    monkeypatch.setattr(config, "configs_dir", lambda: tmp_path)
    assert load_config("kd/demo").lr == 2
    assert config.shipped_configs() == {"kd": ["kd/demo"]}


def test_run_recipe_script_passes_overrides_and_reports_errors(tmp_path, capsys):
    path = _write(tmp_path)
    seen = {}

    def main(cfg):
        seen["cfg"] = cfg

    run_recipe_script(SCHEMA, main, ["--config", str(path), "lr=0.5", "~tags"], name="kd")
    assert seen["cfg"].lr == 0.5 and "tags" not in seen["cfg"]
    with pytest.raises(SystemExit) as e:
        run_recipe_script(SCHEMA, main, ["--config", str(path), "lrr=0.5"], name="kd")
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "recipe: error: override 'lrr=0.5': unknown key 'lrr' (recipe kd reads: model, lr, steps, tags, "
        "out_dir, optimizer, extra)"
    ]
    assert "Traceback" not in err


def test_load_config_registers_our_resolvers_itself(tmp_path):
    """`${embedded_data:...}` resolves in a fresh process whose only step is load_config: the resolvers are
    registered there (once), not when the module is imported (tests/test_import_effects.py)."""
    import subprocess
    import sys

    path = tmp_path / "c.yaml"
    path.write_text("data: ${embedded_data:x}\n")
    code = ("from omegaconf import OmegaConf\n"
            "from llm_recipe.components.config import load_config\n"
            "assert not OmegaConf.has_resolver('embedded_data')\n"
            f"a, b = load_config({str(path)!r}), load_config({str(path)!r})\n"
            "print(a.data == b.data and a.data.endswith('/x'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "True"


def test_optimizer_argument_values_are_checked_before_anything_loads():
    """Optimizer arguments were checked by name only: torchao AdamW8bit `block_size: 0` was a ZeroDivisionError
    traceback after setup, and `amsgrad: yes_please` was taken as true. An argument without a range of its own
    must have the kind of value its default has."""
    from llm_recipe.components.config import load_recipe_config
    from llm_recipe.recipes.full import CONFIG

    def refused(*overrides: str) -> str:
        with pytest.raises(RecipeError) as e:
            load_recipe_config("lora/smollm2", list(overrides), CONFIG, recipe="lora")
        return str(e.value)

    assert refused("optimizer._component_=torchao.optim.AdamW8bit", "optimizer.block_size=0") == (
        "override 'optimizer.block_size=0': key 'optimizer.block_size' must be an int >= 1, got 0")
    assert refused("optimizer.amsgrad=yes_please") == (
        "override 'optimizer.amsgrad=yes_please': key 'optimizer.amsgrad' must be bool or null, got str 'yes_please'")
    assert "key 'optimizer.maximize' must be bool" in refused("optimizer.maximize=1")
    cfg = load_recipe_config("lora/smollm2", ["optimizer.amsgrad=true", "optimizer.lr=1", "optimizer.fused=null"],
                             CONFIG, recipe="lora")
    assert cfg.optimizer["amsgrad"] is True and cfg.optimizer["lr"] == 1


def test_a_cross_key_check_names_the_file_line_of_its_key(tmp_path):
    """Checks across keys (a kd.beta the loss does not read, two ways of choosing the student's layers) said the
    keys but not where in the user's file they are, as the one-key checks do; an override is named as typed."""
    from llm_recipe.components.config import load_recipe_config
    from llm_recipe.recipes.kd import CONFIG as KD

    text = (Path(__file__).parents[1] / "configs" / "kd" / "smollm2_demo.yaml").read_text()
    assert "  beta: null" in text
    (tmp_path / "mine.yaml").write_text(text.replace("  beta: null", "  beta: 0.3", 1))
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("  beta: null"))
    with pytest.raises(RecipeError) as e:
        load_recipe_config(str(tmp_path / "mine.yaml"), [], KD, recipe="kd")
    assert str(e.value).startswith(f"{tmp_path / 'mine.yaml'}:{line}: kd.beta=0.3: kd.loss=forward_kl does not read it")
    with pytest.raises(RecipeError) as e:
        load_recipe_config("kd/smollm2_demo", ["kd.beta=0.3"], KD, recipe="kd")
    assert str(e.value).startswith("kd.beta=0.3: kd.loss=forward_kl does not read it")  # the override, as typed
