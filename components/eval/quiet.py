"""What lm-eval does around an evaluation that a user of `recipe` should not pay for, without patching lm-eval.

- **An unreachable Hub.** A stock task whose dataset is not in the HF cache makes `datasets` retry the Hub for
  about 30 s and end in a `ConnectionError` traceback. `offline_if_hub_unreachable` asks the Hub once (a few
  seconds at most) and, when it does not answer, sets `HF_HUB_OFFLINE` / `HF_DATASETS_OFFLINE` (the switches
  huggingface_hub and datasets document) before either is imported, so a cached dataset still loads and a
  missing one fails at once; `hub_error` turns that failure into one line.
- **`git describe` outside a repository.** lm-eval records the git commit of the current folder by running
  `git describe --always` with our stderr (lm_eval/loggers/utils.py, on every evaluation), so every eval run
  outside a git work tree printed `fatal: not a git repository ...`. lm-eval offers no switch for it and the
  cwd is the user's; `no_git_noise` drops exactly that line from stderr while lm-eval runs (everything else
  passes through as written), and only when the cwd is outside a git work tree. lm-eval still records the
  commit as none, as it did.
- **A hint for lm-eval's own CLI.** Our offline tasks load their rows with a `custom_dataset` function, and
  lm-eval logs "Custom kwargs can be passed to `--metadata` ..." for every such task (a hint about its `--metadata`
  flag, which a `recipe` user never passes). `no_metadata_hint` filters exactly that record from lm-eval's task
  logger (a standard logging.Filter, removed afterwards) while the block runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import RecipeError

GIT_FATAL = b"fatal: not a git repository"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def is_offline() -> bool:
    return any(_truthy(os.environ.get(v)) for v in _OFFLINE_VARS)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub (HF_ENDPOINT or huggingface.co) answers an HTTP request within `timeout` seconds."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/whoami-v2", method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return True  # it answered (401 without a token)
    except (OSError, ValueError):
        return False
    return True


def needs_hub(tasks: Iterable[str]) -> bool:
    """Whether some task may need data from the Hub: anything but our offline pack and local YAML files."""
    return any(t and not t.startswith("recipe_") and not t.endswith((".yaml", ".yml")) for t in tasks)


def offline_if_hub_unreachable(tasks: Iterable[str], log=print) -> bool:
    """Set the offline switches when some task may need the Hub and the Hub does not answer (call before
    datasets / huggingface_hub are imported). Returns whether the run is offline."""
    if is_offline():
        return True
    if not needs_hub(tasks) or hub_reachable():
        return False
    for v in _OFFLINE_VARS:
        os.environ[v] = "1"
    log("note: the Hugging Face Hub does not answer: running offline (stock tasks need their data in the HF "
        "cache; the recipe_* tasks are shipped)", file=sys.stderr)
    return True


def hub_error(err: BaseException, tasks: Iterable[str]) -> RecipeError | None:
    """The one-line error for a task whose data could not come from the Hub (None: some other failure)."""
    names = {type(c).__name__ for c in _chain(err)}
    if not (isinstance(err, ConnectionError) or names & {"OfflineModeIsEnabled", "LocalEntryNotFoundError",
                                                          "DatasetNotFoundError", "ConnectionError"}):
        return None
    stock = [t for t in tasks if t and not t.startswith("recipe_")]
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    offline = "the run is offline" if is_offline() else "the Hub could not be reached"
    return RecipeError(f"task(s) {', '.join(stock) or '?'}: the data is not in the HF cache and {offline} ({detail}); "
                       "use the offline pack instead (`recipe lm_eval ls tasks` lists the recipe_* tasks, e.g. "
                       "recipe_hellaswag) or run once with the Hub reachable to cache it")


def unknown_tasks_error(err: BaseException) -> RecipeError | None:
    """lm-eval's `ValueError: Tasks not found: a, b` as one line that says where the names are."""
    if not (isinstance(err, ValueError) and str(err).startswith("Tasks not found:")):
        return None
    missing = str(err).split(":", 1)[1].strip()
    from .run import offline_task_names

    return RecipeError(f"unknown task(s): {missing}; `recipe lm_eval ls tasks` lists every task name (the offline "
                       f"pack: {', '.join(offline_task_names())})")


def _chain(err: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def in_git_work_tree(path: str | os.PathLike | None = None) -> bool:
    p = Path(path or os.getcwd()).resolve()
    return any((d / ".git").exists() for d in (p, *p.parents))


@contextlib.contextmanager
def no_git_noise() -> Iterator[None]:
    """Drop the `fatal: not a git repository ...` line lm-eval's `git describe` writes to our stderr while the
    block runs (only outside a git work tree; elsewhere, and where fd 2 cannot be redirected, a no-op)."""
    if in_git_work_tree():
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        r, w = os.pipe()
        os.dup2(w, 2)
        os.close(w)
    except OSError:
        yield
        return

    def pump() -> None:
        pending = b""
        while chunk := os.read(r, 65536):
            pending += chunk
            out = []
            while (i := pending.find(b"\n")) >= 0:
                line, pending = pending[: i + 1], pending[i + 1 :]
                # a bar redrawn with \r and the git line can arrive as one line: keep what comes before it
                head, cr, tail = line.rpartition(b"\r")
                out.append(head + cr if tail.startswith(GIT_FATAL) else line)
            # a partial line goes on at once (progress bars redraw with \r) unless its end may be the dropped one
            head, cr, tail = pending.rpartition(b"\r")
            if head or cr:
                out.append(head + cr)
                pending = tail
            if pending and not (GIT_FATAL.startswith(pending) or pending.startswith(GIT_FATAL)):
                out.append(pending)
                pending = b""
            if out:
                os.write(saved, b"".join(out))
        if pending and not pending.startswith(GIT_FATAL):
            os.write(saved, pending)

    thread = threading.Thread(target=pump, name="recipe-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's write end: the pump reads to the end and stops
        thread.join(timeout=5)
        os.close(r)
        os.close(saved)


class _NoMetadataHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def no_metadata_hint() -> Iterator[None]:
    """Drop lm-eval's per-task "Custom kwargs can be passed to `--metadata`" warning while the block runs."""
    logger, hint = logging.getLogger("lm_eval.api.task"), _NoMetadataHint()
    logger.addFilter(hint)
    try:
        yield
    finally:
        logger.removeFilter(hint)
