"""Writing the offline-teacher cache: shard by shard, atomically, resumable after kill -9, one writer per rank.

Shard i holds dataset items [i * items_per_shard, (i + 1) * items_per_shard) and is written by rank
i % world_size. Each shard is encoded in memory, written to a temp file, fsynced and renamed into place; only
then is it recorded (with its size and sha256): in ``manifest.json`` on one process, in ``manifest.rank{r}.json``
under torchrun (rank 0 merges them at the end, and at the start of a resumed run). A rerun keeps the recorded
shards whose size and checksum still match and writes the others again, which gives the same bytes: a shard's
batches are fixed by the shard's items.

A folder holding a cache built with other settings is refused, naming each setting that differs
(`settings_differences`), unless ``overwrite``: see `CacheWriter` for how the old cache is replaced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from ..checkpoint.atomic import atomic_write_bytes
from ..errors import RecipeError
from ..set_aside import discard, put_back, set_aside, set_aside_folders
from .manifest import (
    FORMAT,
    MANIFEST,
    bytes_per_token,
    first_difference,
    read_manifest,
    shard_name,
    shard_problem,
    show_value,
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
    """``for i in writer.todo(): writer.write(i, ...)`` then ``writer.finish()``; see the module docstring.

    ``overwrite``: a cache already in the folder (of any settings) is replaced. Its files are set aside first, by
    renames into a hidden folder in ``out`` (instant, no second copy on disk, and nothing of the old cache is left
    under a name the new build reads); they are deleted once this build has written its first shard. Until then
    the old cache is not lost: an error or Ctrl-C puts it back at once (``put_back``, which the recipe calls),
    and after a kill -9 the next writer in the folder puts it back (``_settle_set_aside``). Building into a
    temporary folder and swapping at the end would keep the old cache longer, but a killed build could then not
    be continued by the same command, which is what every other interrupted build does.
    """

    def __init__(self, out_dir: str | Path, header: dict[str, Any], rt, overwrite: bool = False) -> None:
        self.out = Path(out_dir)
        self.rt = rt
        self.header = {"format": FORMAT, **header}
        self.overwrite = overwrite
        self.set_aside: Path | None = None  # the old cache's files while overwrite=true may still put them back
        self.replaced: dict[str, Any] | None = None  # what the set-aside manifest said (shards, complete), for notes
        self._first_write_done = False
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            if rt.is_main:
                _settle_set_aside(self.out)
                if overwrite:
                    self._set_aside()
            rt.barrier()  # every rank sees the folder as rank 0 left it
            self._check_same_settings()
            if rt.is_main:  # merge what earlier (killed) runs recorded, keeping only intact shards
                intact = {i: r for i, r in _known_records(self.out).items() if shard_problem(self.out, r) is None}
                self._write(self.out / MANIFEST, intact)
                for path in _rank_files(self.out):
                    path.unlink()
            rt.barrier()
            self.records: dict[str, dict] = dict(read_manifest(self.out / MANIFEST)["shards"])
        except BaseException:
            self.put_back()
            raise
        self.new: dict[str, dict] = {}

    def _check_same_settings(self) -> None:
        """RecipeError naming every setting of this build that differs from the cache in the folder (every rank
        checks: all fail alike)."""
        for path in [self.out / MANIFEST, *_rank_files(self.out)]:
            if path.is_file():
                diffs = settings_differences(read_manifest(path), self.header)
                if diffs:
                    raise RecipeError(f"output_dir={self.out} holds a cache built with other settings ("
                                      f"{'; '.join(diffs)}): overwrite=true replaces it; or choose another "
                                      "output_dir, or build with the cache's values to continue or keep it")

    def _set_aside(self) -> None:
        """Move the cache's files (and leftovers of killed atomic writes) into a hidden folder in `out`."""
        files = _cache_files(self.out)
        if not files:
            return
        manifest = self.out / MANIFEST
        try:
            old = read_manifest(manifest) if manifest.is_file() else {}
        except RecipeError:  # unreadable: replaced all the same
            old = {}
        self.replaced = {"shards": len(old.get("shards", {})), "num_shards": old.get("num_shards"),
                         "complete": bool(old.get("complete"))}
        self.set_aside = set_aside(self.out, files, SET_ASIDE)

    def put_back(self) -> bool:
        """After a build that stopped before its first shard: its files go and the cache `overwrite` set aside
        comes back as it was. True when there was something to put back (rank 0; a no-op once a shard is
        written)."""
        aside, self.set_aside = self.set_aside, None
        if aside is None or not aside.is_dir() or _has_shards(self.out):
            return False
        put_back(self.out, aside, _cache_files(self.out))
        return True

    def _replacing_done(self) -> None:
        """Called by every rank once, before its first shard is written (or in `finish` when it writes none): all
        ranks wait here, so no shard is written while rank 0 may still put the old cache back."""
        if self._first_write_done:
            return
        self._first_write_done = True
        if self.overwrite:
            self.rt.barrier()

    def todo(self, rank: int | None = None) -> list[int]:
        """This rank's (or `rank`'s) shards that are not written yet."""
        n, rank = self.header["num_shards"], self.rt.rank if rank is None else rank
        return [i for i in range(rank, n, self.rt.world_size) if str(i) not in self.records]

    def every_rank_has_work(self) -> bool:
        """Whether every rank has a shard to write (every rank reads the same records): only then may the ranks
        with work run a collective among themselves."""
        return all(self.todo(r) for r in range(self.rt.world_size))

    def items(self, shard: int) -> range:
        per = self.header["items_per_shard"]
        return range(shard * per, min((shard + 1) * per, self.header["num_items"]))

    def write(self, shard: int, rows: dict[str, torch.Tensor], counts: list[int]) -> None:
        """Write shard `shard`: its rows' tensors (manifest.py's ``encode_topk`` or ``encode_sampled``) and the
        number of rows of each of its items."""
        self._replacing_done()
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
        self._discard_set_aside()

    def _discard_set_aside(self) -> None:
        """Delete the cache `overwrite` set aside: this build has written a shard (rank 0)."""
        aside, self.set_aside = self.set_aside, None
        discard(aside)

    def finish(self) -> dict:
        """Merge every rank's records into manifest.json (rank 0) and mark it complete; returns the manifest."""
        self._replacing_done()
        self.rt.barrier()
        self._discard_set_aside()
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


