"""What torchrun's environment says about this process, readable before torch.distributed starts: the output
folder's checks, locks and records are made once, by rank 0 (or by the only process)."""

from __future__ import annotations

import os


def is_rank0() -> bool:
    """True for rank 0 under torchrun and for a process started without it (no `RANK` in the environment)."""
    return os.environ.get("RANK", "0") == "0"
