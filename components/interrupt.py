"""Ctrl-C (or SIGTERM) during training: finish the optimizer step, write a checkpoint, exit 130 (143).

`with StopRequest.install() as stop:` replaces the SIGINT and SIGTERM handlers around the training loop (and puts
the previous ones back when the block ends). The first signal only sets a flag
(and says so on stderr); the loop checks it after each optimizer step, saves a checkpoint and raises
`TrainingInterrupted`, which `run_recipe_script` turns into `recipe: interrupted ...` and exit status 128 + the
signal (130 for Ctrl-C, what shells report; 143 for SIGTERM, what a scheduler such as SLURM sends before it kills
a job at its time limit). A second signal interrupts at once, without a checkpoint. In one process a thread reads
the signals from Python's wakeup fd, so both are seen when they come, even inside one long C call (a CPU backward
of a minute), where Python would run its handler once, for the two, only after the call returned.

Under `recipe run --nproc-per-node N` the launcher passes a Ctrl-C or SIGTERM it gets on to its workers as SIGUSR1
or SIGUSR2 (cli/launch.py), which each worker's handler takes as that request; the ranks agree on the step to stop
at through the step's one reduction (`flag` rides in `training.step_values`, no extra collective). A worker's own
SIGTERM keeps its default action: it is how torchrun stops the other ranks when one failed, and a rank blocked in
a collective with a dead peer must die at once (a Python handler would run only when the collective returned).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["FORWARDED", "FORWARDED_ENV", "REPORT_PREFIX", "STOPPED_FILE", "StopRequest", "TrainingInterrupted",
           "exit_status", "interrupted_message", "note_continues", "note_training", "note_written", "reset",
           "take_forwarded_signals", "to_launcher"]

# Set by `recipe run` for its torchrun workers (cli/launch.py): it passes a user's SIGINT / SIGTERM on as
# `FORWARDED` (the workers' own SIGTERM stays torchrun's way to stop them) and exits 128 + the signal itself, so a
# worker that stopped at its checkpoint exits 0: a non-zero exit would make torchrun stop the ranks still writing.
FORWARDED_ENV = "LLM_RECIPE_FORWARDS_SIGNALS"  # the launcher's folder for this run (its workers on this node)
STOPPED_FILE = "stopped"  # in it: the exit status of the ranks that stopped at a checkpoint
FORWARDED = {signal.SIGUSR1: signal.SIGINT, signal.SIGUSR2: signal.SIGTERM}  # what a worker gets -> what it means
REPORT_PREFIX = "report."  # in it: a rank's last line (`recipe: error: ...`), for the launcher to print once

# What this run has done so far, for the line a Ctrl-C prints (`interrupted_message`).
_state: dict[str, Any] = {"training": False, "written": None, "continues": None}


def reset() -> None:
    """A new run starts: nothing written, not training (`run_recipe_script` calls it)."""
    _state.update(training=False, written=None, continues=None)


def note_continues(how: str) -> None:
    """Work so far is kept and the same command continues it (an evaluation's answers): what Ctrl-C says."""
    _state["continues"] = how


def note_written(path: str | Path) -> None:
    """An output file or folder is complete under its final name (the atomic writers call it)."""
    _state["written"] = Path(path)


def note_training() -> None:
    """The training loop has started (its first Ctrl-C checkpoints; a second one stops without)."""
    _state["training"] = True


def interrupted_message(err: BaseException) -> str:
    """The one line (after `recipe: `) for a Ctrl-C that reached the top of a run."""
    if str(err):  # TrainingInterrupted: the step and its checkpoint
        return str(err)
    if _state["continues"]:
        return f"interrupted; {_state['continues']}"
    if _state["training"]:
        return ("interrupted during training (second Ctrl-C): the current step was not saved; resume=true "
                "continues from the latest checkpoint")
    if _state["written"] is None:
        return "interrupted during setup (no output yet: the same command starts again)"
    return (f"interrupted (Ctrl-C); outputs completed before it are kept (the last: {_state['written']}), "
            "nothing half-written is left")


def take_forwarded_signals() -> None:
    """In a worker of `recipe run`: the launcher's SIGUSR1 / SIGUSR2 act as the Ctrl-C / SIGTERM they stand for
    wherever no training loop catches them (setup, the final write); their default action would kill the worker
    as 'killed by SIGUSR2'. `run_recipe_script` calls it."""
    if os.environ.get(FORWARDED_ENV) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.default_int_handler)  # KeyboardInterrupt, as Ctrl-C
        signal.signal(signal.SIGUSR2, _terminate)


def _terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)


def to_launcher(line: str) -> bool:
    """A worker of `recipe run` with several ranks leaves its last line (`recipe: error: ...`, `recipe: interrupted
    ...`) in the launcher's folder instead of printing it: the launcher prints each distinct line once (every rank
    failing the same check printed it once per rank, between torchrun's own lines). False, and nothing written,
    elsewhere: the caller prints the line."""
    folder = os.environ.get(FORWARDED_ENV)
    if not folder or int(os.environ.get("WORLD_SIZE", "1")) < 2 or not os.path.isdir(folder):
        return False
    try:
        with open(os.path.join(folder, f"{REPORT_PREFIX}{int(os.environ.get('RANK', '0')):06d}"), "a") as f:
            f.write(line.replace("\n", " ") + "\n")
    except OSError:
        return False
    return True


