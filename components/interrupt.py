"""Ctrl-C (or SIGTERM) during training: finish the optimizer step, write a checkpoint, exit 130 (143).

`with StopRequest.install() as stop:` replaces the SIGINT and SIGTERM handlers around the training loop (and puts
the previous ones back when the block ends). The first signal only sets a flag
(and says so on stderr); the loop checks it after each optimizer step, saves a checkpoint and raises
`TrainingInterrupted`, which `run_recipe_script` turns into `recipe: interrupted ...` and exit status 128 + the
signal (130 for Ctrl-C, what shells report; 143 for SIGTERM, what a scheduler such as SLURM sends before it kills
a job at its time limit). A second signal interrupts at once, without a checkpoint.

Under torchrun every rank has the handler, and the ranks agree on the step to stop at through the step's one
reduction (`flag` rides in `training.step_values`, no extra collective); `recipe run` forwards the signal it gets
to its workers (cli/launch.py). A signal delivered twice within `REPEAT_WINDOW_S` (by a scheduler to every
process and by the launcher) counts once there.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["FORWARDED_ENV", "REPEAT_WINDOW_S", "StopRequest", "TrainingInterrupted", "exit_status",
           "interrupted_message", "note_continues", "note_training", "note_written", "reset"]

# Under torchrun a worker may get one signal twice at once (SLURM signals every process of a job step, and
# `recipe run` forwards what it gets): within this many seconds of the first, a repeat is the same request.
REPEAT_WINDOW_S = 2.0

# Set by `recipe run` for its torchrun workers (cli/launch.py): it passes signals on and exits 128 + the signal
# itself, so a worker that stopped at its checkpoint exits 0; a non-zero exit would make torchrun stop the
# ranks still writing theirs.
FORWARDED_ENV = "LLM_RECIPE_FORWARDS_SIGNALS"

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
        return "interrupted during setup (nothing was written)"
    return (f"interrupted (Ctrl-C); outputs completed before it are kept (the last: {_state['written']}), "
            "nothing half-written is left")


def exit_status(err: KeyboardInterrupt) -> int:
    """The exit status for a Ctrl-C or SIGTERM that reached the top of a run: 128 + the signal, or 0 for a
    worker of `recipe run` that stopped at its checkpoint (the launcher reports the signal: FORWARDED_ENV)."""
    if isinstance(err, TrainingInterrupted) and os.environ.get(FORWARDED_ENV) == "1":
        return 0
    return getattr(err, "exit_code", 130)


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
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, enabled: bool = True, ranks: int = 1, main: bool = True) -> StopRequest:
        """Catch SIGINT and SIGTERM for the caller's loop (a no-op when not `enabled` or not on the main thread).
        `ranks`: the run's process count; `main`: this process says what happens (rank 0)."""
        stop = cls(ranks, main)
        if enabled and threading.current_thread() is threading.main_thread():
            stop._previous = {s: signal.signal(s, stop._handle) for s in cls._SIGNALS}
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.requested:  # only reached under torchrun, inside the repeat window: the same request again
            if now - self._first_at >= REPEAT_WINDOW_S:
                self._stop_now(signum)
            return
        self.requested, self.signum, self._first_at = True, signum, now
        if self.ranks == 1:  # the next signal stops at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.main:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            print(f"\nrecipe: {name}: stopping after this step and writing a checkpoint ({name} again stops now)",
                  file=sys.stderr, flush=True)

    @staticmethod
    def _stop_now(signum: int) -> None:
        """A second request: stop without a checkpoint, as the default handlers do."""
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

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
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