SET_ASIDE = ".overwritten-cache-"  # prefix of the hidden folder an overwritten cache waits in
_SHARD_GLOB = "shard_*.safetensors"


def _cache_files(out: Path) -> list[Path]:
    """What a cache build writes in `out`: shards, manifests, and the temp files of killed atomic writes."""
    patterns = (_SHARD_GLOB, MANIFEST, "manifest.rank*.json", ".shard_*.safetensors.tmp-*", ".manifest*.json.tmp-*")
    return sorted({p for pattern in patterns for p in out.glob(pattern) if p.is_file()})


def _has_shards(out: Path) -> bool:
    return any(out.glob(_SHARD_GLOB))


def _settle_set_aside(out: Path) -> None:
    """What a killed overwrite=true build left in `out`: the cache it set aside comes back when the build wrote no
    shard, and is deleted when it did (the new cache then holds shards that a rerun continues)."""
    for aside in set_aside_folders(out, SET_ASIDE):
        if _has_shards(out):
            discard(aside)
        else:
            put_back(out, aside, _cache_files(out))
            print(f"note: {out}: a build with overwrite=true was stopped before it wrote a shard: the cache it was "
                  "replacing is back", flush=True)


# Manifest fields (flattened) -> the config key that sets them. Fields not named here follow from the others
# (num_items, num_shards, vocab_size, data_sha256, ...) and are reported only when no named one differs.
_SETTING = {"mode": "cache.mode", "top_k": "cache.top_k", "samples": "cache.samples", "sample_seed": "seed",
            "temperature": "cache.temperature", "run.temperature": "cache.temperature",
            "items_per_shard": "cache.items_per_shard", "teacher.quantize": "teacher.quantize",
            "teacher.max_drift": "teacher.max_drift", "teacher.dtype": "dtype",
            "teacher.fingerprint": "teacher.checkpoint_dir (config.json + weights fingerprint)",
            "run.tokenizer": "tokenizer_dir (tokenizer.json + chat template fingerprint)"}
_FOLLOWS = {"run.data_sha256": "the tokenized transfer set (sha256)", "num_items": "dataset items",
            "num_shards": "shards"}


def _setting(key: str) -> str | None:
    if key.startswith("run.dataset."):
        return key[len("run."):]
    if key.startswith("teacher.config."):
        return _SETTING["teacher.fingerprint"]
    return _SETTING.get(key)


def settings_differences(cached: Mapping[str, Any], header: Mapping[str, Any]) -> list[str]:
    """``key: <cached> in the cache, <now> now`` for each config key whose value differs between a cache's
    manifest and a new build's header (each key once; fields that only follow from other keys, such as the item
    count, only when no key differs)."""
    old, new = {"mode": "topk", **_flat(dict(cached))}, _flat(dict(header))  # caches before cache.mode: top-k
    fields = [k for k in sorted(set(old) | set(new)) if first_difference(old, new, [k]) is not None]
    named: dict[str, str] = {}
    for k in fields:
        setting = _setting(k)
        # a field only one side has comes with another that both have (cache.top_k with cache.mode, ...)
        if setting is not None and setting not in named and k in old and k in new:
            fp = k if not k.startswith("teacher.config.") else "teacher.fingerprint"
            named[setting] = f"{setting}: {show_value(old.get(fp))} in the cache, {show_value(new.get(fp))} now"
    if named:
        return list(named.values())
    return [f"{_FOLLOWS.get(k, k)}: {show_value(old.get(k))} in the cache, {show_value(new.get(k))} now" for k in fields]


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
    generator per item, seeded from the run seed and the item: the same numbers whatever the device, batch size or
    chunking, so a rerun shard is the same bytes, and another batch shape moves only the draws that its float
    rounding of the logits moves across a CDF boundary (15 of 9,024 on the CPU, tests/test_logits_cache.py)."""
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