def exit_status(err: KeyboardInterrupt) -> int:
    """The exit status for a Ctrl-C or SIGTERM that reached the top of a run: 128 + the signal, or 0 for a
    worker of `recipe run` that stopped at its checkpoint: it leaves its status in the launcher's folder
    (FORWARDED_ENV, `STOPPED_FILE`) for the launcher to exit with."""
    code = getattr(err, "exit_code", 130)
    folder = os.environ.get(FORWARDED_ENV)
    if isinstance(err, TrainingInterrupted) and folder and os.path.isdir(folder):
        with open(os.path.join(folder, STOPPED_FILE), "w") as f:
            f.write(f"{code}\n")
        return 0
    return code


class TrainingInterrupted(KeyboardInterrupt):
    """Raised at a step boundary after a Ctrl-C, once the checkpoint of that step is written."""

    def __init__(self, step: int, checkpoint: Path, signum: int = signal.SIGINT, main: bool = True) -> None:
        super().__init__(f"interrupted after step {step}: checkpoint {checkpoint} written; continue with "
                         "resume=true")
        self.step = step
        self.checkpoint = checkpoint
        self.main = main  # under torchrun only rank 0 says it
        self.exit_code = 128 + int(signum)  # 130 for Ctrl-C, 143 for SIGTERM


class StopRequest:
    """A flag set by the first Ctrl-C; `restore()` (or leaving its `with` block) puts the previous SIGINT handler
    back. Entering the block also notes that training has started (`note_training`)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, ranks: int = 1, main: bool = True) -> None:
        self.requested = False
        self.signum: int = signal.SIGINT
        self.ranks, self.main = ranks, main
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._watch: tuple[threading.Thread, int, int] | None = None  # the counting thread, its pipe's read / write fd

    @classmethod
    def install(cls, enabled: bool = True, ranks: int = 1, main: bool = True) -> StopRequest:
        """Catch SIGINT and SIGTERM for the caller's loop; under torchrun (`ranks` > 1) the launcher's SIGUSR1 /
        SIGUSR2 instead, and only under `recipe run` (plain torchrun stops its workers itself). A no-op when not
        `enabled` or not on the main thread. `main`: this process says what happens (rank 0)."""
        stop = cls(ranks, main)
        forwarded = tuple(FORWARDED) if os.environ.get(FORWARDED_ENV) else ()  # under `recipe run`'s torchrun
        signals = cls._SIGNALS + forwarded if ranks == 1 else forwarded
        if enabled and threading.current_thread() is threading.main_thread():
            stop._previous = {s: signal.signal(s, stop._handle) for s in signals}
            if ranks == 1 and not forwarded:
                stop._start_watching()
        return stop

    def _start_watching(self) -> None:
        """One process: count the signals as they arrive (Python's wakeup fd gets a byte per signal at C level,
        however long the main thread stays in C), in a thread that takes the first as the request and ends the
        process on the second. Not when something else (an event loop) already owns the wakeup fd."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        owner = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if owner != -1:
            signal.set_wakeup_fd(owner)
            os.close(read_fd), os.close(write_fd)
            return
        thread = threading.Thread(target=self._count_signals, args=(read_fd,), name="recipe-stop", daemon=True)
        self._watch = (thread, read_fd, write_fd)
        thread.start()

    def _count_signals(self, read_fd: int) -> None:
        seen = 0
        while data := os.read(read_fd, 64):
            for signum in data:
                if signum == 0:  # restore(): the training loop is over
                    return
                if signum not in self._SIGNALS:
                    continue
                seen += 1
                if seen == 1:
                    self._request(signum)
                    continue
                with contextlib.suppress(Exception):  # the second: stop now, without a checkpoint
                    sys.stdout.flush()
                    print("\nrecipe: " + interrupted_message(KeyboardInterrupt()), file=sys.stderr, flush=True)
                os._exit(128 + signum)  # as the signal's own action would: nothing after the last checkpoint

    def _handle(self, signum: int, frame: Any) -> None:
        signum = FORWARDED.get(signum, signum)
        if self._watch is not None:  # one process: the thread counts; this only sets the flag as early as Python can
            self._request(signum)
            return
        if self.requested:  # under torchrun: the launcher passed a second one on; stop now, without a checkpoint
            raise KeyboardInterrupt  # (exit 130; torchrun then stops the other ranks)
        self._request(signum)

    def _request(self, signum: int) -> None:
        """The first stop request: set the flag and say so (once, from the handler or the counting thread)."""
        with self._lock:
            if self.requested:
                return
            self.requested, self.signum = True, signum
        if self.main:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(f"\nrecipe: {name}: stopping after this step and writing a checkpoint ({name} again stops now)",
                  file=sys.stderr, flush=True)

    def flag(self, device: Any) -> Any:
        """This rank's request as a number on `device`, for the step's reduction (`training.step_values`): the
        ranks stop at the step whose sum is non-zero, all of them at the same one."""
        import torch

        return torch.full((), float(self.requested), device=device)  # a fill kernel: no host-to-GPU copy, no sync

    def agreed(self, values: dict[str, float]) -> bool:
        """Stop after this step? One process: whenever asked. Under torchrun: when any rank had asked by the step's
        reduction (`values["stop"]`, the ranks' summed `flag`), so every rank saves the same step; a request that
        came later is taken up at the next step."""
        return self.requested if self.ranks == 1 else values.get("stop", 0.0) > 0

    def interrupted(self, step: int, checkpoint: Path) -> TrainingInterrupted:
        """The exception to raise once the checkpoint of `step` is written."""
        return TrainingInterrupted(step, checkpoint, self.signum, self.main)

    def __enter__(self) -> StopRequest:
        note_training()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the handlers that were there before `install`."""
        if self._watch is not None:
            thread, read_fd, write_fd = self._watch
            self._watch = None
            signal.set_wakeup_fd(-1)  # nobody owned it before (`_start_watching`)
            os.write(write_fd, b"\0")
            thread.join()
            os.close(read_fd), os.close(write_fd)
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
