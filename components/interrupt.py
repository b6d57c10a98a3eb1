"""Ctrl-C during training: finish the optimizer step, write a checkpoint, exit 130.

`StopRequest.install()` replaces the SIGINT handler for the training loop. The first Ctrl-C only sets a flag
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

__all__ = ["StopRequest", "TrainingInterrupted"]


class TrainingInterrupted(KeyboardInterrupt):
    """Raised at a step boundary after a Ctrl-C, once the checkpoint of that step is written."""

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted after step {step}: checkpoint {checkpoint} written; continue with "
                         "resume=true")
        self.step = step
        self.checkpoint = checkpoint


class StopRequest:
    """A flag set by the first Ctrl-C; `restore()` puts the previous SIGINT handler back."""

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

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
