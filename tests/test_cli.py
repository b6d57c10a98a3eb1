"""The `recipe` command through real subprocesses, against a fake shipped tree (recipes/ + configs/ folders
named by $RECIPE_RECIPES_DIR and $RECIPE_CONFIGS_DIR) so the expected listing is known exactly."""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from recipes_common import cli_captured

from llm_recipe.cli.recipes import ALIASES

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
RECIPE = FIXTURES / "cli_echo_recipe.py"
CONFIG = FIXTURES / "cli_echo.yaml"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A fake install: recipes `echo` (+ a half-written module and a private one), configs incl. an orphan."""
    pkgs = tmp_path / "pkgs"
    (pkgs / "recipes").mkdir(parents=True)
    (pkgs / "recipes" / "__init__.py").write_text("")
    shutil.copy(RECIPE, pkgs / "recipes" / "echo.py")
    (pkgs / "recipes" / "half.py").write_text("SCHEMA = {}\n")  # no main yet: not a recipe
    (pkgs / "recipes" / "_util.py").write_text("SCHEMA = {}\ndef main(cfg): ...\n")
    (pkgs / "recipes" / "broken.py").write_text("def main(:\n")  # mid-edit syntax error: skipped
    for sub in ("echo", "orphan"):
        (pkgs / "configs" / sub).mkdir(parents=True)
    (pkgs / "configs" / "__init__.py").write_text("")
    shutil.copy(CONFIG, pkgs / "configs" / "echo" / "basic.yaml")
    shutil.copy(CONFIG, pkgs / "configs" / "echo" / "another.yaml")
    (pkgs / "configs" / "orphan" / "x.yaml").write_text("a: 1\n")  # no recipe `orphan`: not listed
    work = tmp_path / "work"
    work.mkdir()
    return tmp_path


def recipe(tree: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["RECIPE_RECIPES_DIR"] = str(tree / "pkgs" / "recipes")
    env["RECIPE_CONFIGS_DIR"] = str(tree / "pkgs" / "configs")
    return subprocess.run(
        [sys.executable, "-m", "llm_recipe.cli.main", *args],
        cwd=cwd or tree / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The process failed with exit 1 and exactly one `recipe: error:` line, no traceback."""
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recipe: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_ls_lists_recipes_with_their_configs_only(tree):
    proc = recipe(tree, "ls")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "RECIPE    CONFIG",
        "echo      echo/another",
        "          echo/basic",
    ]


