"""Write a safetensors file straight from tensors on any device, one chunk at a time: the counterpart of
models/stream_load.py's reader.

Why not `safetensors.torch.save_file`: it needs every tensor in host memory at once, so a checkpoint of a model on
a GPU first copied all of it to the host (pageable copies, one tensor after another) and, to merge LoRA adapters,
cloned that copy again: a 7B LoRA checkpoint held twice its 15 GB in host memory and spent 20 of its 31 s on
those copies (bench/checkpoint_speed.py, one H200). Here a GPU tensor's bytes pass through two small pinned
buffers, each written to the file while the next one is copied, and a `Deferred` tensor (a merged LoRA weight,
a dequantized base) is made on its device only when its turn comes, so host memory never holds more than a chunk.

The format (huggingface/safetensors, README "Format"): an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` padded with spaces to a multiple of 8, then the
tensors' bytes back to back. Tensors are laid out by decreasing item size, so each starts aligned to its own.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK_BYTES = 16 << 20  # per pinned buffer (two): as stream_load's reader

# torch dtype -> safetensors' name for it
_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


@dataclass(frozen=True)
class Deferred:
    """A tensor of known shape and dtype that `make()` computes only when it is written (a LoRA weight merged on
    its device, an NF4 base dequantized): a whole model of them never exists at once."""
    shape: torch.Size
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def to(self, dtype: torch.dtype) -> Deferred:
        make = self.make
        return Deferred(self.shape, dtype, lambda: make().to(dtype))


def made(t: torch.Tensor | Deferred) -> torch.Tensor:
    """The tensor itself, or a Deferred's tensor made now."""
    return t.make() if isinstance(t, Deferred) else t


def save_tensors(path: str | Path | None, tensors: Mapping[str, torch.Tensor | Deferred],
                 metadata: Mapping[str, str] | None = None, chunk_bytes: int = CHUNK_BYTES) -> Path | None:
    """Write `tensors` (on any devices, or Deferred) as one safetensors file at `path`, which
    `safetensors.torch.load_file` reads back bit for bit. Nothing of the inputs changes.

    `path=None` writes nothing and only makes each Deferred in the order a write would: the other processes of a
    multi-process save, whose Deferreds gather shards and so must join every collective the writer's make."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    if path is None:
        for name in order:
            made(tensors[name])
        return None
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: safetensors has no dtype for {t.dtype}")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    chunk_bytes -= chunk_bytes % 8
    with open(path, "wb", buffering=0) as f:
        _write_all(f, memoryview(struct.pack("<Q", len(text)) + text))
        staging = _Staging(chunk_bytes)
        try:
            for name in order:
                t = tensors[name]
                value = made(t)
                if tuple(value.shape) != tuple(t.shape) or value.dtype != t.dtype:
                    raise ValueError(f"{name}: made {value.dtype} {list(value.shape)}, declared {t.dtype} {list(t.shape)}")
                raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
                if raw.device.type == "cuda":
                    staging.write(f, raw)
                elif raw.numel():
                    staging.flush(f)  # a GPU tensor's last chunk still in a buffer goes first
                    _write_all(f, memoryview(raw.numpy()))
                del value, raw  # a Deferred's tensor is freed before the next one is made
            staging.flush(f)
        finally:
            staging.wait()
    return Path(path)


def _write_all(f, data: memoryview) -> None:
    # an unbuffered write may take fewer bytes than given (Linux: at most 2 GiB - 4 KiB per call)
    while len(data):
        data = data[f.write(data):]


class _Staging:
    """Two pinned host buffers: a chunk is copied from the GPU into one while the other is written to the file."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.bufs: list[torch.Tensor] = []
        self.pending: tuple[int, int, torch.cuda.Event] | None = None  # (buffer, bytes, its copy's event)
        self.turn = 0

    def write(self, f, raw: torch.Tensor) -> None:
        if not self.bufs:  # pinned only when a GPU tensor comes (CPU-only files need none)
            self.bufs = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        with torch.cuda.device(raw.device) if raw.device.type == "cuda" else nullcontext():
            for pos in range(0, raw.numel(), self.chunk_bytes):
                n = min(self.chunk_bytes, raw.numel() - pos)
                # this buffer was last written to the file synchronously (flush below), so it is free
                self.bufs[self.turn][:n].copy_(raw[pos:pos + n], non_blocking=True)
                done = torch.cuda.Event()
                done.record()
                self.flush(f)
                self.pending = (self.turn, n, done)
                self.turn ^= 1

    def flush(self, f) -> None:
        """Write the chunk still in a buffer, if any."""
        if self.pending is None:
            return
        buf, n, done = self.pending
        self.pending = None
        done.synchronize()
        _write_all(f, memoryview(self.bufs[buf].numpy())[:n])

    def wait(self) -> None:
        """No copy into a buffer is still in flight (after an error too) when the buffers are dropped."""
        if self.pending is not None:
            self.pending[2].synchronize()
            self.pending = None
