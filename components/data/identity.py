"""What a run's local data files are, so that a resumed run can tell that they changed under it.

run.json records, for every local file a config's dataset sections read (the `dataset:` rows, an on-policy prompt
set), a fingerprint: the sha256 of its bytes for files up to `HASHED_BYTES` (a rewrite with the same content is the
same data), its size and modification time above (hashing gigabytes at every start is not free). A resume whose
files differ would continue the checkpoint's data position in other rows: components/runs.py refuses it unless
`resume_with_changes: true`. Hub datasets are not fingerprinted (their revision is the Hub's to say).
"""

from __future__ import annotations

import hashlib
from dataclasses import fields, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .sources import local_data_files, resolve_source

HASHED_BYTES = 256 << 20  # files up to this size are fingerprinted by content
_MAX_FILES = 10_000  # a folder source with more files is fingerprinted by its first ones (sorted)

__all__ = ["HASHED_BYTES", "data_changes", "data_identity"]


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return _fingerprint_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4096)  # one hash per file version and process (a resume checks, then records)
def _fingerprint_of(path: str, size: int, mtime_ns: int) -> str:
    if size > HASHED_BYTES:
        return f"size {size}, modified {mtime_ns}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return f"sha256 {digest.hexdigest()}"


def _files(dataset: Any) -> list[Path]:
    """The local files a `DatasetConfig` reads: its source file, a source folder's files, and local data_files."""
    source = dataset.source
    if not isinstance(source, str) or not source:
        return []
    path = Path(resolve_source(source)).expanduser()
    found: list[Path] = []
    if path.is_file():
        found.append(path)
    elif path.is_dir():
        found += sorted(p for p in path.rglob("*") if p.is_file()  # not .git/, .cache/ (hf download's metadata)
                        and not any(part.startswith(".") for part in p.relative_to(path).parts))[:_MAX_FILES]
    found += [p for _, _, named in local_data_files(source, dataset.data_files) for p in named if p.is_file()]
    return found


def data_identity(cfg: Any) -> dict[str, str]:
    """`{resolved path: fingerprint}` of every local file the config's dataset sections read (any nesting)."""
    from .dataset import DatasetConfig

    sections: list[Any] = []

    def walk(obj: Any) -> None:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, DatasetConfig):
                sections.append(value)
            elif is_dataclass(value) and not isinstance(value, type):
                walk(value)

    if is_dataclass(cfg) and not isinstance(cfg, type):
        walk(cfg)
    return {str(p.resolve()): _fingerprint(p) for d in sections for p in _files(d) if p.exists()}


def data_changes(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """What differs between two `data_identity` records, a phrase per file: `PATH (other contents)`, or why else."""
    out = []
    for path in sorted(set(recorded) | set(now)):
        old, new = recorded.get(path), now.get(path)
        if old == new:
            continue
        if old is None or new is None:
            how = "not read at the run's start" if old is None else "read at the start, not now"
        elif old.startswith("size") or new.startswith("size"):  # large files: size and time, not contents
            how = "size or modification time changed"
        else:
            how = "other contents"
        out.append(f"{path} ({how})")
    return out
