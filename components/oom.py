"""Out of memory is an answer, not a crash: one line that says where it happened and what to change.

CUDA's `torch.OutOfMemoryError`, a `MemoryError` and the RuntimeError of a failed CPU allocation
("DefaultCPUAllocator: can't allocate memory") are turned by `run_recipe_script` (and `recipe demo`) into
`recipe: error: out of memory ...` with exit status 1: the step and micro-batch shape it happened at (the training
loop records them on the exception: `note_step`), the peak memory so far, the newest checkpoint (left as it
was: nothing is deleted or half-written by the error), and the settings that use less memory, with the values
this run has. metrics.jsonl holds only completed steps: a line is written once a step has finished.
"""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["Where", "is_out_of_memory", "note_step", "out_of_memory_message"]

_CPU_ALLOC = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory", "CUDA error: out of memory")
_WHERE = "_recipe_oom_where"  # attribute set on the exception by the training loop


def is_out_of_memory(err: BaseException) -> bool:
    """True for CUDA / CPU allocation failures (torch.OutOfMemoryError, MemoryError, the allocators' RuntimeError)."""
    if isinstance(err, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(err, oom):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _CPU_ALLOC)


def note_step(err: BaseException, what: str, shape: list[int] | None, device: Any) -> None:
    """Record on `err` where training was (`what`: e.g. "at step 3"), the micro-batch shape and the device;
    the first note wins (the innermost place)."""
    if getattr(err, _WHERE, None) is None:
        try:
            setattr(err, _WHERE, {"what": what, "shape": shape, "device": device})
        except AttributeError:
            pass


class Where:
    """Where a training loop is, for the out-of-memory message: `with Where(device) as where:` around the loop,
    `where.at("at step 3")` as each step starts and `where.shape = [2, 64]` per micro-batch; an out-of-memory error
    leaving the block carries them (`note_step`)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.what: str | None = None
        self.shape: list[int] | None = None

    def at(self, what: str) -> None:
        """The loop is now `what` (e.g. "at step 3"); no micro-batch yet."""
        self.what, self.shape = what, None

    def __enter__(self) -> Where:
        return self

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> None:
        if err is not None and self.what is not None and is_out_of_memory(err):
            note_step(err, self.what, self.shape, self.device)


def _peak(device: Any) -> str:
    torch = sys.modules.get("torch")
    dev = torch.device(device) if torch is not None and device is not None else None
    if dev is None and torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev is not None and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory / 2**30
        return f"peak {torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB of {total:.1f} GiB on {dev}"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss = rss / 2**30 if sys.platform == "darwin" else rss / 2**20
    return f"peak {rss:.1f} GiB resident on the CPU"


def _tried(err: BaseException) -> str:
    """`; it tried to allocate 2.00 GiB` from torch's message (CUDA says GiB, the CPU allocator bytes)."""
    m = re.search(r"[Tt]ried to allocate (\d+) bytes", str(err))
    if m:
        n = int(m.group(1))
        return f"; it tried to allocate {n / 2**30:.2f} GiB" if n >= 2**30 else f"; it tried to allocate {n / 2**20:.0f} MiB"
    m = re.search(r"[Tt]ried to allocate ([0-9.]+ ?[KMGT]i?B)", str(err))
    return f"; it tried to allocate {m.group(1)}" if m else ""


def _get(node: Any, key: str) -> Any:
    """`node[key]` of a mapping (a raw config) or `node.key` of a typed config section; None when it has none."""
    if node is None:
        return None
    return node.get(key) if isinstance(node, Mapping) else getattr(node, key, None)


def _has(node: Any, key: str) -> bool:
    return node is not None and (key in node if isinstance(node, Mapping) else hasattr(node, key))


def _advice(cfg: Any) -> str:
    tips = []
    bs, accum = _get(cfg, "batch_size"), _get(cfg, "gradient_accumulation_steps")
    if isinstance(bs, int) and bs > 1:
        new = bs // 2
        if isinstance(accum, int) and bs % new == 0:
            tips.append(f"batch_size={new} gradient_accumulation_steps={accum * (bs // new)} (the same tokens per "
                        f"step as batch_size={bs} gradient_accumulation_steps={accum})")
        else:
            tips.append(f"a smaller batch_size (now {bs})")
    seq = _get(_get(cfg, "dataset"), "max_seq_len")
    if isinstance(seq, int):
        tips.append(f"a shorter dataset.max_seq_len (now {seq})")
    if _get(cfg, "activation_checkpointing") is False:
        tips.append("activation_checkpointing=true")
    teacher = _get(cfg, "teacher")
    if teacher is not None and _get(teacher, "logits_dir") is None and _has(cfg, "kd"):
        if _get(teacher, "quantize") is None:
            tips.append("teacher.quantize=fp8 (GPU)")
        tips.append("teacher.logits_dir=<a kd_logits cache> (no teacher in memory)")
    return "; use less memory with " + ", ".join(tips) if tips else ""


def out_of_memory_message(err: BaseException, cfg: Any = None) -> str:
    """The one-line message for an out-of-memory `err` of the run configured by `cfg` (a typed config or a raw
    DictConfig; None: no config yet)."""
    where = getattr(err, _WHERE, None) or {}
    training = _has(cfg, "max_steps") and _has(cfg, "output_dir")
    what = where.get("what") or ("while setting up, before step 1" if training else "")
    details = [f"micro-batch {where['shape']}"] if where.get("shape") else []
    details.append(_peak(where.get("device")))
    msg = f"out of memory {what}".rstrip() + f" ({', '.join(details)}{_tried(err)})"
    if training:
        from .checkpoint.state import latest_checkpoint

        ckpt = latest_checkpoint(cfg.output_dir) if Path(str(cfg.output_dir)).is_dir() else None
        if ckpt is not None:
            msg += (f"; the newest checkpoint is still {ckpt} (resume=true continues from it with the same batch_size "
                    "and data; overwrite=true starts over)")
        else:
            msg += "; no checkpoint was written"
    return msg + _advice(cfg)
