"""The wheel a user installs: built from this checkout, installed into a fresh venv, used from another folder.

The venv is new and sees neither this checkout nor its editable install. Its dependencies (torch, torchtune,
lm-eval, ...) are the ones already installed for the tests, reached through a path-only `.pth` line (a path
line adds the folder to sys.path but runs none of the `.pth` hooks in it, so our editable finder stays off):
downloading them again would test PyPI, not our packaging. The wheel itself installs with `--no-deps
--no-index`, and the test checks that our code runs from the venv's copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llm_recipe.cli.recipes import ALIASES

ROOT = Path(__file__).resolve().parents[1]
PKG = "llm_recipe"

SHIPPED = {"cli": ("*.py",), "components": ("**/*.py", "**/*.yaml", "**/*.jsonl", "**/*.md"),
           "configs": ("*.py", "*/*.yaml"), "recipes": ("*.py",)}


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECIPE_RECIPES_DIR", "RECIPE_CONFIGS_DIR")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONNOUSERSITE="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of a copy of the checkout (a build in place would leave build/ behind to leak into the
    next wheel)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "outputs", "out", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    (whl,) = (tmp / "dist").glob("llm_recipe-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; returns its bin/ folder."""
    root = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root.parent)
    py = root / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=root).stdout.strip())
    # the site folders this test runs with (torch and every other dependency), not this checkout
    deps = [p for p in dict.fromkeys(sys.path) if Path(p).name in ("site-packages", "dist-packages")]
    (site / "_test_deps.pth").write_text("".join(f"{d}\n" for d in deps), encoding="utf-8")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
          "--ignore-installed", str(wheel)], cwd=root)
    return root / "bin"


def test_wheel_ships_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"{PKG}/{p.relative_to(ROOT).as_posix()}"
            for top, globs in SHIPPED.items() for g in globs for p in (ROOT / top).glob(g)
            if "__pycache__" not in p.parts}
    assert want and not want - names, sorted(want - names)
    assert not [n for n in names if n.split("/")[0] in ("cli", "components", "configs", "recipes")]
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "\nName: llm-recipe\n" in zipfile.ZipFile(wheel).read(meta).decode()  # ours, not PyPI's `recipe`
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert f"recipe = {PKG}.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_recipe_lists_validates_copies_and_runs(venv, tiny_model_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    recipe = str(venv / "recipe")
    where = _run([str(venv / "python"), "-c", f"import {PKG}.cli.main as m, {PKG}.configs as c; "
                  "print(m.__file__); print(c.__file__)"], cwd=elsewhere).stdout.split()
    assert all(Path(p).is_relative_to(venv.parent) for p in where), where  # the wheel's copy, not the checkout

    # pip knows it as llm-recipe, and the installed command reports that distribution's version
    shown = _run([sys.executable, "-m", "pip", "--python", str(venv / "python"), "show", "llm-recipe"], cwd=elsewhere)
    version = re.search(r"^Version: (\S+)", shown.stdout, re.MULTILINE).group(1)
    assert _run([recipe, "--version"], cwd=elsewhere).stdout.strip() == f"llm-recipe {version}"

    listing = _run([recipe, "ls"], cwd=elsewhere).stdout
    configs = sorted(f"{p.parent.name}/{p.stem}" for p in (ROOT / "configs").glob("*/*.yaml"))
    recipes = sorted([*(p.stem for p in (ROOT / "recipes").glob("[!_]*.py")), *ALIASES])  # lora: full.py
    rows = [line.split() for line in listing.splitlines()[1:]]
    assert sorted(r[0] for r in rows if len(r) == 2) == recipes
    assert sorted(r[-1] for r in rows) == configs

    # every shipped config validates through the installed entry point (one process: imports cost seconds)
    assert _run([recipe, "validate", configs[0]], cwd=elsewhere).stdout.startswith("OK: ")
    code = (f"import sys; from {PKG}.cli.main import main; "
            f"sys.exit(max(main(['validate', c]) for c in {configs[1:]!r}))")
    assert _run([str(venv / "python"), "-c", code], cwd=elsewhere).stdout.count("OK: ") == len(configs) - 1

    # a user's copy of a shipped recipe and config runs a short CPU job with the installed package
    _run([recipe, "cp", "kd", "my_kd.py"], cwd=elsewhere)
    _run([recipe, "cp", "kd/smollm2_demo", "my_kd.yaml"], cwd=elsewhere)
    assert f"from {PKG}.components" in (elsewhere / "my_kd.py").read_text()
    _run([recipe, "run", "my_kd.py", "--config", "my_kd.yaml", f"teacher.checkpoint_dir={tiny_model_dir}",
          "output_dir=out", "max_steps=2", "device=cpu", "dtype=fp32", "batch_size=2", "dataset.max_seq_len=32",
          "dataset.limit=8", "student.every=null", "student.prune=null", "save_every_n_steps=null", "lr_scheduler.warmup_steps=0"],
         cwd=elsewhere)
    steps = [json.loads(line) for line in (elsewhere / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2]
    assert (elsewhere / "out" / "model" / "config.json").is_file()


@pytest.mark.slow  # ~20 s on 2 cores; the stock lm_eval route from the same venv stays in the default suite
def test_installed_recipe_lm_eval_needs_no_other_step(venv, tiny_model_dir, tmp_path):
    tasks = _run([str(venv / "recipe"), "lm_eval", "--tasks-path"], cwd=tmp_path).stdout.strip()
    assert Path(tasks).is_relative_to(venv.parent) and Path(tasks, "recipe_copa.yaml").is_file()
    out = _run([str(venv / "recipe"), "lm_eval", "--model", "recipe", "--model_args",
                f"checkpoint={tiny_model_dir}", "--tasks", "recipe_copa", "--limit", "4", "--device", "cpu",
                "--batch_size", "4"], cwd=tmp_path).stdout
    assert "recipe_copa" in out and "acc" in out


def test_stock_lm_eval_reads_our_folder_with_our_task_pack(venv, tiny_model_dir, tmp_path):
    """docs/eval.md's route for a bare lm_eval: `--model hf` on our plain HF folder, our pack via --include_path
    (its `!function` data loaders import from the installed package)."""
    pytest.importorskip("transformers")
    tasks = _run([str(venv / "recipe"), "lm_eval", "--tasks-path"], cwd=tmp_path).stdout.strip()
    out = _run([str(venv / "python"), "-m", "lm_eval", "--model", "hf", "--model_args",
                f"pretrained={tiny_model_dir}", "--include_path", tasks, "--tasks", "recipe_copa", "--limit", "4",
                "--device", "cpu", "--batch_size", "4"], cwd=tmp_path).stdout
    assert "recipe_copa" in out and "acc" in out
