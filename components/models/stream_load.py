"""A HF folder's safetensors bytes straight into a model's GPU tensors: plain reads into pinned host buffers, each
copied to the GPU while the next read runs, a few threads at once.

Why not `safetensors.torch.load_file` and `load_state_dict` (what CPU builds still use): that copies from a memory
map through the CUDA driver's pageable path, one tensor after another, faulting the map in 4 KiB pages on the way.
bench/weights_load_speed.py measures both on the 8B teacher's 16 GB (docs/benchmarks.md, issue 19).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import RecipeError
from .hf_io import safetensors_headers

# safetensors' dtype names (the ones a checkpoint of ours or of the Hub holds)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
CHUNK_BYTES = 16 << 20  # per pinned buffer, two per thread: pinning more host memory costs more than it saves
MAX_THREADS = 8  # 16 GB on one H200 host: 1 thread 3.1 s, 2: 1.6 s, 4: 1.1-1.4 s, 8: 0.6-1.0 s


def default_threads() -> int:
    """Up to MAX_THREADS, sharing the host's cores with the other ranks of this node (torchrun's LOCAL_WORLD_SIZE),
    which read their copies at the same time."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(MAX_THREADS, (os.cpu_count() or 1) // ranks))


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: `nbytes` from byte `start` of `path`."""
    path: Path
    start: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def stored_tensors(ckpt_dir: str | Path) -> dict[str, StoredTensor] | None:
    """Every tensor of a HF folder's safetensors, by name, from the headers; None when the folder has no
    safetensors, a header cannot be read or holds a dtype this reader does not know (the caller loads it the
    usual way, which reports what is wrong)."""
    entries = safetensors_headers(ckpt_dir)
    if entries is None:
        return None
    out = {}
    for name, (path, data_start, info) in entries.items():
        dtype = _DTYPES.get(info.get("dtype"))
        offsets = info.get("data_offsets")
        if dtype is None or not (isinstance(offsets, list) and len(offsets) == 2):
            return None
        out[name] = StoredTensor(path, data_start + offsets[0], offsets[1] - offsets[0], dtype, tuple(info["shape"]))
    return out


def read_into(targets: dict[str, torch.Tensor], stored: dict[str, StoredTensor], threads: int | None = None,
              chunk_bytes: int = CHUNK_BYTES) -> None:
    """Fill each contiguous tensor `targets[name]` (all on one device) from `stored[name]`: same shape, the dtype
    converted on that device when it differs. The tensors are split by bytes into `threads` (default_threads())
    runs in file order, one thread, CUDA stream and pair of pinned buffers each (host tensors: plain buffers, no
    stream). Raises RecipeError naming the tensor on a shape mismatch or a short file."""
    if chunk_bytes < 8:
        raise ValueError(f"chunk_bytes {chunk_bytes}: need at least 8")
    devices = {t.device for t in targets.values()}
    if len(devices) > 1:
        raise ValueError(f"read_into fills tensors of one device, not {sorted(map(str, devices))}")
    for name, s in stored.items():
        t = targets[name]
        if not t.is_contiguous():
            raise ValueError(f"read_into fills contiguous tensors; {name} is not one")
        if tuple(t.shape) != s.shape:
            raise RecipeError(f"{s.path}: {name} has shape {list(s.shape)}, the model expects {list(t.shape)}")
        if s.nbytes != t.numel() * s.dtype.itemsize:
            raise RecipeError(f"{s.path}: {name} holds {s.nbytes} bytes, {list(s.shape)} {s.dtype} needs "
                              f"{t.numel() * s.dtype.itemsize}")
    threads = default_threads() if threads is None else threads
    order = sorted(stored, key=lambda n: (str(stored[n].path), stored[n].start))
    total = sum(stored[n].nbytes for n in order)
    runs: list[list[str]] = [[] for _ in range(max(1, threads))]
    done = 0
    for name in order:  # contiguous runs of about total / threads bytes: each thread reads its part of the files
        runs[min(len(runs) - 1, done * len(runs) // max(1, total))].append(name)
        done += stored[name].nbytes
    runs = [r for r in runs if r]
    if not runs:
        return
    device = targets[order[0]].device
    after = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the caller's: it built them
    failures: list[BaseException] = []
    lock = threading.Lock()
    failed = threading.Event()  # the other threads stop at their next chunk

    def read_run(names: list[str]) -> None:
        try:  # under the targets' GPU: a new thread's current GPU is 0, where another rank would open a context
            with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                _read_run(names, targets, stored, device, chunk_bytes, after, failed)
        except BaseException as e:  # re-raised below, in the caller's thread
            failed.set()
            with lock:
                failures.append(e)

    if len(runs) == 1:
        read_run(runs[0])
    else:
        with ThreadPoolExecutor(len(runs)) as pool:
            list(pool.map(read_run, runs))
    if failures:
        raise failures[0]


def _read_run(names: list[str], targets: dict[str, torch.Tensor], stored: dict[str, StoredTensor],
              device: torch.device, chunk_bytes: int, after: torch.cuda.Stream | None,
              failed: threading.Event) -> None:
    chunk_bytes -= chunk_bytes % 8  # whole elements of any dtype in every chunk
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in bufs]
    copied: list[torch.cuda.Event | None] = [None, None]
    turn = 0
    files: dict[Path, BinaryIO] = {}
    if stream is not None:
        stream.wait_stream(after)  # the targets' initialisation is done before we write
    try:
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for name in names:
                s, target = stored[name], targets[name]
                if s.path not in files:
                    files[s.path] = open(s.path, "rb", buffering=0)  # noqa: SIM115 (closed below, with the others)
                f = files[s.path]
                f.seek(s.start)
                flat = target.view(-1)
                raw = flat.view(torch.uint8) if target.dtype == s.dtype else None
                staging = None if raw is not None else torch.empty(chunk_bytes // s.dtype.itemsize,
                                                                   dtype=s.dtype, device=device)
                pos = 0
                while pos < s.nbytes:
                    if failed.is_set():
                        return
                    n = min(chunk_bytes, s.nbytes - pos)
                    if copied[turn] is not None:
                        copied[turn].synchronize()  # this buffer's previous copy has left it
                    got = 0
                    while got < n:
                        k = f.readinto(views[turn][got:n])
                        if not k:
                            raise RecipeError(f"{s.path}: ends inside {name} (truncated file?)")
                        got += k
                    if raw is not None:
                        raw[pos:pos + n].copy_(bufs[turn][:n], non_blocking=cuda)
                    else:  # through a buffer of the stored dtype on the target's device, converted by the second copy
                        m = n // s.dtype.itemsize
                        staging.view(torch.uint8)[:n].copy_(bufs[turn][:n], non_blocking=cuda)
                        e0 = pos // s.dtype.itemsize
                        flat[e0:e0 + m].copy_(staging[:m])
                    if stream is not None:
                        copied[turn] = torch.cuda.Event()
                        copied[turn].record(stream)
                    pos += n
                    turn ^= 1
    finally:
        if stream is not None:
            stream.synchronize()  # no copy of ours is still in flight when read_into returns or raises
        for f in files.values():
            f.close()
