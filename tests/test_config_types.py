"""One home per parameter: every recipe's CONFIG type declares each key once (type, default, spec, doc), every
shipped config parses into it with no key the type does not have, and the defaults other code still spells out
agree with the types'."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from llm_recipe.cli.recipes import discover_recipes, load_recipe
from llm_recipe.components.config import config_source, load_config, typed_config, validate_config
from llm_recipe.components.data.dataset import DatasetConfig
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.settings import config_fields, describe_config, is_config_type, schema_of

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(ROOT.glob("configs/*/*.yaml"))


def _types(cls, seen=None):
    """`cls` and every section type below it."""
    seen = seen if seen is not None else []
    if cls not in seen:
        seen.append(cls)
        for f in config_fields(cls):
            if "section" in f.metadata:
                _types(f.metadata["section"], seen)
    return seen


@pytest.mark.parametrize("name", list(discover_recipes()))
def test_every_field_has_a_spec_and_a_doc(name):
    _, module = load_recipe(name)
    assert is_config_type(module.CONFIG), f"{name}: CONFIG must be a config dataclass"
    for cls in _types(module.CONFIG):
        for f in dataclasses.fields(cls):
            assert f in config_fields(cls), f"{cls.__name__}.{f.name}: declare it with setting() or section()"
            doc = f.metadata["doc"]
            assert isinstance(doc, str) and doc.strip() and "\n" not in doc, f"{cls.__name__}.{f.name}: one-line doc"
            if "spec" in f.metadata:
                assert f.metadata["spec"] is not None, f"{cls.__name__}.{f.name}: no spec"
    rows = list(describe_config(module.CONFIG))
    assert len({r[0] for r in rows}) == len(rows) and all(all(r) for r in rows)


def _yaml_keys(node, prefix=""):
    for k, v in (node or {}).items():
        yield f"{prefix}{k}"
        if isinstance(v, dict) and "_component_" not in v:
            yield from _yaml_keys(v, f"{prefix}{k}.")


def _field_keys(cls, prefix=""):
    for f in config_fields(cls):
        yield f"{prefix}{f.name}"
        if "section" in f.metadata:
            yield from _field_keys(f.metadata["section"], f"{prefix}{f.name}.")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_config_parses_and_has_no_dead_keys(path, monkeypatch, tmp_path):
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path))
    name, module = load_recipe(path.parent.name)
    cfg_path = tmp_path / path.name
    cfg_path.write_text(path.read_text().replace("${embedded_model:}", str(tmp_path / "model")))
    cfg = load_config(str(cfg_path))
    validate_config(cfg, schema_of(module.CONFIG), str(cfg_path), recipe=name)
    typed = typed_config(cfg, module.CONFIG)
    assert isinstance(typed, module.CONFIG) and config_source(typed).file == cfg_path.resolve()
    fields = set(_field_keys(module.CONFIG))
    dead = [k for k in _yaml_keys(yaml.safe_load(path.read_text())) if k not in fields]
    assert not dead, f"{path}: keys no field reads: {dead}"


def test_sections_built_in_code_check_their_fields_against_their_specs():
    # one home per range: a section built by library code is checked against the same specs as a config file
    from llm_recipe.components.models import LoRASettings
    from llm_recipe.components.models.prune import PruneSettings

    with pytest.raises(RecipeError, match=r"^lora.rank: must be an int >= 1, got 0$"):
        LoRASettings(rank=0)
    with pytest.raises(RecipeError, match=r"^lora.targets: item 1 must be one of q_proj, .*, got 'qkv'$"):
        LoRASettings(targets=("q_proj", "qkv"))
    with pytest.raises(RecipeError, match=r"^student.prune.keep: must be an int >= 1, got 0$"):
        PruneSettings(keep=0)
    with pytest.raises(RecipeError, match=r"^dataset.max_seq_len: must be an int >= 2, got 1$"):
        DatasetConfig(source="x", max_seq_len=1)
    with pytest.raises(RecipeError, match=r"^dataset.limit: must be an int >= 1 \(or null\), got 0$"):
        DatasetConfig(source="x", limit=0)
    assert DatasetConfig(source="x", limit=None, data_files=("a", "b")).limit is None


def test_folders_starting_with_a_tilde_are_the_home_folders_the_run_checks(tmp_path, monkeypatch):
    """`output_dir=~/x` (bash leaves the `~` after `=` alone; YAML always does): the recipe reads and writes the
    folder `recipe run` checked and locked, $HOME/x (it wrote into ./~/x beside a lock in $HOME/x)."""
    from llm_recipe.recipes.kd import KDConfig

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "kd.yaml"
    path.write_text("output_dir: ~/runs/kd\noptimizer: {_component_: torch.optim.AdamW, lr: 1.0e-4}\n"
                    "teacher: {checkpoint_dir: ~/models/teacher}\ndataset:\n  source: transfer:passages\n")
    cfg = typed_config(load_config(str(path), ["student.checkpoint_dir=~/models/student"]), KDConfig)
    home = tmp_path / "home"
    assert (cfg.output_dir, cfg.teacher.checkpoint_dir, cfg.student.checkpoint_dir) == (
        f"{home}/runs/kd", f"{home}/models/teacher", f"{home}/models/student")


def test_parse_fills_defaults_and_names_a_missing_required_key(tmp_path):
    from llm_recipe.recipes.kd import KDConfig

    path = tmp_path / "kd.yaml"
    path.write_text("output_dir: out\noptimizer: {_component_: torch.optim.AdamW, lr: 1.0e-4}\n"
                    "teacher: {checkpoint_dir: t}\ndataset:\n  source: transfer:passages\n")
    cfg = typed_config(load_config(str(path)), KDConfig)
    assert cfg.kd.kd_ratio == 0.5 and cfg.kd.on_policy is None and cfg.lora is None and cfg.student.prune is None
    assert cfg.gradient_accumulation_steps == 1 and cfg.lr_scheduler.name == "cosine" and cfg.dataset.max_seq_len == 2048
    on = typed_config(load_config(str(path), ["kd.on_policy.fraction=1", "dataset.max_seq_len=128"]), KDConfig)
    assert on.kd.on_policy.fraction == 1 and on.kd.on_policy.max_new_tokens == 64
    # a section that leaves fraction out takes the study's best share (docs/kd_study.md: 0.02 kept the chat gain of
    # 0.05 and 0.1 and lost no LAMBADA)
    on = typed_config(load_config(str(path), ["kd.on_policy.max_new_tokens=32", "dataset.max_seq_len=128"]), KDConfig)
    assert on.kd.on_policy.fraction == 0.02 and on.kd.on_policy.max_new_tokens == 32
    # a required key an override deleted: the error names that override, not the file's line that sets the key
    with pytest.raises(RecipeError, match=r"override '~dataset.source': key 'dataset.source' is required \(str\)"):
        typed_config(load_config(str(path), ["~dataset.source"]), KDConfig)
    made_a_mapping = load_config(str(path), ["batch_size=2", "batch_size.x=1"])  # an override below a plain key
    with pytest.raises(RecipeError, match=r"override 'batch_size.x=1': key 'batch_size' must be an int"):
        validate_config(made_a_mapping, schema_of(KDConfig))
    with pytest.raises(RecipeError, match=r"kd.on_policy needs a live teacher"):  # cross-key checks run at load
        typed_config(load_config(str(path), ["kd.on_policy.fraction=1", "teacher.logits_dir=c"]), KDConfig)
