"""The `recipe` command: list, copy, print, validate and run recipes and their configs; download models.

Every user error prints one line `recipe: error: ...` and exits 1 (`--debug` adds the traceback);
usage errors exit 2 (argparse). Heavy imports (torch, huggingface_hub) happen inside the verbs that need them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import traceback
from pathlib import Path

from ..components.config import (
    config_source,
    configs_dir,
    load_recipe_config,
    recipe_schema,
    resolve_config_path,
    shipped_configs,
)
from ..components.errors import RecipeError, read_utf8
from ..components.folders import check_loggers, create_output_dirs, prepared_run, remove_if_empty
from ..components.output_kinds import check_output_kind
from .launch import launch_torchrun, split_run_args
from .parser import build_parser
from .recipes import discover_recipes, load_recipe, recipe_config, recipe_file, recipe_folder_importable
from .script import configure_logging, print_error, recipe_argparser, run_recipe_script

# ----------------------------------------------------------------------------------------------- verbs


def cmd_ls(args: argparse.Namespace) -> int:
    recipes = discover_recipes()
    configs = shipped_configs()
    rows = [("RECIPE", "CONFIG")]
    for name in recipes:
        names = configs.get(name, [])
        rows.append((name, names[0] if names else "-"))
        rows.extend(("", n) for n in names[1:])
    width = max(len(r[0]) for r in rows) + 4
    for r, c in rows:
        print(f"{r:<{width}}{c}".rstrip())
    if not recipes:
        print("(no recipes installed)")
    return 0


def _cp_source(name: str) -> tuple[Path, str]:
    if "/" in name and not name.endswith(".py"):
        stem = name[:-5] if name.endswith(".yaml") else name
        path = configs_dir() / f"{stem}.yaml"
        if path.is_file():
            return path, ".yaml"
    elif not name.endswith((".py", ".yaml", ".yml")) and name in discover_recipes():
        return recipe_file(name)[1], ".py"
    raise RecipeError(f"unknown config or recipe '{name}' (run `recipe ls` to see the names)")


def cmd_cp(args: argparse.Namespace) -> int:
    src, suffix = _cp_source(args.name)
    dest = Path(args.dest).expanduser()
    if dest.is_dir() or args.dest.endswith(("/", os.sep)):  # a trailing slash names a folder, existing or not
        dest = dest / src.name
    elif suffix == ".yaml" and dest.suffix not in (".yaml", ".yml"):
        dest = dest.with_name(dest.name + ".yaml")
    elif suffix == ".py" and dest.suffix != ".py":
        dest = dest.with_name(dest.name + ".py")
    if dest.exists() and args.no_clobber:
        raise RecipeError(f"'{dest}' already exists: choose another destination or drop --no-clobber")
    if not dest.parent.is_dir():
        if not args.make_parents:
            raise RecipeError(f"folder '{dest.parent}' does not exist: create it or pass --make-parents")
        dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copyfile(src, dest)
    except OSError as e:
        raise RecipeError(f"cannot write '{dest}': {e.strerror}") from e
    print(f"Copied {args.name} to {dest}")
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    path = resolve_config_path(args.config)
    sys.stdout.write(read_utf8(path))  # a file that is not UTF-8: one line naming it, as validate says
    return 0


def _infer_recipe(config: str) -> str:
    path = resolve_config_path(config).resolve()
    root = configs_dir().resolve()
    if path.parent.parent == root:
        return path.parent.name
    known = ", ".join(discover_recipes()) or "none installed"
    raise RecipeError(
        f"cannot tell which recipe reads '{config}': pass --recipe NAME or --recipe path/to/recipe.py "
        f"(recipes: {known})"
    )


def cmd_validate(args: argparse.Namespace) -> int:
    if args.config_option is not None:  # `--config NAME`: a positional word is then the first override
        if args.config is not None:
            args.overrides = [args.config, *args.overrides]
        args.config = args.config_option
    if args.config is None:
        raise RecipeError("recipe validate: name a config (recipe validate kd/smollm2_demo, or --config NAME)")
    recipe = args.recipe or _infer_recipe(args.config)
    name, module = load_recipe(recipe)
    # The recipe's checks run at load; those that read a model folder's config.json (no weights: e.g. the KD
    # student's layer indices) run where the folder is here, and say so where it is not.
    cfg = load_recipe_config(args.config, args.overrides, recipe_config(module), recipe=name)
    check_loggers(cfg, recipe_schema(recipe_config(module)))  # tensorboard / wandb, as `recipe run` checks them
    if hasattr(cfg, "check_inputs"):  # a recipe's checks of its model folders' files (kd: the same tokenizer)
        cfg.check_inputs()
    absent = _absent_model_folders(cfg, recipe_schema(recipe_config(module)))
    note = f" ({', '.join(absent)}: no config.json here, so what needs it is checked by `recipe run`)" if absent else ""
    print(f"OK: {config_source(cfg).display} is a valid {name} config{note}")
    return 0


def _absent_model_folders(cfg: object, schema: dict) -> list[str]:
    """`key=path` of each model folder the config names that has no config.json on this machine."""
    from dataclasses import asdict, is_dataclass

    from ..components.schema import ModelDir, walk_specs

    values = asdict(cfg) if is_dataclass(cfg) else cfg
    return [f"{key}={value}" for key, _, value in walk_specs(values, dict(schema), (ModelDir,))
            if value is not None and not (Path(str(value)).expanduser() / "config.json").is_file()]


def cmd_keys(args: argparse.Namespace) -> int:
    from ..components.settings import describe_config, is_config_type

    name, module = load_recipe(args.recipe)
    if not is_config_type(recipe_config(module)):
        raise RecipeError(f"recipe '{name}' declares a SCHEMA dict, not a CONFIG type: its keys have no docs")
    for key, allowed, default, doc in describe_config(recipe_config(module)):
        print(f"{key}: {allowed}; default {default}\n    {doc}")
    return 0


def cmd_run(run_argv: list[str], debug: bool, parser: argparse.ArgumentParser) -> int:
    while run_argv and run_argv[0] == "--debug":
        debug, run_argv = True, run_argv[1:]
    if not run_argv or run_argv[0] in ("-h", "--help"):
        parser.parse_args(["run", "--help"])  # prints help and exits 0
    torchrun_ns, recipe, script_args = split_run_args(run_argv)
    if debug and "--debug" not in script_args:
        script_args.append("--debug")
    asks_help = any(a in ("-h", "--help") for a in script_args)  # the parser prints the verb's help, no config needed
    if not asks_help and "--config" not in script_args and not any(a.startswith("--config=") for a in script_args):
        raise RecipeError(
            f"`recipe run {recipe}` needs --config CONFIG (see `recipe ls` for shipped configs)"
        )
    name, module = load_recipe(recipe)
    if torchrun_ns is None:
        with recipe_folder_importable(recipe):  # a user's recipe may import modules next to it while it runs
            run_recipe_script(recipe_config(module), module.main, argv=script_args, name=name)
        return 0
    ns = recipe_argparser(f"recipe run {name}").parse_intermixed_args(script_args)
    cfg = load_recipe_config(ns.config, ns.overrides, recipe_config(module), recipe=name)
    made = check_before_launch(name, cfg, recipe_schema(recipe_config(module)), torchrun_ns)
    file = recipe_file(recipe)[1]
    if file.stem != name:  # an alias (lora runs full.py): workers would look a bare config name up as the file's
        script_args = [*script_args, "--config", str(config_source(cfg).file)]
    try:
        return launch_torchrun(torchrun_ns, file, script_args)
    finally:
        remove_if_empty(made)  # the ranks refused before writing anything: no empty folder left


def check_before_launch(name: str, cfg: object, schema: dict, torchrun_ns: argparse.Namespace) -> list[Path]:
    """What every rank would check at its start, checked once here before torchrun starts them, so a bad config,
    device, data file or output folder is one line now, not one per rank after their start-up: the output folder's
    kind, the device and dtype for this many ranks per node, the data files, the folders and, for training, the
    run the folder holds (new or resumed with the same values); then the output folders are created (returned:
    those it made)."""
    check_output_kind(name, getattr(cfg, "output_dir", None))
    if isinstance(getattr(cfg, "device", None), str):
        from ..components.runtime import check_device

        n = str(torchrun_ns.nproc_per_node)
        check_device(cfg.device, getattr(cfg, "dtype", "fp32"), int(n) if n.isdigit() else 1)
    from ..components.data.sources import check_config_data_files

    check_config_data_files(cfg, config_source(cfg).where)
    with prepared_run(cfg, schema, lock=False):  # rank 0 takes the output folder's lock
        if "resume" in schema and getattr(cfg, "output_dir", None) is not None:  # training: one run per folder
            from ..components.checkpoint.state import latest_checkpoint
            from ..components.runs import (
                check_new_run,
                check_resume_config,
                read_run,
                recover_killed_overwrite,
            )
            from ..components.train_state import check_process_count, check_run_length, saved_process_count

            recover_killed_overwrite(cfg.output_dir)  # once, before any rank looks at the folder
            check_new_run(cfg)
            run = read_run(cfg.output_dir) if cfg.resume else None
            ckpt = latest_checkpoint(cfg.output_dir) if cfg.resume else None
            if run is not None and ckpt is not None:  # no checkpoint: the ranks say so
                check_resume_config(cfg, run, at=None)
            if ckpt is not None:
                check_run_length(cfg, ckpt)
            low, _, high = str(torchrun_ns.nnodes).partition(":")  # torchrun's N or MIN:MAX (default 1:1)
            nodes, per_node = (low if high in ("", low) else ""), str(torchrun_ns.nproc_per_node)
            saved = saved_process_count(ckpt) if ckpt is not None else None
            if saved is not None and nodes.isdigit() and per_node.isdigit():  # another count: before any rank loads
                check_process_count(ckpt, {"loader": {"world_size": saved}}, int(nodes) * int(per_node))
        if int(getattr(torchrun_ns, "node_rank", 0) or 0) == 0:  # the node whose rank 0 writes there
            return create_output_dirs(cfg, schema)
    return []


def cmd_download(args: argparse.Namespace) -> int:
    from ..components.hub import download

    path = download(
        args.repo_id,
        args.output_dir,
        ignore_patterns=args.ignore_patterns,
        token=args.hf_token,
        revision=args.revision,
    )
    print(path)
    return 0


def cmd_assets(args: argparse.Namespace) -> int:
    try:
        from ..components.assets import ensure_assets
    except ModuleNotFoundError as e:
        if e.name == "llm_recipe.components.assets":
            raise RecipeError("llm_recipe.components.assets is missing from this install: reinstall llm-recipe") from e
        raise
    path = ensure_assets()
    print(path)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(args.output_dir, limit=args.limit, teacher_limit=args.teacher_limit, steps=args.steps)
    return 0


VERBS = {
    "ls": cmd_ls,
    "cp": cmd_cp,
    "cat": cmd_cat,
    "validate": cmd_validate,
    "keys": cmd_keys,
    "download": cmd_download,
    "assets": cmd_assets,
    "demo": cmd_demo,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `recipe` script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    debug = False
    # `run` passes everything after the verb through untouched (torchrun options, --config, overrides),
    # which argparse's REMAINDER cannot do when the first token looks like an option.
    lead = 0
    while lead < len(argv) and argv[lead] == "--debug":
        lead += 1
    configure_logging("--debug" in argv)
    try:
        if lead < len(argv) and argv[lead] == "run":
            debug = lead > 0 or "--debug" in argv
            return cmd_run(argv[lead + 1 :], lead > 0, parser)
        if lead < len(argv) and argv[lead] == "lm_eval":
            # everything after the verb is lm-eval's (its own --help, options and subcommands)
            from .lmeval import main as lm_eval_main

            debug = lead > 0
            return lm_eval_main(argv[lead + 1 :])
        args, extra = parser.parse_known_args(argv)
        debug = bool(getattr(args, "debug", False))
        if args.verb == "validate":
            bad = [a for a in extra if a.startswith("-")]
            if bad:
                parser.error(f"unrecognized arguments: {' '.join(bad)}")
            args.overrides = [*args.overrides, *extra]
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if args.verb is None:
            parser.print_help(sys.stderr)
            return 2
        return VERBS[args.verb](args)
    except RecipeError as e:
        print_error(e, debug or lead > 0)
        return 1
    except (RuntimeError, MemoryError) as e:  # `recipe demo` runs a recipe in this process: the same line
        from ..components.oom import is_out_of_memory, out_of_memory_message

        if not is_out_of_memory(e):
            raise
        if debug or lead > 0:
            traceback.print_exception(e)
        print_error(RecipeError(out_of_memory_message(e)), False)
        return 1
    except KeyboardInterrupt:
        print("recipe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `recipe keys kd | head`: the reader left early; no traceback (Python's docs' recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail again
        return 1


if __name__ == "__main__":
    sys.exit(main())
