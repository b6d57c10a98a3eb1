"""The folders a run reads and writes, checked before anything loads.

- A model folder must exist and hold a `config.json` (a Hugging Face folder).
- An output folder must be a folder (not a file), writable, and used by one run at a time: a run holds
  `output_dir/.recipe.lock` for its whole life. The lock is an `flock` on that file, so the kernel releases it
  when the process dies, however it dies (kill -9 included); the file records the owner's pid, host and start
  time for the message another run prints. A lock file left by a killed run is taken over with a note.
  Nothing else is written in it (no command line: it may carry a token).

`prepared_run(cfg, schema)` applies both to the keys a recipe's SCHEMA declares as `ModelDir` / `OutputDir`;
`run_recipe_script` wraps every recipe's `main` in it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from .config import ConfigSource, config_source
from .errors import RecipeError
from .launch import is_rank0
from .schema import ModelDir, OutputDir, walk_specs

log = logging.getLogger(__name__)

LOCK_NAME = ".recipe.lock"
# flock is not available on some network filesystems (e.g. Lustre without -o flock): fall back to the pid check
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

__all__ = ["LOCK_NAME", "check_loggers", "check_model_dir", "check_output_dir", "lock_output_dir", "prepared_run"]


def check_model_dir(path: str | os.PathLike) -> None:
    """RecipeError unless `path` is a folder with a config.json (what every model loader reads first)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise RecipeError(f"folder does not exist: {path}")
    if not p.is_dir():
        raise RecipeError(f"{path} is a file, not a model folder")
    if not (p / "config.json").is_file():
        hint = ""
        if (p / "run.json").is_file() and (p / "model" / "config.json").is_file():
            hint = f"; it holds a training run: its model is {Path(path) / 'model'}"
        elif (p / "adapter_config.json").is_file() and (p.parent / "model" / "config.json").is_file():
            hint = f"; it is a PEFT adapter: the merged model is {Path(path).parent / 'model'}"
        raise RecipeError(f"{path} is not a Hugging Face model folder: it has no config.json{hint}")


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_output_dir(output_dir: str | os.PathLike, busy: bool = True) -> None:
    """RecipeError when `output_dir` is a file, cannot be created or written, or (with `busy`) is locked by a
    live run."""
    p = Path(output_dir).expanduser()
    if p.exists() and not p.is_dir():
        raise RecipeError(f"{output_dir} is a file, not a folder: choose another output_dir")
    base = _nearest_existing(p.absolute())
    if not base.is_dir():
        raise RecipeError(f"{base} is a file, so the folder {output_dir} cannot be created there")
    if not os.access(base, os.W_OK | os.X_OK):
        where = "" if base == p.absolute() else f" (to create {output_dir})"
        raise RecipeError(f"no permission to write in {base}{where}: choose another output_dir")
    owner = _live_owner(p / LOCK_NAME) if busy else None
    if owner is not None:
        raise _busy(p, owner)


# ----------------------------------------------------------------------------------------------- lock


def _read_owner(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _owner_desc(owner: dict[str, Any]) -> str:
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}, started {owner.get('started', '?')}"


def _busy(out: Path, owner: dict[str, Any]) -> RecipeError:
    return RecipeError(f"{out} is in use by another run ({_owner_desc(owner)}; lock file {out / LOCK_NAME}): "
                       "wait for it to finish or choose another output_dir")


