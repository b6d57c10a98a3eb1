"""`recipe run [torchrun options] RECIPE ...`: torchrun's options apart from the recipe's, the launch, and one line
when workers fail (which rank first, and how)."""

from __future__ import annotations

import argparse
import os
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


def worker_threads(nproc_per_node: str | int) -> int:
    """CPU threads per worker: this process's cores shared by the workers of this machine. torchrun's own default
    is 1, which made the CPU side of a multi-GPU run crawl: building the 8B model and its NF4 base on the host
    took over 11 minutes per rank for QLoRA on two H200s (issue 23), and the first KD step came 2.4x later than
    on one GPU."""
    n = str(nproc_per_node)
    if n.isdigit():
        workers = int(n)
    else:  # "gpu" / "auto": one worker per GPU, else one
        import torch

        workers = torch.cuda.device_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


def launch_torchrun(ns: argparse.Namespace, file: Path, script_args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # Each worker is `python FILE ...` with this interpreter: it imports llm_recipe from the same install (wheel
    # or editable) as this process, and FILE's folder is importable as for any script.
    ns.training_script = str(file)
    ns.training_script_args = script_args
    # torchrun sets OMP_NUM_THREADS=1 when it is unset; a user's own value is kept (workers inherit it)
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(ns.nproc_per_node)))
    try:
        run(ns)
    except ChildFailedError as e:  # each failed rank already printed its own `recipe: error: ...` line (or traceback)
        raise RecipeError(_workers_failed_message(e.failures)) from e
    return 0
