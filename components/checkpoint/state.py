"""Recipe state: save a resumable checkpoint (HF model folder + `recipe_state/`) and find/load the latest one.

Layout of `output_dir/checkpoints/step_000100/`:
- whatever `write_model(dir)` writes (an HF folder);
- `recipe_state/tensors.safetensors`: every tensor of the recipe state (optimizer moments, RNG states, ...);
- `recipe_state/state.json`: the nested structure, with references into the safetensors file;
- `manifest.json`: size and checksum of every file above (llm_recipe.components.checkpoint.manifest), checked on resume.

The structure is encoded in JSON with small tagged objects for what JSON lacks (tuples, int dict keys, numpy
arrays, dtypes) and for torchao's low-bit optimizer states (tensor subclasses), which are flattened into
their plain inner tensors with `__tensor_flatten__` and rebuilt with `__tensor_unflatten__`. Only an allow-list
of subclasses is rebuilt, so loading never imports an arbitrary class named in a file. Python objects that
none of this covers go to `objects.pt` (torch.save) and are read back with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from ..errors import RecipeError
from .atomic import atomic_directory
from .manifest import write_manifest
from .stream_save import save_tensors

STATE_DIR = "recipe_state"
_TENSORS = "tensors.safetensors"
_JSON = "state.json"
_OBJECTS = "objects.pt"
_FORMAT = 1
_STEP_RE = re.compile(r"^step_(\d+)$")

# Tensor subclasses that may appear in optimizer state and that load_recipe_state will rebuild.
_SUBCLASSES = {
    "torchao.optim.subclass_8bit.OptimState8bit",
    "torchao.optim.subclass_4bit.OptimState4bit",
    "torchao.optim.subclass_fp8.OptimStateFp8",
}


# ---------------------------------------------------------------------------------------------- encoding
class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.objects: dict[str, Any] = {}

    def tensor(self, t: torch.Tensor) -> str:
        # kept where it is (a GPU's optimizer moments too): save_tensors streams each one's bytes to the file, so
        # neither a host copy of them all nor tensors sharing memory need handling here
        key = f"t{len(self.tensors)}"
        self.tensors[key] = t.detach()
        return key

    def encode(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            cls = type(obj)
            name = f"{cls.__module__}.{cls.__qualname__}"
            if cls is torch.Tensor or cls is torch.nn.Parameter:
                return {"__tensor__": self.tensor(obj)}
            if name in _SUBCLASSES:
                attrs, ctx = obj.__tensor_flatten__()
                return {
                    "__subclass__": name,
                    "tensors": {a: self.tensor(getattr(obj, a)) for a in attrs},
                    "ctx": self.encode(list(ctx)),
                    "size": list(obj.shape),
                    "stride": list(obj.stride()),
                }
            return self._object(obj)
        if isinstance(obj, torch.dtype):
            return {"__dtype__": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.Size):
            return {"__size__": list(obj)}
        if isinstance(obj, np.ndarray):
            return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, tuple):
            return {"__tuple__": [self.encode(x) for x in obj]}
        if isinstance(obj, list):
            return [self.encode(x) for x in obj]
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
                return {k: self.encode(v) for k, v in obj.items()}
            return {"__items__": [[self.encode(k), self.encode(v)] for k, v in obj.items()]}
        return self._object(obj)

    def _object(self, obj: Any) -> dict[str, str]:
        key = f"o{len(self.objects)}"
        self.objects[key] = obj
        return {"__object__": key}


def _decode(obj: Any, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> Any:
    if isinstance(obj, list):
        return [_decode(x, tensors, objects) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__subclass__" in obj:
        name = obj["__subclass__"]
        if name not in _SUBCLASSES:
            raise RecipeError(
                f"recipe state names tensor type {name!r}, which is not one this version can load"
            )
        module, _, attr = name.rpartition(".")
        cls = getattr(importlib.import_module(module), attr)
        inner = {a: tensors[k] for a, k in obj["tensors"].items()}
        ctx = _decode(obj["ctx"], tensors, objects)
        return cls.__tensor_unflatten__(inner, ctx, torch.Size(obj["size"]), tuple(obj["stride"]))
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    if "__size__" in obj:
        return torch.Size(obj["__size__"])
    if "__ndarray__" in obj:
        return np.array(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
    if "__tuple__" in obj:
        return tuple(_decode(x, tensors, objects) for x in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors, objects): _decode(v, tensors, objects) for k, v in obj["__items__"]}
    if "__object__" in obj:
        return objects[obj["__object__"]]
    return {k: _decode(v, tensors, objects) for k, v in obj.items()}


def write_recipe_state(state_dir: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write `state` (nested dicts/lists of tensors, numbers, strings, numpy arrays) into `state_dir`."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    enc = _Encoder()
    tree = enc.encode(state)
    save_tensors(state_dir / _TENSORS, enc.tensors)
    if enc.objects:
        # Fail now, not at resume time, if something could not be loaded back safely.
        for obj in enc.objects.values():
            try:
                torch.load(io.BytesIO(_saved(obj)), weights_only=True)
            except Exception as e:
                raise TypeError(
                    f"recipe state value of type {type(obj).__name__} cannot be saved so that "
                    "torch.load(weights_only=True) reads it back: convert it to dicts, lists, numbers or tensors"
                ) from e
        (state_dir / _OBJECTS).write_bytes(_saved(enc.objects))
    # state.json is written last: its presence marks a complete recipe_state.
    (state_dir / _JSON).write_text(json.dumps({"format": _FORMAT, "state": tree}))


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_recipe_state(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Load what `save_checkpoint` stored as `recipe_state` (tensors on CPU)."""
    state_dir = Path(ckpt_dir) / STATE_DIR
    meta_path = state_dir / _JSON
    if not meta_path.is_file():
        raise RecipeError(f"{ckpt_dir} is not a complete checkpoint: {meta_path} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{meta_path} is corrupt ({e}): resume from an earlier checkpoint") from e
    if meta.get("format") != _FORMAT:
        raise RecipeError(
            f"{meta_path} has format {meta.get('format')!r}; this version reads format {_FORMAT}"
        )
    tensors = load_file(str(state_dir / _TENSORS))
    objects: dict[str, Any] = {}
    if (state_dir / _OBJECTS).is_file():
        objects = torch.load(state_dir / _OBJECTS, weights_only=True)
    return _decode(meta["state"], tensors, objects)