def _live_owner(lock_path: Path) -> dict[str, Any] | None:
    """The owner recorded in `lock_path` when a live process holds the lock (without taking it), else None."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_owner(lock_path) or {}
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            owner = _read_owner(lock_path)
            return owner if owner and owner.get("host") == socket.gethostname() and _pid_alive(owner.get("pid")) \
                else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def lock_output_dir(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold `output_dir/.recipe.lock` for the duration (creating the folder); RecipeError if a live run holds it."""
    out = Path(output_dir).expanduser()
    created = not out.exists()  # a run refused before it wrote anything leaves no empty folder behind
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"cannot create {output_dir}: {e.strerror}") from e
    lock_path = out / LOCK_NAME
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RecipeError(f"cannot write in {output_dir}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_owner(lock_path) or {}
            os.close(fd)
            raise _busy(out, owner) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            owner = _read_owner(lock_path)
            if owner and owner.get("host") == socket.gethostname() and _pid_alive(owner.get("pid")) \
                    and owner.get("pid") != os.getpid():
                os.close(fd)
                raise _busy(out, owner) from None
            break
        # A run that finishes unlinks the file while we wait to lock it: make sure we hold the file in place.
        try:
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    previous = _read_owner(lock_path)
    if previous:
        log.warning("note: %s: taking over the lock left by a run that did not finish (%s)", out,
                    _owner_desc(previous))
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    try:
        yield lock_path
    finally:
        with contextlib.suppress(OSError):
            if _read_owner(lock_path) == me:
                os.unlink(lock_path)
        os.close(fd)
        if created:
            remove_if_empty([out])


def create_output_dirs(cfg: Any, schema: Mapping[str, Any]) -> list[Path]:
    """Create every `OutputDir` folder a config names (`recipe run` before torchrun starts the ranks: a folder that
    cannot be made, `/sys/x`, is one line naming the key, not one per rank after their start-up); returns those it
    made, for `remove_if_empty` after a launch that wrote nothing."""
    src = config_source(cfg)
    values = cfg if isinstance(cfg, DictConfig) else asdict(cfg)
    made = []
    for key, _, value in walk_specs(values, dict(schema), (OutputDir,)):
        if value is None:
            continue
        folder = Path(value).expanduser()
        if not folder.exists():
            made.append(folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecipeError(f"{src.where(key)}: key '{key}': cannot create {value}: {e.strerror}") from e
    return made


def remove_if_empty(folders: list[Path]) -> None:
    """Remove each of `folders` that is empty (a run refused before it wrote anything leaves no folder behind)."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


# ----------------------------------------------------------------------------------------------- a run


def check_loggers(cfg: Any, schema: Mapping[str, Any]) -> None:
    """`tensorboard: true` / a `wandb:` section (without secrets) need their packages: said when the config is
    validated and before a run loads anything, with the key and where it was set."""
    _check_logger_packages(cfg if isinstance(cfg, DictConfig) else asdict(cfg), schema, config_source(cfg))


def _check_logger_packages(values: Mapping[str, Any], schema: Mapping[str, Any], src: ConfigSource) -> None:
    from .metrics import check_logger_packages

    for key in ("tensorboard", "wandb"):
        if key not in schema:
            continue
        value = values.get(key)
        try:
            check_logger_packages(bool(value) if key == "tensorboard" else False, value if key == "wandb" else None)
        except RecipeError as e:
            raise RecipeError(f"{src.where(key)}: key '{key}': {e}") from e


@contextlib.contextmanager
def prepared_run(cfg: Any, schema: Mapping[str, Any], lock: bool = True) -> Iterator[None]:
    """Check the folders a validated config names (a typed config or a DictConfig), before any model loads, then
    hold the output lock.

    Every `ModelDir` key must name a model folder; every `OutputDir` key a folder that can be written and that no
    live run holds. With `lock` (rank 0 only under torchrun) this run holds each output folder's lock until the
    block ends. Errors name the key and where it was set.
    """
    src = config_source(cfg)
    values = cfg if isinstance(cfg, DictConfig) else asdict(cfg)
    folders = [(k, spec, v) for k, spec, v in walk_specs(values, dict(schema), (ModelDir, OutputDir)) if v is not None]
    rank0 = is_rank0()  # under torchrun the other ranks neither lock nor see rank 0's lock
    check_loggers(cfg, schema)
    with contextlib.ExitStack() as stack:
        for locking in (False, True):  # every check first, so a bad folder creates nothing
            for key, spec, value in folders:
                try:
                    if not locking:
                        if isinstance(spec, ModelDir):
                            check_model_dir(value)
                        else:
                            check_output_dir(value, busy=rank0)
                    elif lock and rank0 and isinstance(spec, OutputDir):
                        stack.enter_context(lock_output_dir(value))
                except RecipeError as e:
                    raise RecipeError(f"{src.where(key)}: key '{key}': {e}") from e
        yield
