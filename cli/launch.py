"""`recipe run [torchrun options] RECIPE ...`: torchrun's options apart from the recipe's, the launch, one line
when workers fail (which rank first, and how), and Ctrl-C / SIGTERM passed on to the workers."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from ..components.errors import RecipeError
from ..components.interrupt import FORWARDED, FORWARDED_ENV, REPORT_PREFIX, STOPPED_FILE


def split_run_args(argv: list[str]) -> tuple[argparse.Namespace | None, str, list[str]]:
    """`[torchrun options] RECIPE [recipe args]` -> (torchrun namespace or None, RECIPE, recipe args)."""
    if not argv[0].startswith("-"):
        return None, argv[0], argv[1:]
    # torchrun's own parser knows which of its options take a value; importing it costs a torch import,
    # paid only when torchrun options are present.
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "recipe run"
    parser.error = functools.partial(_torchrun_usage_error, parser)  # one line, not torchrun's 20-line usage
    ns = parser.parse_args(argv)
    for opt in ("module", "no_python", "run_path"):
        if getattr(ns, opt, False):
            raise RecipeError(f"torchrun option --{opt.replace('_', '-')} is not supported by `recipe run`")
    n = str(ns.nproc_per_node)
    if not (n.isdigit() and int(n) >= 1 or n in ("auto", "cpu", "gpu", "xpu")):  # torchrun: an assert or ValueError
        raise RecipeError(f"--nproc-per-node must be a whole number >= 1 or auto / gpu / cpu, got {n!r}")
    if n == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise RecipeError("--nproc-per-node gpu: no CUDA GPU is visible here (use a number, or cpu)")
    return ns, ns.training_script, list(ns.training_script_args)


def _torchrun_usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A wrong torchrun option: one `recipe: error:` line (with the nearest option for a typo), exit 2 as argparse."""
    import difflib

    hint = ""
    unknown = re.findall(r"(?<!\S)(--?[\w-]+)", message.partition("unrecognized arguments:")[2])
    if unknown and unknown[0] in ("--config", "--debug"):  # the recipe's own: the recipe name went to an option
        hint = " (the recipe's name was read as the value of the option before it: is that option's value missing?)"
    elif unknown:
        options = [o for a in parser._actions for o in a.option_strings]
        close = difflib.get_close_matches(unknown[0], options, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
    print(f"recipe: error: torchrun options: {message}{hint}; they come before the recipe (`recipe run --help`)",
          file=sys.stderr)
    raise SystemExit(2)


def _stopped_ranks(failures: dict) -> list[int]:
    """The ranks torchrun stopped (SIGTERM) because another one failed."""
    return sorted(r for r, f in failures.items() if f.exitcode == -signal.SIGTERM)


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

    stopped = _stopped_ranks(failures)
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


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun starts each worker directly, in a session of its own)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return found


