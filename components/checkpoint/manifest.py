"""Checksums of every file of a checkpoint folder, written at save time and verified before a resume.

`write_manifest(folder)` hashes every file under `folder` (any layout: an HF folder + recipe_state, or
torch.distributed.checkpoint shards) into `folder/manifest.json`; `verify_manifest(folder)` re-hashes them and
raises a one-line RecipeError naming the first file that is missing, has another size or other bytes. A flipped
byte therefore never loads silently.

The hash is xxHash XXH3-128 (the `xxhash` package): checkpoints of large models hold tens of GB, and XXH3 reads
at memory speed (~5 GB/s on one core) where SHA-256 manages ~0.5-2 GB/s. The manifest guards against corruption
(bad disks, truncated copies, bit flips), not against an attacker who can also rewrite the manifest. Files are
hashed in parallel threads (xxhash releases the GIL on large buffers).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from ..errors import RecipeError

MANIFEST = "manifest.json"
_ALGORITHM = "xxh3_128"
_CHUNK = 16 * 1024 * 1024

__all__ = ["MANIFEST", "file_digest", "verify_manifest", "write_manifest"]


def file_digest(path: str | os.PathLike) -> str:
    """XXH3-128 hex digest of a file's bytes, read in 16 MiB chunks."""
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _files(folder: Path) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel != MANIFEST:
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _digests(folder: Path, names: list[str]) -> list[str]:
    workers = max(1, min(len(names), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda n: file_digest(folder / n), names))


def write_manifest(folder: str | os.PathLike) -> Path:
    """Write `folder/manifest.json`: size and digest of every other file below `folder`. Call it last."""
    folder = Path(folder)
    names = _files(folder)
    entries = {n: {"size": (folder / n).stat().st_size, _ALGORITHM: d} for n, d in zip(names, _digests(folder, names))}
    path = folder / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": 1, "algorithm": _ALGORITHM, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return path


def verify_manifest(folder: str | os.PathLike) -> None:
    """RecipeError naming the first file of `folder` that does not match its manifest (or a missing manifest)."""
    folder = Path(folder)
    path = folder / MANIFEST
    hint = "delete this checkpoint folder to resume from the one before it"
    try:
        meta = json.loads(path.read_text())
        files = meta["files"]
        if meta.get("algorithm") != _ALGORITHM:
            raise RecipeError(f"{path}: checksum algorithm {meta.get('algorithm')!r} is not {_ALGORITHM}")
    except FileNotFoundError:
        raise RecipeError(f"{folder}: no {MANIFEST} (file checksums), so its files cannot be verified; {hint}") \
            from None
    except (ValueError, KeyError, TypeError) as e:
        raise RecipeError(f"{path} is corrupt ({e}); {hint}") from None
    for name, entry in files.items():
        f = folder / name
        if not f.is_file():
            raise RecipeError(f"checkpoint file {f} is missing (listed in {MANIFEST}); {hint}")
        if f.stat().st_size != entry["size"]:
            raise RecipeError(f"checkpoint file {f} is corrupt: {f.stat().st_size} bytes, {entry['size']} "
                              f"when saved; {hint}")
    names = sorted(files)
    for name, digest in zip(names, _digests(folder, names)):
        if digest != files[name][_ALGORITHM]:
            raise RecipeError(f"checkpoint file {folder / name} is corrupt: its checksum differs from the one in "
                              f"{MANIFEST}; {hint}")
