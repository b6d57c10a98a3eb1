"""Issue 24, item 5: install and defaults that surprised a first user: the distribution's name, `--version`, output
modes under the umask, the README's install steps, logger packages checked up front, the progress bar's loss,
Ctrl-C during setup, and kd_logits' estimate of what is left.

Each test names the docs/reliability.md row it pins (section "Input files, lm_eval and install")."""

from __future__ import annotations

import functools
import io
import os
import re
import stat
import subprocess
import sys

import pytest
import reliability_doc as doc

REPO = doc.REPO
SMALL = ["device=cpu", "dtype=fp32", "max_steps=1", "batch_size=2", "dataset.limit=8", "dataset.max_seq_len=32",
         "save_every_n_steps=null", "lr_scheduler.warmup_steps=0"]


def _pyproject_version() -> str:
    return re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)


# ----------------------------------------------------------------------------------------------- (a) the name


def test_the_distribution_is_llm_recipe_and_its_extras_name_it():
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^name = "llm-recipe"', text, re.MULTILINE)
    assert '"llm-recipe[executorch]"' in text  # the dev extra pulls our own executorch extra
    assert 'recipe = "llm_recipe.cli.main:main"' in text  # the command is still `recipe`


def test_install_hints_name_our_distribution(monkeypatch):
    """No hint, doc, test or Makefile line tells a user to install PyPI's unrelated `recipe`."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout (e.g. a copied tree): look at the usual places
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.suffix in (".py", ".md", ".toml", ".sh")
                 and ".venv" not in p.parts]
    stale = re.compile(r"(?<![\w-])recipe\[|(?<![\w_-])recipe-\d|(?<![\w_-])recipe-\*\.whl|pip install recipe\b")
    bad = [f"{f}:{n}" for f in files if (REPO / f).is_file() and f.endswith((".py", ".md", ".toml", ".sh", "Makefile"))
           for n, line in enumerate((REPO / f).read_text(errors="replace").splitlines(), 1)
           if stale.search(line) and "test_trust_install.py" not in f]
    assert not bad, bad
    # the one runtime hint: exporting a .pte without ExecuTorch
    from llm_recipe.components.errors import RecipeError
    from llm_recipe.components.quantization import export_pte

    monkeypatch.setitem(sys.modules, "executorch", None)
    monkeypatch.setitem(sys.modules, "executorch.exir", None)
    with pytest.raises(RecipeError) as e:
        export_pte.require_executorch()
    doc.expect("pte-extra", f"recipe: error: {e.value}")


# ----------------------------------------------------------------------------------------------- (d) --version


def test_version_prints_the_distribution_version(capsys):
    code, out, _ = doc.run_cli(["--version"], capsys)
    assert code == 0
    line = doc.expect("version", out)
    assert line == f"llm-recipe {_pyproject_version()}"


# ----------------------------------------------------------------------------------------------- (b) umask


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(old)


@pytest.mark.parametrize("mask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700),
                                                     (0o002, 0o664, 0o775)])
def test_outputs_honour_the_umask(mask, file_mode, dir_mode, umask, tmp_path, tiny_model_dir):
    from llm_recipe.components.checkpoint import atomic_directory, atomic_write_bytes
    from llm_recipe.components.metrics import MetricLogger
    from llm_recipe.components.models import load_model, save_model
    from llm_recipe.components.quantization.export_gguf import export_gguf

    assert doc.row("umask").id == "umask"
    umask(mask)
    atomic_write_bytes(tmp_path / "file.json", b"{}")
    with atomic_directory(tmp_path / "folder") as tmp:
        (tmp / "inside.txt").write_text("x")
    model, args = load_model(tiny_model_dir)
    save_model(model, args, tmp_path / "model", tokenizer_dir=tiny_model_dir)
    export_gguf(model, args, tiny_model_dir, tmp_path / "model.gguf", qtype="F32")
    with MetricLogger(tmp_path / "run", 1, progress=False) as log:
        log.log(1, loss=1.0)
    files = [tmp_path / "file.json", tmp_path / "folder" / "inside.txt", tmp_path / "model" / "model.safetensors",
             tmp_path / "model" / "config.json", tmp_path / "model.gguf", tmp_path / "run" / "metrics.jsonl",
             tmp_path / "run" / "loss.png"]
    folders = [tmp_path / "folder", tmp_path / "model"]
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files + folders}
    assert modes == {**{p.name: oct(file_mode) for p in files}, **{p.name: oct(dir_mode) for p in folders}}


# ----------------------------------------------------------------------------------------------- (c) README


def test_readme_install_activates_the_venv_and_picks_a_torch_build():
    readme = (REPO / "README.md").read_text()
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = install.split("```sh", 1)[1].split("```", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.split("#", 1)[0].strip()]
    assert lines[0] == "python3 -m venv .venv" and lines[1] == "source .venv/bin/activate"
    assert "pip install torch==2.13.0" in lines  # CUDA: the default wheel
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in lines
    assert lines.index("pip install -c .venv/constraints.txt .") > lines.index("pip install torch==2.13.0")
    assert "recipe --version" in lines and "llm-recipe" in install


# ----------------------------------------------------------------------------------------------- (f) loggers


@pytest.mark.parametrize("override,row", [("tensorboard=true", "tensorboard-missing"),
                                          ("wandb={project: x}", "wandb-missing"),
                                          ("wandb={project: x, api_key: abc}", "wandb-secret")])
def test_missing_logger_packages_are_refused_before_anything_loads(override, row, tmp_path, monkeypatch, capsys,
                                                                   tiny_model_dir):
    """Checked with the folders, before the recipe's main runs (it used to fail after 20 s of layer scoring); a
    secret in the wandb section, before run.json (which records the config's values) is written."""
    import importlib.util as iu

    from llm_recipe.cli.script import run_recipe_script
    from llm_recipe.recipes import full

    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    called = []
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        run_recipe_script(full.CONFIG, called.append, name="full",
                          argv=["--config", "full/smollm2", f"model.checkpoint_dir={tiny_model_dir}",
                                f"output_dir={tmp_path}/out", override, *SMALL])
    assert e.value.code == 1 and not called and not (tmp_path / "out").exists()
    line = doc.expect(row, capsys.readouterr().err)
    # `recipe validate` says the same line (it said OK)
    code, _, err = doc.run_cli(["validate", "full/smollm2", f"model.checkpoint_dir={tiny_model_dir}", override],
                               capsys)
    assert code == 1 and err.strip() == line.strip()


# ----------------------------------------------------------------------------------------------- (h) the bar


def test_progress_bar_shows_the_current_steps_loss(tmp_path, monkeypatch):
    from tqdm.std import tqdm

    from llm_recipe.components import metrics

    assert doc.row("progress-loss").id == "progress-loss"
    screen = io.StringIO()
    monkeypatch.setattr(metrics, "tqdm", functools.partial(tqdm, file=screen, mininterval=0, miniters=1))
    logger = metrics.MetricLogger(tmp_path, 3)
    drawn = []
    for step, loss in ((1, 5.0), (2, 4.0), (3, 3.0)):
        logger.log(step, loss=loss, lr=1e-4)
        drawn.append(screen.getvalue().split("\r")[-1])
    logger.close()
    for (step, loss), frame in zip(((1, 5.0), (2, 4.0), (3, 3.0)), drawn):
        assert f"{step}/3" in frame and f"loss={loss:.4f}" in frame, frame


# ----------------------------------------------------------------------------------------------- (i) Ctrl-C


def test_ctrl_c_during_setup_says_so_and_exits_130(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import llm_recipe.components.models.prune as prune

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(prune, "score_layers", interrupted)  # Ctrl-C while the layers are being scored
    monkeypatch.chdir(tmp_path)
    code, _, err = doc.run_cli(["run", "kd", "--config", "kd/smollm2_demo", f"teacher.checkpoint_dir={tiny_model_dir}",
                            "student.prune.keep=2", f"output_dir={tmp_path}/out", *SMALL], capsys)
    assert code == 130 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("recipe:")]
    assert len(lines) == 1, err
    doc.expect("ctrl-c-setup", lines[0])
    # only bookkeeping is there: the lock and run.json (the run's identity; it holds no output and a re-run may
    # reuse the folder without overwrite=true)
    assert not [p for p in (tmp_path / "out").rglob("*") if p.name not in (".recipe.lock", "run.json")]


# ----------------------------------------------------------------------------------------------- (e) kd_logits


def test_kd_logits_says_what_is_left_and_shows_an_eta(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.chdir(tmp_path)
    code, out, err = doc.run_cli(["run", "kd_logits", "--config", "kd_logits/smollm2_demo",
                              f"teacher.checkpoint_dir={tiny_model_dir}", f"output_dir={tmp_path}/cache",
                              "device=cpu", "dtype=fp32", "dataset.limit=6", "dataset.max_seq_len=32",
                              "cache.items_per_shard=4", "batch_size=2"], capsys)
    assert code == 0, err
    line = doc.expect("kd-logits-eta", out)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert line == (f"teacher: {manifest['tokens']:,} target tokens to go in {manifest['num_shards']} shard(s); "
                    "ETA on the bar below")
    assert manifest["mode"] == "sampled"  # the shipped default
    assert "teacher sample: 100%" in err and "tok/s" in err  # the bar, with a total: rate and ETA