class ForwardStop:
    """Ctrl-C or SIGTERM to `recipe run` under torchrun reaches the workers (as SIGUSR1 / SIGUSR2: their own SIGTERM
    stays torchrun's) as it reaches a one-process run: each finishes the step the ranks agree on, writes its part of
    the checkpoint and leaves its status in this process's folder, which then exits 128 + the signal
    (components/interrupt.py). torchrun's own handler would stop the workers with SIGTERM at once, no checkpoint,
    and a SignalException traceback; and the workers, each in a session of its own, never see the terminal's
    Ctrl-C. A second signal is passed on too, and stops them now. Without workers (before they start, after they
    end) it stops the launch."""

    _SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self, ns: argparse.Namespace) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._env: str | None = None
        self._ns = ns
        self._folder = ""
        self._user_value: str | None = None

    def __enter__(self) -> ForwardStop:
        # torchrun registers a handler for each signal its --signals-to-handle names (through this variable, when
        # the workers start), over ours: the others (SIGHUP, SIGQUIT) stay its own
        self._env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
        names = getattr(self._ns, "signals_to_handle", None) or self._env or "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        rest = ",".join(n for n in names.split(",") if n.strip() not in self._SIGNALS)
        # a list of only SIGINT / SIGTERM leaves none: torchrun would log a traceback for the empty name, so it
        # gets SIGUSR2, which nothing sends to the launcher (unhandled, it would kill it and orphan the workers)
        rest = rest or "SIGUSR2"
        self._ns.signals_to_handle = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = rest
        self._previous = {s: signal.signal(s, self._forward) for s in (signal.SIGINT, signal.SIGTERM)}
        # the workers: a checkpointed stop exits 0 and leaves its status in this folder, for this process to exit with
        self._user_value = os.environ.get(FORWARDED_ENV)
        self._folder = os.environ[FORWARDED_ENV] = tempfile.mkdtemp(prefix="recipe-run-")
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        if self._user_value is None:
            os.environ.pop(FORWARDED_ENV, None)
        else:
            os.environ[FORWARDED_ENV] = self._user_value
        shutil.rmtree(self._folder, ignore_errors=True)
        if self._env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = self._env

    def _forward(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum
        workers = _children(os.getpid())
        if not workers:  # still launching (or all gone): stop here, as torchrun would
            raise KeyboardInterrupt
        as_signal = next(f for f, meant in FORWARDED.items() if meant == signum)  # their SIGTERM stays torchrun's
        for pid in workers:
            try:
                os.kill(pid, as_signal)
            except ProcessLookupError:
                pass

    def exit_status(self) -> int:
        return 128 + int(self.received or signal.SIGINT)

    def stopped_status(self) -> int | None:
        """The exit status the workers of this node left when they stopped at a checkpoint (None: they did not)."""
        try:
            return int(Path(self._folder, STOPPED_FILE).read_text())
        except (OSError, ValueError):
            return None

    def print_reports(self) -> set[int]:
        """Print the last lines the ranks of this node left (`to_launcher`), each distinct line once, in rank order;
        returns the ranks that left one."""
        lines: dict[str, None] = {}
        ranks: set[int] = set()
        for f in sorted(Path(self._folder).glob(f"{REPORT_PREFIX}*")):
            try:
                text = f.read_text()
                ranks.add(int(f.name[len(REPORT_PREFIX):]))
            except (OSError, ValueError):
                continue
            lines.update(dict.fromkeys(ln for ln in text.splitlines() if ln.strip()))
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return ranks

    def startup_only(self, failures: dict) -> bool:
        """Every worker was stopped by the forwarded signal before its handlers were in place (imports)."""
        early = {-int(s) for s in FORWARDED} | {-int(signal.SIGINT)}
        return all(f.exitcode in early for f in failures.values())

    def name(self) -> str:
        return "Ctrl-C" if self.received in (None, signal.SIGINT) else signal.Signals(self.received).name


def launch_torchrun(ns: argparse.Namespace, file: Path, script_args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # Each worker is `python FILE ...` with this interpreter: it imports llm_recipe from the same install (wheel
    # or editable) as this process, and FILE's folder is importable as for any script.
    ns.training_script = str(file)
    ns.training_script_args = script_args
    # torchrun sets OMP_NUM_THREADS=1 when it is unset; a user's own value is kept (workers inherit it)
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(ns.nproc_per_node)))
    # torchrun logs a line for each worker it stops and each that failed (its exit code, pid and a pointer to
    # torch's error docs), beside the ranks' own lines and ours below that says the same: kept with --debug only
    worker_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = worker_log.level
    if "--debug" not in script_args:
        worker_log.setLevel(logging.CRITICAL)
    with ForwardStop(ns) as stop:
        try:
            run(ns)
        except ChildFailedError as e:
            # a rank killed or stopped mid-step leaves its progress bar's line open (torchrun's own log line used to
            # end it): our lines start on a line of their own
            print(file=sys.stderr, flush=True)
            said = stop.print_reports()  # the ranks' own lines, each once
            # a rank killed by a signal says nothing: then the summary names it
            explained = all(r in said for r in e.failures if r not in _stopped_ranks(e.failures))
            if stop.received is None:
                if said and explained:  # every rank that failed said why
                    return 1
                raise RecipeError(_workers_failed_message(e.failures)) from e
            if stop.startup_only(e.failures):
                print(f"recipe: interrupted ({stop.name()}) while the workers started: no step ran", file=sys.stderr)
            elif not (said and explained):
                print(f"recipe: interrupted ({stop.name()}): {_workers_failed_message(e.failures)}", file=sys.stderr)
            return stop.exit_status()
        except KeyboardInterrupt:
            print(f"recipe: interrupted ({stop.name()}) with no worker running", file=sys.stderr)
            return stop.exit_status()
        finally:
            worker_log.setLevel(level)
        # the workers ended well: finished, or stopped at a checkpoint (rank 0 said which step)
        stop.print_reports()
        stopped = stop.stopped_status()
    if stopped is not None:
        if stop.received is None:  # asked on another node (or a worker was signalled): rank 0's line is there
            print("recipe: interrupted elsewhere: the ranks stopped at a checkpoint; resume=true continues",
                  file=sys.stderr)
        return stopped if stop.received is None else stop.exit_status()
    if stop.received is not None:
        print(f"recipe: {stop.name()} came after the last step: the run finished", file=sys.stderr)
    return 0
