"""Read and write Hugging Face checkpoint folders (safetensors, single file or sharded with an index)."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..checkpoint import atomic_directory
from ..checkpoint.stream_save import Deferred, save_tensors
from ..errors import RecipeError

# Files that travel with the weights so the folder is self-contained for transformers, lm-eval and us.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
INDEX_FILE = "model.safetensors.index.json"


def load_hf_state_dict(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder: model.safetensors, sharded safetensors, or (weights_only) pytorch_model.bin."""
    d = Path(ckpt_dir)
    try:
        if (d / "model.safetensors").is_file():
            return load_file(d / "model.safetensors")
        if (d / INDEX_FILE).is_file():
            index = json.loads((d / INDEX_FILE).read_text())
            sd: dict[str, torch.Tensor] = {}
            for shard in sorted(set(index["weight_map"].values())):
                if not (d / shard).is_file():
                    raise RecipeError(f"{d / INDEX_FILE}: shard {shard} is missing")
                sd.update(load_file(d / shard))
            return sd
    except SafetensorError as e:
        raise RecipeError(f"{d}: cannot read safetensors ({e})") from None
    if (d / "pytorch_model.bin").is_file():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise RecipeError(f"{d}: no model.safetensors, {INDEX_FILE} or pytorch_model.bin")


def safetensors_headers(ckpt_dir: str | Path) -> dict[str, tuple[Path, int, dict]] | None:
    """`{tensor name: (file, byte offset of the file's data, header entry)}` from the safetensors headers of a HF
    folder (no tensor data is read), or None when the folder has no safetensors or a header cannot be read
    (loading then reports it)."""
    d = Path(ckpt_dir)
    if (d / "model.safetensors").is_file():
        files = [d / "model.safetensors"]
    elif (d / INDEX_FILE).is_file():
        try:
            files = [d / s for s in sorted(set(json.loads((d / INDEX_FILE).read_bytes())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
    else:
        return None
    entries: dict[str, tuple[Path, int, dict]] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                if n > 100 * 1024**2:
                    return None
                header = json.loads(fh.read(n))
        except (OSError, struct.error, ValueError):
            return None
        if not isinstance(header, dict):
            return None
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict) and isinstance(info.get("shape"), list):
                entries[name] = (f, 8 + n, info)
    return entries


def safetensors_shapes(ckpt_dir: str | Path) -> dict[str, tuple[str, list[int]]] | None:
    """`{tensor name: (file, shape)}` from the safetensors headers of a HF folder, or None (safetensors_headers)."""
    entries = safetensors_headers(ckpt_dir)
    return None if entries is None else {k: (str(f), info["shape"]) for k, (f, _, info) in entries.items()}


def copy_tokenizer_files(tokenizer_dir: str | Path | None, out_dir: Path) -> None:
    """Copy the tokenizer/generation files that exist in `tokenizer_dir` into `out_dir`."""
    if tokenizer_dir is None:
        return
    for name in TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)


def _shards(sd: dict[str, torch.Tensor | Deferred], max_shard_bytes: int) -> list[dict[str, torch.Tensor | Deferred]]:
    shards: list[dict[str, torch.Tensor | Deferred]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    return shards


def write_hf_folder(
    out_dir: str | Path | None,
    hf_state_dict: Mapping[str, torch.Tensor | Deferred],
    config: dict,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    extra_files: dict[str, str] | None = None,
) -> Path | None:
    """Write config, weights (sharded above `max_shard_bytes`) and tokenizer files atomically. The tensors may be
    on any device, or Deferred: they are streamed to the files (stream_save), never gathered on the host.
    `out_dir=None`: nothing is written, each Deferred is made in the writer's order (`save_tensors`)."""
    sd = dict(hf_state_dict)
    if out_dir is None:
        for shard in _shards(sd, max_shard_bytes):
            save_tensors(None, shard)
        return None
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        shards = _shards(sd, max_shard_bytes)
        if len(shards) == 1:
            save_tensors(tmp / "model.safetensors", shards[0], metadata={"format": "pt"})
        else:
            weight_map = {}
            total = 0
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_tensors(tmp / name, shard, metadata={"format": "pt"})
                for k, v in shard.items():
                    weight_map[k] = name
                    total += v.numel() * v.element_size()
            (tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(tokenizer_dir, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return out_dir


_FICLONE = 0x40049409  # Linux's ioctl: a file that shares another's blocks until either is written (copy-on-write)


class _NoClones(Exception):
    pass


def _clone(src: Path, dst: Path) -> bool:
    """`dst` as a copy-on-write clone of `src` (btrfs, XFS, ZFS 2.2+: no byte written twice); False where the
    filesystem has none. Never a hard link: editing one file must not change the other (a checkpoint's manifest
    would no longer match it)."""
    try:
        import fcntl
    except ImportError:  # not Linux
        return False
    with open(src, "rb") as r, open(dst, "wb") as w:
        # Any refusal is "no clone": none on this filesystem (ext4, tmpfs, across two), or not this one now (OpenZFS
        # answers EAGAIN for blocks not yet synced, as a checkpoint's written seconds before): the caller streams
        # the weights from the model instead, which always works.
        try:
            fcntl.ioctl(w.fileno(), _FICLONE, r.fileno())
        except OSError:
            return False
    return True


def clone_hf_folder(src: str | Path, out_dir: str | Path, skip: tuple[str, ...] = (),
                    extra_files: dict[str, str] | None = None) -> bool:
    """`out_dir` (atomically) as clones of the HF folder in `src` (its top-level files but `skip`, e.g. a checkpoint's
    manifest) plus `extra_files`; False, with nothing written, where the filesystem cannot clone. Not a copy then:
    streaming the weights from the model again (stream_save) took 10 s for 15 GB on one H200's ext4 disk where a
    kernel copy of the same files took 15-19 s (docs/benchmarks.md, session 50)."""
    try:
        with atomic_directory(out_dir) as tmp:
            for f in sorted(Path(src).iterdir()):
                if f.is_file() and f.name not in skip and not _clone(f, tmp / f.name):
                    raise _NoClones
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
    except _NoClones:
        return False
    return True
