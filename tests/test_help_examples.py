"""Every example command in `recipe --help`, each verb's and each recipe's help, README.md and docs/*.md works as
printed: each `recipe ...` / `lm_eval ...` line is extracted and checked without training anything.

- `ls`, `cat`, `cp`, `validate`, `assets` and `lm_eval --tasks-path` really run (in a fresh folder each).
- `run` is checked as `recipe run` itself checks a distributed launch before starting it: torchrun options
  parse, the recipe loads, and the config with the overrides validates against the recipe's schema.
- `download`, `demo` and `lm_eval` evaluations parse with their real parsers; lm_eval's model must be registered
  (with its `--model_args` accepted by the model) and every task must exist.
- A command on a line that shows its `recipe: error: ...` (or says what it prints: "`recipe ...` says `...`") is
  documented as refused: it must exit non-zero with one `recipe: error:` line, as printed.
- An inline `recipe VERB` alone names the verb in prose: the verb must exist.
Files a user is expected to have written (`my_kd.yaml`, `path/to/my_recipe.py`) are stood in for by copies of
shipped ones. Inline spans holding `...`, `<verb>` or `ARGS` are patterns, not examples.
"""

from __future__ import annotations

import argparse
import inspect
import re
import shlex
import shutil
from pathlib import Path

import pytest

from llm_recipe.cli import main as cli_main
from llm_recipe.cli.launch import split_run_args
from llm_recipe.cli.lmeval import USAGE as LM_EVAL_USAGE
from llm_recipe.cli.recipes import discover_recipes, is_recipe_path, load_recipe, recipe_config, recipe_file
from llm_recipe.cli.script import recipe_argparser
from llm_recipe.components.config import (
    load_recipe_config,
    resolve_config_path,
    shipped_configs,
)

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STAND_IN_RECIPE = "kd"  # what a user's own recipe file is stood in for by
_COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:\S*/)?(recipe|lm_eval)\s")
_PLACEHOLDER = re.compile(r"\.\.\.|<\w|\b[A-Z]{2,}\b(?!=)")  # `recipe run ...`, `recipe <verb>`, `ARGS`
_REFUSAL = re.compile(r"recipe: error|` says `")  # the line shows the command's error
REFUSED = "refused: "  # prefix of an example documented as refused


def _help_sources() -> list[tuple[str, str]]:
    parser = cli_main.build_parser()
    out = [("recipe --help", parser.format_help())]
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, sub in verbs.choices.items():
        out.append((f"recipe {verb} --help", LM_EVAL_USAGE if verb == "lm_eval" else sub.format_help()))
    for name in discover_recipes():
        out.append((f"recipe run {name} --help", recipe_argparser(f"recipe run {name}").format_help()))
    return out


def _from_help(where: str, text: str) -> list[tuple[str, str]]:
    found, in_examples = [], False
    for line in text.splitlines():
        if re.match(r"^\s*examples?:", line):
            in_examples, rest = True, line.split(":", 1)[1].strip()
            if rest:
                found.append((where, rest))
        elif in_examples and not line.strip():
            in_examples = False
        elif in_examples:
            found.append((where, line.strip()))
    return found


def _from_markdown(path: Path) -> list[tuple[str, str]]:
    found, fenced, pending = [], False, ""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path.relative_to(ROOT)}:{n}"
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            text = pending + line.strip()
            if text.endswith("\\"):  # continued on the next line
                pending = text[:-1] + " "
                continue
            pending = ""
            if _COMMAND.match(text):
                found.append((where, text))
        elif not line.lstrip().startswith("#"):  # headings name verbs, they are not examples
            for span in re.findall(r"`([^`]+)`", line):
                if _COMMAND.match(span) and not _PLACEHOLDER.search(span):
                    found.append((where, REFUSED + span if _REFUSAL.search(line) else span))
    return found


def _examples() -> list[tuple[str, str]]:
    found = [ex for where, text in _help_sources() for ex in _from_help(where, text)]
    for path in MARKDOWN:
        found += _from_markdown(path)
    return found


EXAMPLES = _examples()


