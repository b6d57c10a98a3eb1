"""Writing the offline-teacher cache: shard by shard, atomically, resumable after kill -9, one writer per rank.

Shard i holds dataset items [i * items_per_shard, (i + 1) * items_per_shard) and is written by rank
i % world_size. Each shard is encoded in memory, written to a temp file, fsynced and renamed into place; only
then is it recorded (with its size and sha256): in ``manifest.json`` on one process, in ``manifest.rank{r}.json``
under torchrun (rank 0 merges them at the end, and at the start of a resumed run). A rerun keeps the recorded
shards whose size and checksum still match and writes the others again, which gives the same bytes: a shard's
batches are fixed by the shard's items.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from ..checkpoint.atomic import atomic_write_bytes
from ..errors import RecipeError
from .manifest import (
    FORMAT,
    MANIFEST,
    bytes_per_token,
    first_difference,
    read_manifest,
    shard_name,
    shard_problem,
    write_manifest,
)

_RECORDS = ("shards", "complete", "tokens", "bytes_per_token")  # what changes as shards are written


def _rank_files(out: Path) -> list[Path]:
    return sorted(out.glob("manifest.rank*.json"))


def _known_records(out: Path) -> dict[str, dict]:
    records: dict[str, dict] = {}
    for path in [out / MANIFEST, *_rank_files(out)]:
        if path.is_file():
            records.update(read_manifest(path).get("shards", {}))
    return records


class CacheWriter:
    """``for i in writer.todo(): writer.write(i, ...)`` then ``writer.finish()``; see the module docstring."""

    def __init__(self, out_dir: str | Path, header: dict[str, Any], rt) -> None:
        self.out = Path(out_dir)
        self.rt = rt
        self.header = {"format": FORMAT, **header}
        self.out.mkdir(parents=True, exist_ok=True)
        for path in [self.out / MANIFEST, *_rank_files(self.out)]:  # every rank checks: all fail alike
            if path.is_file():
                old, new = {"mode": "topk", **_flat(read_manifest(path))}, _flat(self.header)
                key = first_difference(old, new, sorted(set(old) | set(new)))
                if key is not None:
                    hint = (f"pass cache.mode={old.get(key)} to continue it, or " if key == "mode" else "")
                    raise RecipeError(f"output_dir={self.out} holds a cache of another run ({key}: "
                                      f"{old.get(key)!r} there, {new.get(key)!r} now); "
                                      f"{hint}pick another output_dir or delete it")
        if rt.is_main:  # merge what earlier (killed) runs recorded, keeping only intact shards
            intact = {i: r for i, r in _known_records(self.out).items() if shard_problem(self.out, r) is None}
            self._write(self.out / MANIFEST, intact)
            for path in _rank_files(self.out):
                path.unlink()
        rt.barrier()
        self.records: dict[str, dict] = dict(read_manifest(self.out / MANIFEST)["shards"])
        self.new: dict[str, dict] = {}

    def todo(self) -> list[int]:
        """This rank's shards that are not written yet."""
        n = self.header["num_shards"]
        return [i for i in range(self.rt.rank, n, self.rt.world_size) if str(i) not in self.records]

    def items(self, shard: int) -> range:
        per = self.header["items_per_shard"]
        return range(shard * per, min((shard + 1) * per, self.header["num_items"]))

    def write(self, shard: int, rows: dict[str, torch.Tensor], counts: list[int]) -> None:
        """Write shard `shard`: its rows' tensors (manifest.py's ``encode_topk`` or ``encode_sampled``) and the
        number of rows of each of its items."""
        offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
        tensors = {**rows, "offsets": offsets}
        # One metadata key: safetensors keeps metadata in a hash map, so several keys come out in any order.
        data = safetensors_bytes(tensors, metadata={"format": FORMAT})
        atomic_write_bytes(self.out / shard_name(shard), data)
        record = {"file": shard_name(shard), "items": [self.items(shard).start, self.items(shard).stop],
                  "tokens": int(offsets[-1]), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.new[str(shard)] = record
        if self.rt.world_size == 1:
            self.records[str(shard)] = record
            self._write(self.out / MANIFEST, self.records)
        else:
            self._write(self.out / f"manifest.rank{self.rt.rank}.json", self.new)

    def finish(self) -> dict:
        """Merge every rank's records into manifest.json (rank 0) and mark it complete; returns the manifest."""
        self.rt.barrier()
        if self.rt.is_main:
            records = _known_records(self.out)
            missing = [i for i in range(self.header["num_shards"]) if str(i) not in records]
            if missing:
                raise RecipeError(f"{self.out}: shards {missing[:5]} were not written; rerun to finish the cache")
            self._write(self.out / MANIFEST, records, complete=True)
            for path in _rank_files(self.out):
                path.unlink()
        self.rt.barrier()
        return read_manifest(self.out / MANIFEST)

    def _write(self, path: Path, records: dict[str, dict], complete: bool = False) -> None:
        tokens = sum(r["tokens"] for r in records.values())
        size = sum(r["bytes"] for r in records.values())
        write_manifest(path, {**self.header, "shards": dict(sorted(records.items(), key=lambda kv: int(kv[0]))),
                              "complete": complete, "tokens": tokens,
                              "bytes_per_token": round(size / tokens, 2) if tokens else None,
                              "payload_bytes_per_token": _payload(self.header)})


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "shards":
            out.update(_flat(v, f"{prefix}{k}."))
        elif (prefix + k) not in _RECORDS and k != "payload_bytes_per_token":
            out[prefix + k] = json.loads(json.dumps(v))
    return out


def _payload(header: dict) -> int:
    """Payload bytes per token (a sampled cache: the most, with every draw distinct)."""
    if header.get("mode", "topk") == "topk":
        return bytes_per_token(header["top_k"], "topk")
    return bytes_per_token(header["samples"], "sampled")


def item_uniforms(seed: int, item: int, rows: int, samples: int) -> torch.Tensor:
    """The uniforms [rows, samples] (fp64, CPU) that a sampled cache draws dataset item `item`'s rows with: one
    generator per item, seeded from the run seed and the item, so a cache is reproducible whatever the device,
    batch size or chunking, and a rerun shard is the same bytes."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{item}".encode()).digest()[:8], "little") >> 1
    return torch.rand((rows, samples), generator=torch.Generator().manual_seed(key), dtype=torch.float64)


@torch.inference_mode()
def teacher_rows(hidden: torch.Tensor, project, labels: torch.Tensor, encode: Callable[..., tuple], vocab: int,
                 num_chunks: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """``encode(logits, i, j)`` of the teacher's rows with a target (rows i..j of them in the batch), chunk by
    chunk, in row-major order: ``teacher_topk`` or ``teacher_samples`` (losses/topk.py, losses/sampled.py)."""
    h = hidden.flatten(0, 1)[labels.flatten() != -100]
    rows = max(1, -(-h.shape[0] // max(1, num_chunks)))
    for i in range(0, h.shape[0], rows):
        logits = project(h[i:i + rows])[:, :vocab]
        yield encode(logits, i, i + logits.shape[0])
