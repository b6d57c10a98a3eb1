"""Ctrl-C during training: finish the optimizer step, write a checkpoint, exit 130.

`with StopRequest.install() as stop:` replaces the SIGINT handler around the training loop (and puts the previous
one back when the block ends). The first Ctrl-C only sets a flag
(and says so on stderr); the loop checks it after each optimizer step, saves a checkpoint and raises
`TrainingInterrupted`, which `run_recipe_script` turns into `recipe: interrupted ...` and exit status 130
(128 + SIGINT, what shells report for a Ctrl-C). A second Ctrl-C interrupts at once, without a checkpoint.

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

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step}: checkpoint {checkpoint} written; continue with "
                         "resume=true")
        self.step = step
        self.checkpoint = checkpoint


class StopRequest:
    """A flag set by the first Ctrl-C; `restore()` (or leaving its `with` block) puts the previous SIGINT handler
    back. Entering the block also notes that training has started (`note_training`)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    @classmethod
    def install(cls, enabled: bool = True) -> StopRequest:
        """Catch SIGINT for the caller's loop (a no-op when not `enabled` or not on the main thread)."""
        stop = cls()
        if enabled and threading.current_thread() is threading.main_thread():
            stop._previous = signal.signal(signal.SIGINT, stop._handle)
            stop._installed = True
        return stop

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        # the next Ctrl-C stops at once (the default handler raises KeyboardInterrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("\nrecipe: Ctrl-C: stopping after this step and writing a checkpoint (Ctrl-C again stops now)",
              file=sys.stderr, flush=True)

    def interrupted(self, step: int, checkpoint: Path) -> TrainingInterrupted:
        """The exception to raise once the checkpoint of `step` is written."""
        return TrainingInterrupted(step, checkpoint)

    def __enter__(self) -> StopRequest:
        note_training()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the SIGINT handler that was there before `install`."""
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
