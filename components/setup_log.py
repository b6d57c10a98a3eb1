"""Says what a run's setup is doing and how long each part took: weights, data, compile and the first step.

A GPU run can spend minutes before its first optimizer step (loading an 8B teacher, quantizing it, compiling);
without a word the bar sits at 0/N. Rank 0 prints one line as each part starts and one as it ends, then a summary
when the first optimizer step is done, counted from the launch of the process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

from .launch import is_rank0


def process_start_time() -> float:
    """Wall-clock time (time.time()) this process started, from /proc on Linux; now where /proc is missing."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / ticks
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


_first_in_process = True  # only a process's first SetupLog counts its start-up (see not_a_fresh_process)


def not_a_fresh_process() -> None:
    """The next SetupLog counts no start-up: this process did other work first (`recipe demo` evaluates and prunes
    before its kd run), so launch-to-setup is not the recipe's start-up."""
    global _first_in_process
    _first_in_process = False


class SetupLog:
    """`with log.phase("teacher weights"):` prints `setup: teacher weights ...` and `setup: teacher weights: 12.3 s`;
    `log.first_step(seconds)` prints when the process's first step ended and the parts before it, the process's
    start-up first (interpreter, imports, config: from launch to this log's creation at the top of the recipe's
    main). Silent off rank 0 (`is_main`; default: torchrun's RANK is 0 or unset, so it can exist before the
    runtime)."""

    def __init__(self, is_main: bool | None = None, prefix: str = "setup") -> None:
        global _first_in_process
        self.prefix = prefix  # what each line starts with (`quantize:` for the quantize recipe's parts)
        self.is_main = is_rank0() if is_main is None else is_main
        self.launched = process_start_time()
        self.began = time.time()  # differs from the launch when a process runs recipes in turn (`recipe demo`)
        self.parts: list[tuple[str, float]] = []
        self.fresh = _first_in_process  # else launch-to-now counts earlier work of this process: not said
        if _first_in_process:
            self.parts.append(("start-up (Python, imports, config)", max(0.0, self.began - self.launched)))
        _first_in_process = False

    def say(self, text: str, prefix: str | None = None) -> None:
        """One line from rank 0, after `prefix` (default this log's, e.g. `setup:`)."""
        if self.is_main:  # through tqdm, so a progress bar on screen is redrawn below the line
            tqdm.write(f"{prefix or self.prefix}: {text}")

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        self.say(f"{what} ...")
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        self.parts.append((what, seconds))
        self.say(f"{what}: {seconds:.1f} s")

    def first_step(self, step_seconds: float, compiled: bool, step: int = 1,
                   within: dict[str, float] | None = None) -> None:
        """After this process's first optimizer step (`step`: 1, or the one after a resumed checkpoint): its time
        (compilation included when `compiled`), the parts of it `within` names (e.g. on-policy sampling's seconds)
        and the whole breakdown."""
        now = time.time()
        parts = ", ".join(f"{what} {s:.1f} s" for what, s in self.parts)
        inside = [f"{what} {s:.1f} s of it" for what, s in (within or {}).items() if s > 0]
        if compiled:
            inside.append("includes torch.compile of what runs in it")
        note = f" ({'; '.join(inside)})" if inside else ""
        when = (f"{now - self.launched:.1f} s after launch ({now - self.began:.1f} s after setup began)" if self.fresh
                else f"{now - self.began:.1f} s after setup began")
        self.say(f"first optimizer step done {when}: {parts}{', ' if parts else ''}step {step} {step_seconds:.1f} s"
                 f"{note}")