def test_browsing_commands_answer_without_importing_torch(tmp_path):
    """`recipe --help`, `--version`, `ls`, `cat` and `cp` on the shipped tree never import torch (its ~3 s of
    imports made each of them take seconds; they answer in a fraction of one)."""
    code = ("import contextlib, io, sys\n"
            "from llm_recipe.cli.main import main\n"
            "for argv in (['--help'], ['--version'], ['ls'], ['cat', 'kd/smollm2_demo'], ['cp', 'kd', 'x.py'],\n"
            "             ['cp', 'kd/smollm2_demo', 'x.yaml']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        assert not main(argv), argv\n"
            "    assert 'torch' not in sys.modules, argv\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr[-3000:]
    assert (tmp_path / "x.py").is_file() and (tmp_path / "x.yaml").is_file()


def test_ls_on_the_real_tree_lists_each_shipped_recipe():
    proc = subprocess.run(
        [sys.executable, "-m", "llm_recipe.cli.main", "ls"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0] for line in proc.stdout.splitlines()[1:] if line and not line.startswith(" ")}
    for name in listed - {"(no"}:
        assert (ROOT / "recipes" / f"{ALIASES.get(name, name)}.py").is_file()


def test_cp_appends_suffix_and_respects_no_clobber(tree):
    work = tree / "work"
    proc = recipe(tree, "cp", "echo/basic", "mine")
    assert proc.returncode == 0, proc.stderr
    assert (work / "mine.yaml").read_text() == CONFIG.read_text()
    (work / "mine.yaml").write_text("edited: true\n")
    err = one_error_line(recipe(tree, "cp", "echo/basic", "mine.yaml", "--no-clobber"))
    assert "'mine.yaml' already exists" in err and "--no-clobber" in err
    assert (work / "mine.yaml").read_text() == "edited: true\n"  # untouched
    assert recipe(tree, "cp", "echo/basic", "mine.yaml").returncode == 0  # default overwrites
    assert (work / "mine.yaml").read_text() == CONFIG.read_text()
    assert recipe(tree, "cp", "echo", "my_recipe").returncode == 0
    assert (work / "my_recipe.py").read_text() == RECIPE.read_text()
    (work / "dir").mkdir()
    assert recipe(tree, "cp", "echo/another", "dir").returncode == 0
    assert (work / "dir" / "another.yaml").is_file()


def test_cp_make_parents_and_unknown_names(tree):
    err = one_error_line(recipe(tree, "cp", "echo/basic", "a/b/c.yaml"))
    assert "'a/b' does not exist" in err and "--make-parents" in err
    assert recipe(tree, "cp", "echo/basic", "a/b/c.yaml", "--make-parents").returncode == 0
    assert (tree / "work" / "a" / "b" / "c.yaml").is_file()
    for name in ("echo/nope", "nope", "half", "orphan"):
        err = one_error_line(recipe(tree, "cp", name, "x.yaml"))
        assert f"unknown config or recipe '{name}'" in err and "recipe ls" in err
    # a trailing slash names a folder (it wrote ./newdir.yaml, over any file of that name)
    err = one_error_line(recipe(tree, "cp", "echo/basic", "newdir/"))
    assert "folder 'newdir' does not exist" in err and not (tree / "work" / "newdir.yaml").exists()
    assert recipe(tree, "cp", "echo/basic", "newdir/", "--make-parents").returncode == 0
    assert (tree / "work" / "newdir" / "basic.yaml").read_text() == CONFIG.read_text()


def test_cat_prints_the_yaml_with_comments(tree):
    proc = recipe(tree, "cat", "echo/basic")
    assert proc.returncode == 0 and proc.stdout == CONFIG.read_text()
    err = one_error_line(recipe(tree, "cat", "echo/nope"))
    assert "'echo/nope'" in err and "recipe ls" in err
    (tree / "work" / "latin1.yaml").write_bytes(b"name: caf\xe9\n")  # one line, as validate says (a traceback)
    err = one_error_line(recipe(tree, "cat", "latin1.yaml"))
    assert err.endswith("latin1.yaml:1: not valid UTF-8 (byte 0xe9 at column 10); save the file as UTF-8"), err


def test_validate_shipped_user_and_fixture_recipe(tree):
    proc = recipe(tree, "validate", "echo/basic")
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout.strip()
        == f"OK: {tree / 'pkgs' / 'configs' / 'echo' / 'basic.yaml'} is a valid echo config"
    )
    shutil.copy(CONFIG, tree / "work" / "mine.yaml")
    err = one_error_line(recipe(tree, "validate", "mine.yaml"))
    assert "cannot tell which recipe reads 'mine.yaml'" in err and "--recipe" in err
    proc = recipe(tree, "validate", "mine.yaml", "--recipe", str(RECIPE), "lr=2", "~tags")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK: mine.yaml is a valid cli_echo_recipe config"
    err = one_error_line(recipe(tree, "validate", "mine.yaml", "--recipe", "echo", "wrapper.widht=3"))
    assert err.startswith("recipe: error: override 'wrapper.widht=3': key 'wrapper.widht'")
    assert "textwrap.TextWrapper has no argument 'widht'" in err


def test_validate_takes_config_as_run_spells_it(tree):
    # `recipe run kd --config X` is what users type; `recipe validate --config X` must mean the same as the positional
    want = f"OK: {tree / 'pkgs' / 'configs' / 'echo' / 'basic.yaml'} is a valid echo config"
    for argv in (("--config", "echo/basic"), ("--config", "echo/basic", "lr=2"), ("lr=2", "--config", "echo/basic")):
        proc = recipe(tree, "validate", *argv)
        assert proc.returncode == 0 and proc.stdout.strip() == want, (argv, proc.stderr)
    err = one_error_line(recipe(tree, "validate", "--config", "echo/basic", "lr=two"))
    assert "lr" in err and "two" in err
    err = one_error_line(recipe(tree, "validate"))
    assert "name a config" in err


