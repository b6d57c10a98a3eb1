"""Outputs replaced by `overwrite=true`, kept until the new run has shown it works: moved by renames into a hidden
folder in the output folder (instant, no second copy on disk, and nothing old left under a name the new run
reads), then deleted, or put back when the new run stops first. Training runs (runs.py) and logits caches
(logits_cache/writer.py) each decide when; this module only moves files."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["discard", "put_back", "put_back_leftovers", "set_aside", "set_aside_folders"]


def set_aside(out: Path, paths: Iterable[Path], prefix: str) -> Path | None:
    """Move `paths` (files, folders or links in `out`) into a new hidden folder `out/<prefix>XXXX` and return it;
    None when there is nothing to move."""
    paths = list(paths)
    if not paths:
        return None
    aside = Path(tempfile.mkdtemp(prefix=prefix, dir=out))
    for i, p in enumerate(paths):
        os.rename(p, aside / f"{i}_{p.name}")  # numbered: two paths may share a name only in their parents
    return aside


def delete(paths: Iterable[Path]) -> None:
    """Delete each of `paths`: a folder with what it holds, a file or a link itself."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def put_back(out: Path, aside: Path, written: Iterable[Path]) -> None:
    """Delete `written` (what the stopped run wrote under the old names), move what `aside` holds back to its
    names in `out`, and remove `aside`."""
    delete(written)
    for item in aside.iterdir():
        os.rename(item, out / _original_name(item))
    aside.rmdir()


def discard(aside: Path | None) -> None:
    """Delete what was set aside (the new run has shown it works), and name what went in one line, so that
    `overwrite=true` never deletes silently (the hidden folder sits in the output folder it was taken from)."""
    if aside is None:
        return
    names = sorted(_original_name(p) for p in aside.iterdir()) if aside.is_dir() else []
    if names:
        print(f"overwrite=true: deleted the earlier run's {', '.join(names)} in {aside.parent}", flush=True)
    shutil.rmtree(aside, ignore_errors=True)


def _original_name(item: Path) -> str:
    number, _, name = item.name.partition("_")
    return name if number.isdigit() and name else item.name  # unnumbered: an older version's


def set_aside_folders(out: Path, prefix: str) -> list[Path]:
    """The folders `set_aside` made in `out` with `prefix` that are still there (a killed run's)."""
    return sorted(p for p in out.glob(f"{prefix}*") if p.is_dir())


def put_back_leftovers(out: Path, prefix: str, written: Callable[[], Iterable[Path]]) -> bool:
    """A run killed before it deleted or put back what it set aside (kill -9, a lost node) left it in `out`: the
    newest such folder comes back (what that run wrote under the old names, `written()`, goes) and any older one
    goes. True when something came back. Call it only while no live run uses `out` (under its lock)."""
    leftovers = sorted(set_aside_folders(out, prefix), key=lambda p: p.stat().st_mtime) if out.is_dir() else []
    for aside in leftovers[:-1]:  # an older attempt's (never expected: each run recovers the one before it first)
        shutil.rmtree(aside, ignore_errors=True)
    if leftovers:
        put_back(out, leftovers[-1], written())
    return bool(leftovers)
