"""Checkpoints: atomic directory writes, file checksums (manifest) and recipe state (optimizer, scheduler, data position, RNG) save/resume."""

from .atomic import atomic_directory, atomic_write_bytes
from .manifest import verify_manifest, write_manifest
from .state import (
    capture_rng,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_recipe_state,
    restore_rng,
    save_checkpoint,
    write_recipe_state,
)

__all__ = [
    "atomic_directory",
    "atomic_write_bytes",
    "capture_rng",
    "checkpoint_dir",
    "latest_checkpoint",
    "list_checkpoints",
    "load_recipe_state",
    "restore_rng",
    "save_checkpoint",
    "verify_manifest",
    "write_manifest",
    "write_recipe_state",
]