def test_validate_reports_file_line_of_unknown_key(tree):
    text = CONFIG.read_text().replace("  name: tiny\n", "  name: tiny\n  nmae: oops\n")
    (tree / "work" / "bad.yaml").write_text(text)
    err = one_error_line(recipe(tree, "validate", "bad.yaml", "--recipe", "echo"))
    assert err == (
        "recipe: error: bad.yaml:8: unknown key 'model.nmae' (recipe echo reads: model.name, model.dropout)"
    )
    proc = recipe(tree, "--debug", "validate", "bad.yaml", "--recipe", "echo")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "bad.yaml:8" in proc.stderr


@pytest.mark.parametrize("overrides", [
    ["student.keep_layers=[0,99]", "student.prune=null"],  # the embedded student has 30 layers: 0..29
    ["student.prune.keep=40"],
])
def test_validate_checks_student_layers_against_config_json_as_the_run_does(overrides, tmp_path, monkeypatch, capsys):
    """Where the model folder is here, `recipe validate` reads its config.json (no weights) and gives the line the
    run gives, naming the key and the override; where it is not, it says what it could not check."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_captured(capsys, ["validate", "kd/smollm2_demo", *overrides])
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"recipe: error: override '{overrides[0]}': key '{overrides[0].split('=')[0]}': ")
    assert "/config.json has 30" in err
    run_code, _, run_err = cli_captured(capsys, ["run", "kd", "--config", "kd/smollm2_demo",
                                                 f"output_dir={tmp_path}/out", "device=cpu", *overrides])
    assert run_code == 1 and run_err == err  # the run refuses it with the same line, before any setup
    code, out, err = cli_captured(capsys, ["validate", "kd/smollm2_demo",
                                           f"teacher.checkpoint_dir={tmp_path}/elsewhere", *overrides])
    assert code == 0, err
    assert out.strip().endswith(f"is a valid kd config (teacher.checkpoint_dir={tmp_path}/elsewhere: no config.json "
                                "here, so what needs it is checked by `recipe run`)")


@pytest.mark.parametrize("overrides,key", [
    (["teacher.checkpoint_dir=null"], "teacher.checkpoint_dir"),  # no teacher and no cache of one
    (["teacher.checkpoint_dir=null", "teacher.logits_dir=/nowhere"], "student.checkpoint_dir"),  # nothing to start from
])
def test_kd_without_a_teacher_or_a_student_folder_is_refused_at_load(overrides, key, tmp_path, monkeypatch, capsys):
    """`recipe validate` and `recipe run` give the line naming the key (the run went on to tokenize the data and
    then failed with a TypeError traceback when it loaded the teacher from None)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_captured(capsys, ["validate", "kd/smollm2_demo", *overrides])
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"key '{key}': null, and " in err and "Traceback" not in err
    run_code, _, run_err = cli_captured(capsys, ["run", "kd", "--config", "kd/smollm2_demo",
                                                 f"output_dir={tmp_path}/out", "device=cpu", *overrides])
    assert run_code == 1 and run_err == err and not (tmp_path / "out").exists()


def test_quantize_pte_with_a_scheme_that_cannot_lower_is_refused_at_load(tmp_path, monkeypatch, capsys):
    """formats [pte] with scheme int8_weight_only: one line at load (it loaded, measured perplexity twice and wrote
    hf/ before export_pte refused the weights, and report.json was never written)."""
    monkeypatch.chdir(tmp_path)
    argv = ["quantize/smollm2_8da4w", "scheme=int8_weight_only", "formats=[hf,pte]"]
    code, _, err = cli_captured(capsys, ["validate", *argv])
    assert code == 1 and err.strip() == ("recipe: error: override 'formats=[hf,pte]': key 'formats': pte needs scheme "
                                         "8da4w (the only one that lowers to XNNPACK here), but scheme is "
                                         "int8_weight_only; drop pte or set scheme: 8da4w")
    run_code, _, run_err = cli_captured(capsys, ["run", "quantize", "--config", *argv, f"output_dir={tmp_path}/out"])
    assert run_code == 1 and run_err == err and not (tmp_path / "out").exists()


def test_kd_logits_validate_loads_the_kd_config_it_names(tmp_path, monkeypatch, capsys):
    """kd_config names the kd config whose closing command the cache prints: a typo is said by `recipe validate`
    and by the run before its output folder is made (validate said OK, the run failed after locking the folder)."""
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_captured(capsys, ["validate", "kd_logits/smollm2_demo", "kd_config=kd/nope"])
    assert code == 1 and err.startswith("recipe: error: kd_config=kd/nope: unknown config 'kd/nope'"), err
    run_code, _, run_err = cli_captured(capsys, ["run", "kd_logits", "--config", "kd_logits/smollm2_demo",
                                                 "kd_config=kd/nope", f"output_dir={tmp_path}/out"])
    assert run_code == 1 and run_err == err and not (tmp_path / "out").exists()