# --------------------------------------------------------------------------------------------------- RNG
def capture_rng() -> dict[str, Any]:
    """The RNG states of python, numpy, torch (CPU) and the current CUDA device, for `recipe_state["rng"]`.

    Only rank 0's states are saved. That is exact because the runtime seeds every rank identically and ranks
    draw the same random numbers; the CUDA state is that of the rank's *own* device, and it is restored
    into each rank's own device (saving all devices would hand rank 1 rank 0's idle device-1 stream).
    """
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    return rng


def restore_rng(state: dict[str, Any]) -> None:
    """Restore RNG states captured by `capture_rng` (pass the rng dict or a recipe state holding it as "rng")."""
    rng = state.get("rng", state)
    if "python" in rng:
        random.setstate(rng["python"])
    if "numpy" in rng:
        np.random.set_state(rng["numpy"])
    if "torch" in rng:
        torch.set_rng_state(rng["torch"].to(torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].to(torch.uint8))  # the current device (the rank's own)


# ----------------------------------------------------------------------------------------- checkpoints
def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def _is_complete(path: Path) -> bool:
    return (path / STATE_DIR / _JSON).is_file() and (path / STATE_DIR / _TENSORS).is_file()


def list_checkpoints(output_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first; temp dirs and incomplete folders are skipped."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and _is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `output_dir/checkpoints`, or None."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def _remove(path: Path) -> None:
    # Rename first (atomic) so that a crash mid-delete never leaves a half-deleted folder under a step name.
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.del-", dir=path.parent))
    os.rename(path, trash / "x")
    shutil.rmtree(trash, ignore_errors=True)


def check_keep_last_n(keep_last_n: int | None) -> None:
    """`keep_last_n` is null (keep every checkpoint) or >= 1: checked before a save writes anything."""
    if keep_last_n is not None and int(keep_last_n) < 1:
        raise RecipeError(f"keep_last_n={keep_last_n} must be >= 1 (or null to keep every checkpoint)")


def prepare_checkpoints_folder(root: Path) -> None:
    """Create `output_dir/checkpoints` and delete the leftovers of crashed saves and prunes there (hidden temp
    folders `.step_*.tmp-*`, `.old-*`, `.del-*`), which are never valid checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    for p in root.glob(".step_*"):
        if re.search(r"\.(tmp|old|del)-", p.name):
            shutil.rmtree(p, ignore_errors=True)


def prune_checkpoints(output_dir: str | os.PathLike, keep_last_n: int | None, target: Path) -> None:
    """Delete all but the `keep_last_n` newest complete checkpoints, never `target` (the one just written);
    null keeps every one."""
    if keep_last_n is None:
        return
    complete = list_checkpoints(output_dir)
    keep = {p for _, p in complete[-int(keep_last_n) :]} | {target}
    for _, p in complete:
        if p not in keep:
            _remove(p)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    write_model: Callable[[Path], None],
    recipe_state: dict[str, Any],
    keep_last_n: int | None = None,
    runtime: Any = None,
) -> Path:
    """Write `output_dir/checkpoints/step_{step:06d}/` atomically; returns its path on every rank.

    `write_model(tmp_dir)` writes the HF folder; `recipe_state` goes to `recipe_state/`. Only rank 0 writes
    (pass the `Runtime` as `runtime`; every rank calls this and waits at a barrier). Afterwards all but the
    `keep_last_n` newest complete checkpoints are deleted (never the one just written).
    """
    check_keep_last_n(keep_last_n)
    target = checkpoint_dir(output_dir, step)
    is_main = runtime is None or runtime.is_main
    if is_main:
        prepare_checkpoints_folder(target.parent)
        state = {**recipe_state, "step": recipe_state.get("step", step)}
        try:
            with atomic_directory(target) as tmp:
                write_model(tmp)
                write_recipe_state(tmp / STATE_DIR, state)
                write_manifest(tmp)  # last: checksums of every file above, verified before a resume
        except RecipeError as e:
            prev = latest_checkpoint(output_dir)
            raise RecipeError(f"{e}; the newest complete checkpoint is still {prev}" if prev is not None
                              else f"{e}; no checkpoint of this run was written yet") from e
        prune_checkpoints(output_dir, keep_last_n, target)
    if runtime is not None:
        runtime.barrier()
    return target
