"""`recipe lm_eval ...`: lm-eval's own command line, with our model and offline task pack added for that run.

lm-eval 0.4.13 has no plugin mechanism: it reads no entry points and no environment variable for third-party
models or task folders (its model registry is filled from the hard-coded `lm_eval.models.MODEL_MAPPING`, and
`TaskManager` scans `lm_eval/tasks` plus an explicit `--include_path`). Making a bare `lm_eval --model recipe`
work would need code run at the start of every Python process of the environment (a `.pth` import hook) that
patches lm-eval, which a user never asked for. Instead this verb runs lm-eval's CLI in our process after two
documented, local steps: `model_registry.register("recipe", ...)` (lm-eval's API for adding a model) and our
task folder added to the run's `include_path`. Every lm-eval option and subcommand (`run`, `ls`, `validate`)
works as in `lm_eval`. Our checkpoints are plain Hugging Face folders, so stock `lm_eval --model hf` reads them
too (see docs/eval.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = """\
usage: recipe lm_eval [lm-eval arguments ...]
       recipe lm_eval --tasks-path

lm-eval's own command line (run, ls, validate; `run` is implied as in lm_eval), with `--model recipe` (our
checkpoints: float, LoRA-merged, QAT and torchao folders) and the offline `recipe_*` task pack available.
--tasks-path prints the task pack's folder, for stock lm_eval's --include_path.

examples:
  recipe lm_eval --model recipe --model_args checkpoint=outputs/kd_smollm2_demo/model --tasks recipe_arc_easy --limit 20
  recipe lm_eval ls tasks
  recipe lm_eval --tasks-path

lm-eval's options follow.
"""


def tasks_dir() -> Path:
    """The offline task pack's folder (`recipe_*.yaml`)."""
    from ..components.eval import TASKS_DIR

    return TASKS_DIR


def _register_model() -> None:
    """Add `recipe` (RecipeLM, imported when lm-eval first builds it) to lm-eval's model registry; idempotent.
    Called just before lm-eval's CLI runs in this process: importing our modules registers nothing."""
    import lm_eval.models  # noqa: F401  (the stock lazy entries first: get_model() skips them once non-empty)
    from lm_eval.api.registry import model_registry

    if "recipe" not in model_registry:
        model_registry.register("recipe", target="llm_recipe.components.eval.lm:RecipeLM")


def main(argv: list[str]) -> int:
    """Run lm-eval's CLI on `argv` (the arguments after `recipe lm_eval`)."""
    if argv == ["--tasks-path"]:
        print(tasks_dir())
        return 0
    from ..components.eval import quiet

    tasks = _task_names(argv)
    # before lm-eval imports datasets / huggingface_hub: they read the offline switches once, at import
    quiet.offline_if_hub_unreachable(tasks)
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE + "\n")
        argv = ["run", "--help"]
    _register_model()
    setup_logging()
    cli = HarnessCLI()
    # HarnessCLI.parse_args reads sys.argv (and inserts `run` when no subcommand is given, as `lm_eval` does).
    saved = sys.argv
    sys.argv = ["recipe lm_eval", *argv]
    try:
        args = cli.parse_args()
    finally:
        sys.argv = saved
    _check_run_args(args)
    model_args = getattr(args, "model_args", None)
    if getattr(args, "model", None) == "recipe" and isinstance(model_args, dict):
        # lm-eval passes --device and --batch_size to the model beside --model_args, so `device=cpu` there (the
        # habit of `--model hf`) was a TypeError for a duplicate argument: the --model_args value takes their place
        for key in ("device", "batch_size"):
            if key in model_args:
                setattr(args, key, model_args.pop(key))
        if model_args.get("checkpoint"):
            from ..components.quantization.load import check_checkpoint_dir

            check_checkpoint_dir(model_args["checkpoint"])  # a wrong folder fails now, before lm-eval builds tasks
    if hasattr(args, "device") and args.device is None:  # lm-eval would ask for cuda:0, warn and fall back on a CPU
        import torch

        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if hasattr(args, "include_path"):  # run, ls and validate: our pack first, then the user's folder if any
        args.include_path = [str(tasks_dir()), *([args.include_path] if args.include_path else [])]
    try:
        with quiet.no_git_noise():
            cli.execute(args)
    except (ValueError, OSError) as e:
        err = quiet.unknown_tasks_error(e) or quiet.hub_error(e, tasks)
        if err is None:
            raise
        raise err from e
    return 0


def _check_run_args(args: object) -> None:
    """What lm-eval's `run` would end in a traceback for, as one line: an unknown --model, a --limit <= 0."""
    from lm_eval.api.registry import model_registry

    from ..components.errors import RecipeError

    model = getattr(args, "model", None)
    if model is not None and model not in model_registry:
        import difflib

        near = difflib.get_close_matches(model, list(model_registry), n=1)
        hint = f" (did you mean {near[0]}?)" if near else "; ours is 'recipe', lm-eval's own include hf"
        raise RecipeError(f"--model: unknown model {model!r}{hint}")
    limit = getattr(args, "limit", None)
    if limit is not None and float(limit) <= 0:
        raise RecipeError(f"--limit must be > 0 (a count, or a fraction below 1), got {limit}")


def _task_names(argv: list[str]) -> list[str]:
    """The names given to --tasks (`--tasks a,b`, `--tasks a b`, `--tasks=a,b`), as lm-eval will read them."""
    names: list[str] = []
    for i, a in enumerate(argv):
        if a.startswith("--tasks="):
            names += a.split("=", 1)[1].split(",")
        elif a in ("--tasks", "-t"):
            for b in argv[i + 1 :]:
                if b.startswith("-"):
                    break
                names += b.split(",")
    return [n.strip() for n in names if n.strip()]