def test_run_in_process_overrides_reach_main(tree):
    out = tree / "out.json"
    proc = recipe(
        tree,
        "run",
        "echo",
        "--config",
        "basic",
        f"output_file={out}",
        "lr=0.5",
        "tags=[x, 1]",
        "~model.dropout",
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    assert seen["lr"] == 0.5 and seen["tags"] == ["x", 1] and seen["model"] == {"name": "tiny"}
    assert seen["_wrapper_width"] == 40 and seen["_world_size"] is None  # in-process, not torchrun


def test_run_path_recipe_with_user_config(tree):
    shutil.copy(CONFIG, tree / "work" / "mine.yaml")
    proc = recipe(tree, "run", str(RECIPE), "--config", "mine.yaml", "steps=7", "wrapper.width=12")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((tree / "work" / "out.json").read_text())
    assert seen["steps"] == 7 and seen["_wrapper_width"] == 12


def _recipe_with_helpers(folder: Path) -> Path:
    """A copy of the echo recipe that imports a module beside it at its top and another one inside main, and
    defines a dataclass (string annotations: dataclasses look the recipe's module up while it loads)."""
    folder.mkdir(parents=True)
    (folder / "echo_helper.py").write_text("TOP = 'top'\n")
    (folder / "echo_lazy.py").write_text("LAZY = 'lazy'\n")
    text = RECIPE.read_text()
    text = text.replace('"""\n\nimport json\n', '"""\n\nfrom __future__ import annotations\n\nimport json\n'
                        "from dataclasses import dataclass\n\nimport echo_helper\n", 1)
    text = text.replace("SCHEMA = {", "@dataclass\nclass Seen:\n    top: str\n\n\nSCHEMA = {", 1)
    text = text.replace("    with open(cfg.output_file", "    from echo_lazy import LAZY\n\n"
                        "    data['_helpers'] = [Seen(echo_helper.TOP).top, LAZY]\n    with open(cfg.output_file", 1)
    path = folder / "my_echo.py"
    path.write_text(text)
    return path


def test_run_path_recipe_imports_modules_next_to_it(tree):
    """A user's recipe imports modules beside it as `python my_echo.py` would: in-process, under torchrun, and
    when validated."""
    work = tree / "work"
    path = _recipe_with_helpers(work / "mine")
    shutil.copy(CONFIG, work / "mine.yaml")
    assert recipe(tree, "validate", "mine.yaml", "--recipe", "mine/my_echo.py").returncode == 0
    for launch in ([], ["--nproc-per-node", "1", "--standalone"]):
        out = work / f"out{len(launch)}.json"
        proc = recipe(tree, "run", *launch, str(path.relative_to(work)), "--config", "mine.yaml", f"output_file={out}")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(out.read_text())["_helpers"] == ["top", "lazy"], launch


def test_load_recipe_leaves_sys_path_and_modules_as_they_were(tmp_path):
    """Shipped recipes are their own modules; a user's file leaves nothing of ours in sys.modules or sys.path
    (only the modules its own imports loaded)."""
    from llm_recipe.cli.recipes import load_recipe

    path = _recipe_with_helpers(tmp_path / "mine")
    modules, paths = set(sys.modules), list(sys.path)
    try:
        name, module = load_recipe(str(path))
        assert name == "my_echo" and callable(module.main) and "output_file" in module.SCHEMA  # a legacy SCHEMA
        assert sys.path == paths
        new = set(sys.modules) - modules  # its imports (echo_helper) and ours it pulled in, each under its own name
        assert "echo_helper" in new and not [k for k in new if k.startswith("_recipe") or "my_echo" in k]
        assert all(sys.modules[k].__name__ == k for k in new)
    finally:
        sys.modules.pop("echo_helper", None)
    name, module = load_recipe("eval")
    assert module is sys.modules["llm_recipe.recipes.eval"]


def test_run_errors_are_one_line(tree):
    err = one_error_line(recipe(tree, "run", "echo", "--config", "basic", "stepz=1"))
    assert "override 'stepz=1': unknown key 'stepz'" in err
    err = one_error_line(recipe(tree, "run", "echo", "--config", "basic", "steps=-1"))  # raised inside main
    assert err == "recipe: error: steps must be >= 0, got -1"
    err = one_error_line(recipe(tree, "run", "nope", "--config", "basic"))
    assert "unknown recipe 'nope'" in err and "echo" in err
    err = one_error_line(recipe(tree, "run", "echo"))
    assert "needs --config" in err
    (tree / "work" / "norecipe.py").write_text("x = 1\n")
    err = one_error_line(recipe(tree, "run", "norecipe.py", "--config", "basic"))
    assert "does not define CONFIG and main" in err
    proc = recipe(tree, "run", "--debug", "echo", "--config", "basic", "steps=-1")
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_run_with_torchrun_options_launches_workers(tree):
    out = tree / "dist.json"
    proc = recipe(
        tree,
        "run",
        "--nproc-per-node",
        "1",
        "--standalone",
        "echo",
        "--config",
        "echo/basic",
        f"output_file={out}",
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(out.read_text())
    assert seen["_world_size"] == "1" and seen["output_file"] == str(out)
    # a bad config fails once, before any worker starts
    err = one_error_line(
        recipe(tree, "run", "--nproc-per-node", "1", "--standalone", "echo", "--config", "basic", "x=1")
    )
    assert "unknown key 'x'" in err


def test_usage_errors_exit_2_and_help_has_examples(tree):
    assert recipe(tree, "bogus").returncode == 2
    assert recipe(tree, "cp", "echo/basic").returncode == 2
    assert recipe(tree, "download", "a/b").returncode == 2  # --output-dir is required
    proc = recipe(tree, "--help")
    assert proc.returncode == 0 and "recipe run kd --config" in proc.stdout
    for verb in ("ls", "cp", "cat", "validate", "run", "download", "assets"):
        proc = recipe(tree, verb, "--help")
        assert proc.returncode == 0 and "example" in proc.stdout, verb
    # a recipe's own help needs no config yet: it names the recipe's shipped configs and where its keys are
    for flag in ("--help", "-h"):
        proc = recipe(tree, "run", "echo", flag)
        assert proc.returncode == 0, proc.stderr
        assert "shipped configs: echo/another, echo/basic" in proc.stdout and "recipe keys echo" in proc.stdout


def _help_examples() -> list[list[str]]:
    """Every `recipe ...` example line of `recipe --help`, each verb's --help and a recipe script's --help."""
    from llm_recipe.cli.main import build_parser
    from llm_recipe.cli.script import recipe_argparser

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    texts = [parser.format_help(), *(p.format_help() for p in verbs.values()),
             recipe_argparser("recipe run kd").format_help().replace("example: --config", "recipe run kd --config")]
    lines = [ln.split("#")[0].strip() for t in texts for ln in t.splitlines()]
    return [shlex.split(ln)[1:] for ln in lines if ln.startswith("recipe ") and "[" not in ln]


def test_help_examples_name_configs_and_keys_that_exist(capsys, tmp_path, monkeypatch):
    """The examples in --help texts work: their shipped configs exist and their overrides are keys the recipe
    reads (each `run` example is validated, each `cp` runs in a scratch folder); examples on the user's own
    files (my_kd.yaml) are skipped."""
    from llm_recipe.cli.main import main

    monkeypatch.chdir(tmp_path)
    examples = _help_examples()
    assert len(examples) >= 10
    checked = 0
    for ex in examples:
        verb, rest = ex[0], ex[1:]
        if verb == "run":
            while rest[0].startswith("--"):  # torchrun options (--standalone takes no value)
                rest = rest[1:] if rest[0] == "--standalone" else rest[2:]
            recipe_name, config, overrides = rest[0], rest[2], rest[3:]
            argv = ["validate", config, "--recipe", recipe_name, *overrides]
        elif verb == "validate":
            argv = ex
        elif verb == "cat":
            argv = ex
        elif verb == "cp":
            argv = ex  # writes into the scratch folder
        else:
            continue
        if verb != "cp" and any(a.endswith((".yaml", ".py")) or "/" in a and a.startswith("path") for a in argv):
            continue  # the user's own file
        capsys.readouterr()
        assert main(argv) == 0, (ex, capsys.readouterr().err)
        checked += 1
    assert checked >= 6


def test_a_reader_that_leaves_early_gets_no_traceback():
    # `recipe keys kd | head -2`: the pipe's reader is gone before recipe writes; Python would print a
    # BrokenPipeError traceback (2 of 4 tries in a new user's walkthrough)
    r, w = os.pipe()
    os.close(r)  # the reader left before anything was written
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "keys", "kd"], stdout=w,
                          stderr=subprocess.PIPE, text=True)
    os.close(w)
    assert proc.returncode == 1 and proc.stderr == ""