def _tokens(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and re.match(r"^[A-Z_]+=", words[0]):  # HF_TOKEN=... recipe download ...
        words.pop(0)
    words[0] = Path(words[0]).name  # .venv/bin/recipe -> recipe
    return words


def _stand_in_config(path: str, recipe: str) -> None:
    """A user's own config file: a copy of the first shipped config of `recipe`."""
    if Path(path).is_file():
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(resolve_config_path(shipped_configs()[recipe][0]), path)


def _stand_in_recipe(arg: str) -> str:
    """A user's own recipe file: a copy of a shipped recipe. Returns the shipped recipe's name."""
    if not Path(arg).is_file():
        Path(arg).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(recipe_file(STAND_IN_RECIPE)[1], arg)
    return STAND_IN_RECIPE


def _check_cli(args: list[str], capsys) -> None:
    code = cli_main.main(args)
    err = capsys.readouterr().err
    assert code == 0, err


def _check_run(args: list[str]) -> None:
    torchrun, recipe, script_args = split_run_args(args)
    shipped = _stand_in_recipe(recipe) if is_recipe_path(recipe) else recipe
    if not any(a == "--config" or a.startswith("--config=") for a in script_args):  # prose: "`recipe run x.py`"
        load_recipe(recipe)
        return
    ns = recipe_argparser(f"recipe run {recipe}").parse_intermixed_args(script_args)
    if ns.config.endswith((".yaml", ".yml")):
        _stand_in_config(ns.config, shipped)
    name, module = load_recipe(recipe)
    load_recipe_config(ns.config, ns.overrides, recipe_config(module), recipe=name)


def _check_lm_eval(args: list[str], stock: bool, capsys) -> None:
    from llm_recipe.cli import lmeval

    if args == ["--tasks-path"]:
        assert lmeval.main(args) == 0 and Path(capsys.readouterr().out.strip()).is_dir()
        return
    from lm_eval._cli import HarnessCLI
    from lm_eval.api.registry import get_model

    from llm_recipe.components.eval.run import offline_task_names

    if not args or "--help" in args or "-h" in args:
        with pytest.raises(SystemExit) as exit_:
            lmeval.main(args)
        assert exit_.value.code == 0 and "--model" in capsys.readouterr().out
        return
    if not stock:
        lmeval._register_model()
    cli = HarnessCLI()
    sub = cli._subparsers.choices
    argv = args if args and args[0] in sub else ["run", *args]
    ns = cli._parser.parse_args(argv)
    if ns.command != "run":
        return
    if stock:  # what a bare `lm_eval` knows
        from lm_eval.models import MODEL_MAPPING

        assert ns.model in MODEL_MAPPING, f"stock lm_eval has no model {ns.model!r}: use `recipe lm_eval`"
    model = get_model(ns.model)
    if ns.model_args:
        params = inspect.signature(model.__init__).parameters
        given = ns.model_args if isinstance(ns.model_args, dict) else dict(
            kv.split("=", 1) for kv in ",".join(ns.model_args).split(","))
        unknown = [k for k in given if k not in params]
        assert not unknown or "kwargs" in params, f"--model_args {unknown} not accepted by {ns.model}"
    tasks = [t for arg in ns.tasks for t in arg.split(",")] if isinstance(ns.tasks, list) else ns.tasks.split(",")
    ours = [t for t in tasks if t.startswith("recipe_")]
    assert set(ours) <= set(offline_task_names()), ours
    if stock and ours:  # stock lm_eval finds our pack only through --include_path
        assert ns.include_path, "stock lm_eval needs --include_path for recipe_* tasks"


def test_examples_were_found():
    wheres = {w.split(":")[0] for w, _ in EXAMPLES}
    assert {"recipe --help", "recipe run --help", "README.md", "docs/cli.md", "docs/eval.md"} <= wheres
    assert len(EXAMPLES) > 40


@pytest.mark.parametrize("where, command", EXAMPLES, ids=[f"{w}: {c[:60]}" for w, c in EXAMPLES])
def test_example_works_as_printed(where, command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if command.startswith(REFUSED):
        try:
            code = cli_main.main(_tokens(command[len(REFUSED):])[1:])
        except SystemExit as exit_:  # `run` exits from the recipe's own script runner
            code = exit_.code
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert code != 0 and len(lines) == 1 and lines[0].startswith("recipe: error: "), (code, lines)
        return
    words = _tokens(command)
    tool, args = words[0], words[1:]
    if tool == "lm_eval":
        _check_lm_eval(args, stock=True, capsys=capsys)
        return
    while args and args[0] == "--debug":
        args = args[1:]
    verb, rest = args[0], args[1:]
    if verb == "--version" and not rest:  # an option, not a verb: prints the version and exits 0
        with pytest.raises(SystemExit) as e:
            cli_main.main(["--version"])
        assert e.value.code == 0 and capsys.readouterr().out.startswith("llm-recipe ")
        return
    verbs = next(a for a in cli_main.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    if not rest and verb not in ("ls", "assets", "demo"):  # prose naming a verb
        assert verb in verbs, f"`recipe {verb}`: no such verb"
    elif verb in ("ls", "cat", "cp", "assets", "keys"):
        if verb == "keys" and is_recipe_path(rest[0]):
            _stand_in_recipe(rest[0])
        _check_cli(args, capsys)
    elif verb == "validate":
        ns = cli_main.build_parser().parse_known_args(args)[0]
        recipe = ns.recipe or ns.config.split("/")[0]
        shipped = _stand_in_recipe(recipe) if ns.recipe and is_recipe_path(ns.recipe) else recipe
        if ns.config.endswith((".yaml", ".yml")):
            _stand_in_config(ns.config, shipped)
        _check_cli(args, capsys)
    elif verb == "run":
        _check_run(rest)
    elif verb == "lm_eval":
        _check_lm_eval(rest, stock=False, capsys=capsys)
    elif verb in ("download", "demo"):
        ns = cli_main.build_parser().parse_args(args)
        if verb == "download":
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", ns.repo_id), ns.repo_id
    else:
        pytest.fail(f"{where}: unknown verb in `{command}`")
