"""Checkpoint helpers: atomic directory writes and (in state.py) recipe state save/resume."""

from components.checkpoint.atomic import atomic_directory, atomic_write_bytes

__all__ = ["atomic_directory", "atomic_write_bytes"]