def test_torchrun_workers_share_the_cores_instead_of_one_thread_each(monkeypatch):
    """torchrun gives each worker OMP_NUM_THREADS=1 when it is unset, which left the host side of a multi-GPU run
    (building an 8B model and its NF4 base) on one core per rank; `recipe run` shares the cores instead, and keeps
    a value the user set."""
    import argparse

    import torch.distributed.run

    from llm_recipe.cli import launch

    cores = len(os.sched_getaffinity(0))
    seen = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda ns: seen.append(os.environ["OMP_NUM_THREADS"]))
    for nproc, user, want in (("2", None, max(1, cores // 2)), ("1", None, cores), ("4", "3", 3)):
        if user is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", user)
        assert launch.launch_torchrun(argparse.Namespace(nproc_per_node=nproc), Path("x.py"), []) == 0
        assert seen[-1] == str(want)
    assert launch.worker_threads(10**6) == 1


@pytest.mark.parametrize("option", ["--limit", "--teacher-limit", "--steps"])
def test_demo_counts_below_one_are_refused_before_anything_runs(option, capsys):
    """`recipe demo --teacher-limit 0` ended ~40 s in with lm-eval's 'did not find any docs' traceback."""
    from llm_recipe.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["demo", option, "0"])
    assert e.value.code == 2 and f"argument {option}: must be at least 1, got 0" in capsys.readouterr().err
    assert getattr(build_parser().parse_args(["demo", option, "3"]), option[2:].replace("-", "_")) == 3


@pytest.mark.parametrize("user", [None, "SIGINT,SIGTERM", "SIGTERM, SIGHUP"])
def test_torchrun_keeps_its_other_signals_and_never_gets_an_empty_list(user, monkeypatch):
    """`recipe run` takes SIGINT / SIGTERM from torchrun (to pass them on to the workers); the rest of the user's
    `--signals-to-handle` stays torchrun's. A user's `SIGINT,SIGTERM` left torchrun an empty name, which it logged
    as a 'Failed to register signal handler' traceback at every launch."""
    import argparse
    import signal

    import torch.distributed.run

    from llm_recipe.cli import launch

    seen = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda ns: seen.append(
        (ns.signals_to_handle, os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"])))
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE", raising=False)
    ns = argparse.Namespace(nproc_per_node="1", signals_to_handle=user)
    assert launch.launch_torchrun(ns, Path("x.py"), []) == 0
    arg, env = seen[-1]
    names = [n.strip() for n in env.split(",")]
    assert arg == env and all(isinstance(getattr(signal, n, None), signal.Signals) for n in names)
    assert not {"SIGINT", "SIGTERM"} & set(names)
    want = {None: {"SIGHUP", "SIGQUIT"}, "SIGINT,SIGTERM": {"SIGUSR2"}, "SIGTERM, SIGHUP": {"SIGHUP"}}[user]
    assert set(names) == want
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ  # put back as it was


@pytest.mark.parametrize("n", ["0", "abc", "-2"])
def test_a_wrong_process_count_is_one_line(n, tmp_path, capsys):
    """`recipe run --nproc-per-node 0 ...` printed torchrun's bare AssertionError traceback (`abc`: a ValueError)."""
    code, _, err = cli_captured(capsys, ["run", "--nproc-per-node", n, "full", "--config", "full/smollm2",
                                         f"output_dir={tmp_path}/out"])
    assert code == 1 and err.strip() == (f"recipe: error: --nproc-per-node must be a whole number >= 1 or auto / gpu "
                                         f"/ cpu, got '{n}'") and not (tmp_path / "out").exists()


def test_a_device_the_host_lacks_is_one_line_before_torchrun_starts(tmp_path, capsys, monkeypatch):
    """device=cuda on a CPU host under torchrun: each rank said it after ~20 s of start-up, then torchrun's own
    failure lines. Now `recipe run` says it once, before any rank starts; also more ranks than GPUs."""
    import torch

    def run(*overrides: str) -> tuple[int, str]:
        code, _, err = cli_captured(capsys, ["run", "--nproc-per-node", "2", "--standalone", "full", "--config",
                                             "full/smollm2", f"output_dir={tmp_path}/out", *overrides])
        return code, err.strip()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run("device=cuda") == (1, "recipe: error: device='cuda' but CUDA is not available here: use device=cpu "
                                     "or auto")
    assert run("device=cpu", "dtype=fp16") == (1, "recipe: error: dtype=fp16 needs a CUDA GPU: use dtype=fp32 (or "
                                                  "bf16) on CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert run("device=cuda") == (1, "recipe: error: 2 processes on device='cuda', but only 1 GPU(s) are visible: "
                                     "one GPU per process (--nproc-per-node)")
    assert not (tmp_path / "out").exists()
    # eval spells its dtype as config.json does (float32, float16): the same check reads it (it refused float32)
    code, _, err = cli_captured(capsys, ["run", "--nproc-per-node", "2", "--standalone", "eval", "--config",
                                         "eval/smollm2", f"output_dir={tmp_path}/eval", "device=cpu", "dtype=float16"])
    assert (code, err.strip()) == (1, "recipe: error: dtype=float16 needs a CUDA GPU: use dtype=fp32 (or bf16) on CPU")


def test_a_missing_data_file_or_uncreatable_folder_is_one_line_before_torchrun_starts(tmp_path, capsys, monkeypatch):
    """Under torchrun each rank found these after ~20 s of start-up and printed them once per rank, between
    torchrun's lines; now `recipe run` says them once before launching anything."""
    from llm_recipe.cli import main as cli_main

    monkeypatch.setattr(cli_main, "launch_torchrun", lambda *a: pytest.fail("launched"))
    base = ["run", "--nproc-per-node", "2", "--standalone", "full", "--config", "full/smollm2", "device=cpu"]
    code, _, err = cli_captured(capsys, [*base, f"dataset.source={tmp_path}/gone.jsonl", f"output_dir={tmp_path}/o"])
    assert code == 1 and err.strip() == (f"recipe: error: override 'dataset.source={tmp_path}/gone.jsonl': key "
                                         f"'dataset.source': no such file or directory: {tmp_path}/gone.jsonl")
    assert not (tmp_path / "o").exists()
    import errno
    import pathlib

    blocked, mkdir = tmp_path / "sys" / "nope", pathlib.Path.mkdir  # as /sys/nope for root: the check passes,
    (tmp_path / "sys").mkdir()                                      # mkdir does not

    def no_mkdir(self, *a, **k):
        if self == blocked:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return mkdir(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", no_mkdir)
    code, _, err = cli_captured(capsys, [*base, f"output_dir={blocked}"])
    assert code == 1 and err.strip() == (f"recipe: error: override 'output_dir={blocked}': key 'output_dir': cannot "
                                         f"create {blocked}: Operation not permitted")


def test_a_wrong_torchrun_option_is_one_line(capsys):
    """A typo in a torchrun option printed torchrun's 20-line usage; now one line, with the option meant."""
    for argv, said in ((["--nproc-per-node", "2", "--standlone", "full"], "unrecognized arguments: --standlone (did "
                        "you mean --standalone?)"),
                       (["--nproc-per-node", "full", "--config", "full/smollm2"], "unrecognized arguments: --config "
                        "(the recipe's name was read as the value of the option before it: is that option's value "
                        "missing?)")):
        code, _, err = cli_captured(capsys, ["run", *argv])
        assert code == 2 and err == (f"recipe: error: torchrun options: {said}; they come before the recipe "
                                     "(`recipe run --help`)\n")


def test_demo_with_a_file_for_its_folder_is_refused_before_anything_runs(tmp_path, capsys):
    """`recipe demo --output-dir FILE` evaluated the teacher for ~17 s, then ended in a NotADirectoryError traceback."""
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    code, out, err = cli_captured(capsys, ["demo", "--output-dir", str(f), "--steps", "1", "--limit", "2"])
    assert code == 1 and err.strip() == f"recipe: error: --output-dir: {f} is a file, not a folder: choose another " \
        "output_dir" and "teacher" not in out and f.read_text() == "mine\n"


def test_a_required_component_set_to_null_is_refused_by_validate(capsys):
    """`optimizer: null` passed `recipe validate`; the run failed after the weights loaded ('NoneType' object is not
    iterable in optim.py)."""
    code, _, err = cli_captured(capsys, ["validate", "full/smollm2", "optimizer=null"])
    assert code == 1 and err.strip() == ("recipe: error: override 'optimizer=null': key 'optimizer' is required (a "
                                         "{_component_: dotted.path, ...} mapping): set it in the file or override "
                                         "optimizer=...")


@pytest.mark.parametrize("recipe, config", [("lora", "lora/smollm2"), ("qat", "qat/smollm2")])
def test_lora_or_qat_without_its_section_is_refused(recipe, config, tmp_path, capsys):
    """`recipe run lora ... lora=null` trained every weight at LoRA's learning rate, wrote no adapter and exited 0
    (`qat=null`: no fake quantization, no note)."""
    code, _, err = cli_captured(capsys, ["run", recipe, "--config", config, f"{recipe}=null",
                                         f"output_dir={tmp_path}/out"])
    assert code == 1 and err.strip() == (f"recipe: error: override '{recipe}=null': key '{recipe}' is null, but "
                                         f"`recipe run {recipe}` needs its section (without it the run is `recipe run "
                                         f"full`)") and not (tmp_path / "out").exists()
    assert cli_captured(capsys, ["validate", "full/smollm2", f"{recipe}=null"])[0] == 0


@pytest.mark.parametrize("prompt", ['""', '"  "'])
def test_generate_with_an_empty_prompt_is_refused(prompt, capsys):
    """`prompt=""` with chat=false ended in an embedding's dtype traceback; with chat=true it generated from nothing."""
    code, _, err = cli_captured(capsys, ["run", "generate", "--config", "generate/smollm2", f"prompt={prompt}"])
    got = repr(prompt.strip('"'))
    assert code == 1 and err.strip() == (f"recipe: error: override 'prompt={prompt}': key 'prompt' must be some text "
                                         f"(not empty), got {got}")


def test_an_option_where_an_override_belongs_gets_the_overrides_spelling(capsys):
    """`recipe run full --config X --max_steps 2` said only 'unrecognized arguments: --max_steps'."""
    from llm_recipe.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["run", "full", "--config", "full/smollm2", "--max_steps", "2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().endswith(
        "unrecognized arguments: --max_steps (overrides are key.path=value, e.g. max_steps=VALUE; `recipe keys` "
        "lists the keys)"), err


@pytest.mark.parametrize("config", ["full/smollm2", "kd/smollm2_demo"])
def test_a_sequence_longer_than_the_models_context_is_refused_by_validate(config, capsys):
    """`dataset.max_seq_len=100000000` (a few zeros too many) built a rotary table of 12+ GB and ended out of memory;
    1000000 trained past SmolLM2's 8192-token context without a word."""
    from llm_recipe.components.assets import embedded_model_dir

    code, _, err = cli_captured(capsys, ["validate", config, "dataset.max_seq_len=1000000"])
    assert code == 1 and err.strip() == (
        "recipe: error: override 'dataset.max_seq_len=1000000': key 'dataset.max_seq_len' is 1000000, longer than "
        f"the model's context in {embedded_model_dir()} (8192 tokens: config.json's max_position_embeddings)")
    assert cli_captured(capsys, ["validate", config, "dataset.max_seq_len=8192"])[0] == 0


@pytest.mark.parametrize("config, key", [("quantize/smollm2_8da4w", "group_size"), ("qat/smollm2", "qat.group_size")])
def test_a_group_size_that_does_not_divide_the_model_is_refused_by_validate(config, key, capsys):
    """`group_size=7` passed `recipe validate` and failed only after the weights loaded and a perplexity pass."""
    from llm_recipe.components.assets import embedded_model_dir

    code, _, err = cli_captured(capsys, ["validate", config, f"{key}=7"])
    assert code == 1 and err.strip() == (
        f"recipe: error: override '{key}=7': key '{key}': 7 does not divide the input width 576 of "
        f"{embedded_model_dir()}'s linear layers (config.json); choose a divisor of 576 (e.g. 32)")
