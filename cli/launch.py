"""`recipe run [torchrun options] RECIPE ...`: torchrun's options apart from the recipe's, the launch, and one line
when workers fail (which rank first, and how)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..components.errors import RecipeError


def split_run_args(argv: list[str]) -> tuple[argparse.Namespace | None, str, list[str]]:
    """`[torchrun options] RECIPE [recipe args]` -> (torchrun namespace or None, RECIPE, recipe args)."""
    if not argv[0].startswith("-"):
        return None, argv[0], argv[1:]
    # torchrun's own parser knows which of its options take a value; importing it costs a torch import,
    # paid only when torchrun options are present.
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "recipe run"
    ns = parser.parse_args(argv)
    for opt in ("module", "no_python", "run_path"):
        if getattr(ns, opt, False):
            raise RecipeError(f"torchrun option --{opt.replace('_', '-')} is not supported by `recipe run`")
    return ns, ns.training_script, list(ns.training_script_args)


def _workers_failed_message(failures: dict) -> str:
    """One line for torchrun's ChildFailedError: which ranks failed and how, apart from the ranks torchrun then
    stopped (SIGTERM), so a rank killed by a signal is not lost among the ranks stopped because of it."""
    import signal

    def how(code: int, plural: bool) -> str:
        if code >= 0:
            return f"exited with code {code}"
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends it when host memory runs out)" if name == "SIGKILL" else ""
        return f"{'were' if plural else 'was'} killed by {name}{hint}"

    stopped = sorted(r for r, f in failures.items() if f.exitcode == -signal.SIGTERM)
    causes = {r: f for r, f in failures.items() if r not in stopped} or failures
    by_code: dict[int, list[int]] = {}
    for r, f in sorted(causes.items()):
        by_code.setdefault(f.exitcode, []).append(r)
    first = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {how(code, len(rs) > 1)}"
                      for code, rs in by_code.items())
    rest = f"; torchrun then stopped rank(s) {', '.join(map(str, stopped))}" if len(causes) < len(failures) else ""
    resume = ("; a training run continues from its latest complete checkpoint with resume=true"
              if any(code < 0 for code in by_code) else "")
    above = ": see the errors above" if any(code >= 0 for code in by_code) else ""  # a killed rank prints nothing
    return f"{first}{rest}{above}{resume}"


def launch_torchrun(ns: argparse.Namespace, file: Path, script_args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # Each worker is `python FILE ...` with this interpreter: it imports llm_recipe from the same install (wheel
    # or editable) as this process, and FILE's folder is importable as for any script.
    ns.training_script = str(file)
    ns.training_script_args = script_args
    try:
        run(ns)
    except ChildFailedError as e:  # each failed rank already printed its own `recipe: error: ...` line (or traceback)
        raise RecipeError(_workers_failed_message(e.failures)) from e
    return 0
