"""Atomic directory writes: a crash mid-save never leaves a folder that looks complete.

Files go to a hidden temp dir beside the target, are fsynced, then the dir is renamed into place. A folder
that exists under its final name is therefore always complete. A write that fails for lack of space (or any other
OS reason) removes the temp dir and raises a one-line RecipeError; the previous folder of that name is untouched.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from safetensors import SafetensorError

from ..errors import RecipeError
from ..interrupt import note_written


def current_umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status), else by setting it
    back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike | int, folder: bool = False) -> None:
    """Give a file (path or open fd) made by tempfile.mkstemp / mkdtemp (always 0600 / 0700, private to us) the
    mode a plain `open()` / `mkdir()` would have: 0666 / 0777 less the umask. Outputs (weights, GGUF, metrics,
    plots, the model cache) are then as readable as any other file the user creates."""
    mode = (0o777 if folder else 0o666) & ~current_umask()
    if isinstance(path, int):
        os.fchmod(path, mode)
    else:
        os.chmod(path, mode)


def _fsync_tree(root: Path, umask: int | None = None) -> None:
    """fsync every file and folder under `root`; with `umask`, also give them the modes `open`/`mkdir` would
    (some writers, safetensors among them, create their files 0600)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                if umask is not None:
                    os.fchmod(fd, 0o666 & ~umask)
                os.fsync(fd)
            finally:
                os.close(fd)
        if umask is not None:
            os.chmod(dirpath, 0o777 & ~umask)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `target` atomically, on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Leftovers of an earlier write of this target that was killed (one run writes a folder at a time: the
    # output_dir lock, llm_recipe.components.folders): half-written temp dirs are dropped; an old copy moved aside just
    # before the kill is put back when nothing replaced it.
    name = glob.escape(target.name)
    for stale in target.parent.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in target.parent.glob(f".{name}.old-*"):
        if not target.exists() and (stale / "x").is_dir():
            os.rename(stale / "x", target)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    honour_umask(tmp, folder=True)
    try:
        yield tmp
        _fsync_tree(tmp, umask=current_umask())
        if target.exists():
            if not overwrite:
                raise FileExistsError(target)
            # Move the old copy aside first so that the rename below is atomic; then drop it.
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "x")
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
        _fsync_dir(target.parent)
        note_written(target)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = write_failure(e)
        if reason is not None:
            raise RecipeError(f"cannot write {target}: {reason}; nothing under that name was changed") from e
        raise


def write_failure(err: BaseException) -> str | None:
    """The reason of a failed write (disk full, file too large, permission, read-only filesystem), else None.

    safetensors reports I/O errors as SafetensorError("Error while serializing: I/O error: <reason>");
    torch.distributed.checkpoint (sharded saves) as a CheckpointException holding each failed rank's error."""
    if isinstance(err, OSError):
        return err.strerror or str(err)
    failures = getattr(err, "failures", None)  # CheckpointException: {rank: (exception, stack summary)}
    if isinstance(failures, dict):
        for failure in failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, BaseException) and (reason := write_failure(cause)) is not None:
                return reason
    if isinstance(err, SafetensorError) and "I/O error" in str(err):
        return str(err).split("I/O error:", 1)[1].strip()
    return None


def atomic_write_bytes(path: str | os.PathLike, data: bytes, output: bool = True) -> None:
    """Write a single file atomically (temp file, fsync, rename). `output=False`: bookkeeping (run.json), not
    something a Ctrl-C message should name as a kept output."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        honour_umask(fd)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if output:
            note_written(path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
