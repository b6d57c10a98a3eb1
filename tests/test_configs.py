"""Every shipped config validates against its recipe, and every key and section carries a comment for the user."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from llm_recipe.cli.recipes import load_recipe
from llm_recipe.components.config import load_config, typed_config, validate_config
from llm_recipe.components.settings import schema_of

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/*/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_config_validates(path, monkeypatch, tmp_path):
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path))  # validation must not need the converted model...
    recipe, module = load_recipe(path.parent.name)
    text = path.read_text()
    # ...so resolve the embedded-model interpolation to a placeholder folder for this check.
    cfg_path = tmp_path / path.name
    cfg_path.write_text(text.replace("${embedded_model:}", str(tmp_path / "model")))
    cfg = load_config(str(cfg_path))
    validate_config(cfg, schema_of(module.CONFIG), str(cfg_path), recipe=recipe)
    typed_config(cfg, module.CONFIG)  # parses, defaults filled in, cross-key checks pass


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_leaf_key_is_commented(path):
    lines = path.read_text().splitlines()
    assert lines[0].startswith("#"), f"{path}: start with a comment saying what the config does and how to run it"
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z_][\w]*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = m.groups()
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        is_section = rest.strip() == "" and nxt.startswith(indent + " ")
        if not is_section and key != "_component_":
            assert "#" in rest, f"{path}:{i + 1}: key '{key}' has no comment"
        if is_section:  # a section header says what the section is (`dataset:   # training rows: ...`)
            assert "#" in rest, f"{path}:{i + 1}: section '{key}' has no comment"


def test_validate_cli_reports_unknown_key_with_line(tmp_path):
    cfg = tmp_path / "bad.yaml"
    text = (Path(__file__).resolve().parents[1] / "configs/eval/smollm2.yaml").read_text()
    cfg.write_text(text + "enable_activation_offloading: true  # torchtune silently ignored this\n")
    line = len(text.splitlines()) + 1
    r = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "validate", str(cfg), "--recipe", "eval"],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert f"bad.yaml:{line}: unknown key 'enable_activation_offloading'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("limit,ok", [("0.5", True), ("50", True), ("2.5", False)])
def test_eval_limit_is_a_fraction_below_one_and_a_whole_count_above(limit, ok):
    # lm-eval reads limit >= 1 as an item count and truncates 2.5 to 2 without a word: refuse it at load
    r = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "validate", "eval/smollm2", f"limit={limit}"],
                       capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines()[-1] == ("recipe: error: limit: 2.5 is not a whole number of items per "
                                                      "task (below 1 it is a fraction of each task)")


@pytest.mark.parametrize("override", ["dataset.shuffle=true", "dataset.bucket=false"])
def test_kd_logits_refuses_the_dataset_keys_it_does_not_read(override):
    # shuffle/bucket only order a training run's batches: a cache build reads neither, so it refuses them
    r = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "validate", "kd_logits/smollm2_demo", override],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    key = override.split("=")[0]
    assert r.stderr.strip().splitlines() == [
        f"recipe: error: override '{override}': unknown key '{key}' (recipe kd_logits reads: dataset.source, "
        "dataset.format, dataset.split, dataset.name, dataset.data_files, dataset.column_map, dataset.max_seq_len, "
        "dataset.train_on_input, dataset.use_chat_template, dataset.packed, dataset.limit)"]
