"""Ctrl-C (or SIGTERM) during training: finish the optimizer step, write a checkpoint, exit 130 (143).

`with StopRequest.install() as stop:` replaces the SIGINT and SIGTERM handlers around the training loop (and puts
the previous ones back when the block ends). The first signal only sets a flag
(and says so on stderr); the loop checks it after each optimizer step, saves a checkpoint and raises
`TrainingInterrupted`, which `run_recipe_script` turns into `recipe: interrupted ...` and exit status 128 + the
signal (130 for Ctrl-C, what shells report; 143 for SIGTERM, what a scheduler such as SLURM sends before it kills
a job at its time limit). A second signal interrupts at once, without a checkpoint.

Only in a single process, from the main thread: under torchrun every rank would have to agree on the step to stop
at (one more collective per step), so there Ctrl-C keeps its default behaviour and `resume=true` continues from
the last periodic checkpoint.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["StopRequest", "TrainingInterrupted", "interrupted_message", "note_training", "note_written", "reset"]

# What this run has done so far, for the line a Ctrl-C prints (`interrupted_message`).
_state: dict[str, Any] = {"training": False, "written": None}


def reset() -> None:
    """A new run starts: nothing written, not training (`run_recipe_script` calls it)."""
    _state.update(training=False, written=None)


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
    if _state["training"]:
        return ("interrupted during training (second Ctrl-C): the current step was not saved; resume=true "
                "continues from the latest checkpoint")
    if _state["written"] is None:
        return "interrupted during setup (nothing was written)"
    return (f"interrupted (Ctrl-C); outputs completed before it are kept (the last: {_state['written']}), "
            "nothing half-written is left")


class TrainingInterrupted(KeyboardInterrupt):
    """Raised at a step boundary after a Ctrl-C, once the checkpoint of that step is written."""

    def __init__(self, step: int, checkpoint: Path, signum: int = signal.SIGINT) -> None:
        super().__init__(f"interrupted after step {step}: checkpoint {checkpoint} written; continue with "
                         "resume=true")
        self.step = step
        self.checkpoint = checkpoint
        self.exit_code = 128 + int(signum)  # 130 for Ctrl-C, 143 for SIGTERM


class StopRequest:
    """A flag set by the first Ctrl-C; `restore()` (or leaving its `with` block) puts the previous SIGINT handler
    back. Entering the block also notes that training has started (`note_training`)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: int = signal.SIGINT
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls, enabled: bool = True) -> StopRequest:
        """Catch SIGINT and SIGTERM for the caller's loop (a no-op when not `enabled` or not on the main thread)."""
        stop = cls()
        if enabled and threading.current_thread() is threading.main_thread():
            stop._previous = {s: signal.signal(s, stop._handle) for s in cls._SIGNALS}
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.signum = True, signum
        # the next signal stops at once: Ctrl-C raises KeyboardInterrupt, SIGTERM terminates
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\nrecipe: {name}: stopping after this step and writing a checkpoint ({name} again stops now)",
              file=sys.stderr, flush=True)

    def interrupted(self, step: int, checkpoint: Path) -> TrainingInterrupted:
        """The exception to raise once the checkpoint of `step` is written."""
        return TrainingInterrupted(step, checkpoint, self.signum)

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
