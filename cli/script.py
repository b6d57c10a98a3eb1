"""A recipe file's command line: `python recipe.py --config X [key=value ...] [~key] [--debug]`, which is also
what `recipe run NAME` does in-process and what torchrun starts on every rank.

Every shipped recipe ends with `if __name__ == "__main__": run_recipe_script(CONFIG, main)`. The config itself
(loading, overrides, validation with file:line errors, the typed config) is components/config.py's; this module
holds what only a command line does: argparse, logging set-up, and turning errors into one line and an exit
status.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ..components.config import load_recipe_config, recipe_schema, shipped_configs
from ..components.errors import RecipeError
from ..components.folders import prepared_run
from ..components.interrupt import (
    exit_status,
    interrupted_message,
    reset,
    take_forwarded_signals,
    to_launcher,
)
from ..components.oom import is_out_of_memory, out_of_memory_message
from ..components.output_kinds import check_output_kind

__all__ = ["configure_logging", "print_error", "recipe_argparser", "run_recipe_script"]


def print_error(err: BaseException, debug: bool) -> None:
    """Print `recipe: error: <one line>` on stderr, preceded by the traceback when debugging."""
    if debug:
        traceback.print_exception(err)
    msg = " ".join(str(err).split("\n"))
    if debug or not to_launcher(f"recipe: error: {msg}"):  # a rank of `recipe run`: its launcher prints it once
        print(f"recipe: error: {msg}", file=sys.stderr)


class _RecipeArgParser(argparse.ArgumentParser):
    """An option where an override belongs (`--max_steps 2`) gets the override's spelling in its error."""

    def error(self, message: str) -> NoReturn:
        options = re.findall(r"(?<![\w-])--([A-Za-z][\w.-]*)", message.partition("unrecognized arguments:")[2])
        if options:
            key = options[0].replace("-", "_")
            message += f" (overrides are key.path=value, e.g. {key}=VALUE; `recipe keys` lists the keys)"
        super().error(message)


def recipe_argparser(prog: str) -> argparse.ArgumentParser:
    """The `--config X [overrides] [--debug]` parser shared by recipe scripts and `recipe run`."""
    name = prog.rsplit(" ", 1)[-1]
    shipped = shipped_configs().get(name, [])
    # a CPU example runs on the embedded model where the recipe ships a config for it (not an 8B fp8 teacher)
    shipped = sorted(shipped, key=lambda c: "smollm2" not in c)
    example = f"{prog} --config {shipped[0]} device=cpu" if shipped else f"{prog} --config my_config.yaml device=cpu"
    p = _RecipeArgParser(
        prog=prog,
        description="Run a recipe with a config and key.path=value / ~key.path overrides (typed like YAML; "
        "~ deletes a key so the recipe's default applies).",
        epilog=f"example:\n  {example}\n\n" + (f"shipped configs: {', '.join(sorted(shipped))}\n" if shipped else "")
        + f"every key, its range and default: recipe keys {name}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="shipped config name (kd/smollm2_demo) or path to a .yaml")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.add_argument("overrides", nargs="*", help="key.path=value sets a key, ~key.path deletes it")
    return p


def configure_logging(debug: bool = False) -> None:
    """Our notes (`recipe.*`, `components.*`) at INFO on stderr; silence import-time noise users cannot act on
    (torchao's optional CUDA extensions on CPU builds, torch's pytree deprecation notes)."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # "recipe": the recipes' own loggers; the other is our package's top level (its loggers are named by module)
    for name in ("recipe", __name__.split(".")[0]):
        logging.getLogger(name).setLevel(logging.DEBUG if debug else logging.INFO)
    if not debug:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)


def run_recipe_script(
    config: Any,
    main: Callable[[Any], None],
    argv: list[str] | None = None,
    name: str | None = None,
) -> None:
    """Parse `--config X [key=value ...] [~key] [--debug]`, load + validate, call `main(cfg)` with the typed config
    (`config`: the recipe's CONFIG dataclass; a legacy SCHEMA dict gives `main` the validated DictConfig).

    The folders the config names are checked and the output folder locked first (folders.prepared_run).
    A RecipeError prints one line `recipe: error: ...` on stderr and exits 1 (traceback only with --debug), as
    does running out of memory (`recipe: error: out of memory ...`: llm_recipe.components.oom); Ctrl-C prints `recipe: interrupted...` and exits 130.
    """
    if name is None:
        module = getattr(main, "__module__", "") or ""
        name = Path(sys.argv[0]).stem if module == "__main__" else module.rsplit(".", 1)[-1]
    args = recipe_argparser(f"recipe run {name}").parse_intermixed_args(argv)
    configure_logging(args.debug)
    reset()
    take_forwarded_signals()  # a worker of `recipe run`: its launcher passes Ctrl-C / SIGTERM on as SIGUSR1 / 2
    cfg = None
    try:
        cfg = load_recipe_config(args.config, args.overrides, config, recipe=name)
        check_output_kind(name, getattr(cfg, "output_dir", None))  # never into another recipe's outputs
        with prepared_run(cfg, recipe_schema(config)):
            try:
                main(cfg)
            except BaseException:  # stopped during setup: the run overwrite=true was replacing stays as it was
                from ..components.runs import put_back_overwritten  # (imports torch: not at `recipe --help`)

                if put_back_overwritten(getattr(cfg, "output_dir", None)):
                    print(f"recipe: overwrite=true: the earlier run in {cfg.output_dir} was put back as it was",
                          file=sys.stderr)
                raise
    except RecipeError as e:
        print_error(e, args.debug)
        raise SystemExit(1) from None
    except (RuntimeError, MemoryError) as e:  # out of memory: where, and what to change (components/oom.py)
        if not is_out_of_memory(e):
            raise
        if args.debug:
            traceback.print_exception(e)
        print_error(RecipeError(out_of_memory_message(e, cfg)), False)
        raise SystemExit(1) from None
    except KeyboardInterrupt as e:  # Ctrl-C; training stops at a step boundary with a checkpoint (see interrupt)
        if args.debug:
            traceback.print_exception(e)
        if getattr(e, "main", True):  # under torchrun rank 0 says where the ranks stopped
            from tqdm import tqdm  # on a line of its own, not after a progress bar the Ctrl-C cut mid-line

            line = f"recipe: {interrupted_message(e)}"
            if args.debug or not to_launcher(line):
                tqdm.write(line, file=sys.stderr)
        raise SystemExit(exit_status(e)) from None
