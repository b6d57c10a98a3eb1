"""Training from the offline-teacher cache: open and verify it, check it matches the run, and add the cached
teacher targets to each batch, beside the labels: a top-k cache's ``teacher_logp [b, s, k + 1]`` and
``teacher_ids [b, s, k]``, a sampled cache's ``teacher_logp``, ``teacher_ids`` and ``teacher_counts [b, s, N]``;
``LogitsCache.teacher(batch)`` is the loss's target for them (``CachedTeacher`` or ``SampledTeacher``).

Everything that can be wrong with a cache is found before the first step, as one-line errors: an incomplete
cache, a missing or truncated shard, a checksum mismatch, another teacher, and any manifest field that differs
from the run (tokenizer, dataset keys, packing, max_seq_len, temperature, the tokenized data itself), a mode this
version does not read, and a divergence a sampled cache cannot estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..data.collate import collate
from ..data.dataset import TokenizedDataset
from ..errors import RecipeError
from ..losses import CachedTeacher, SampledTeacher
from ..models import ModelArgs
from .manifest import (
    MANIFEST,
    MODES,
    RUN_FIELDS,
    data_fingerprint,
    decode_sampled,
    first_difference,
    override,
    read_manifest,
    run_fields,
    shard_problem,
    show_value,
    student_head_error,
    teacher_fingerprint,
    unpack_ids,
)

IGNORE_INDEX = -100
_CONFIG_KEY = {"temperature": "kd.temperature", "tokenizer": "tokenizer (tokenizer.json + chat template)",
               "data_sha256": "tokenized transfer set (data_sha256)"}


class LogitsCache:
    """A verified cache folder: its manifest, and the cached rows of each dataset item."""

    def __init__(self, cache_dir: str | Path) -> None:
        self.dir = Path(cache_dir)
        if not self.dir.is_dir():
            raise RecipeError(f"teacher.logits_dir={self.dir}: no such folder; build it with `recipe run kd_logits`")
        self.manifest = read_manifest(self.dir / MANIFEST)
        m = self.manifest
        if not m.get("complete"):
            raise RecipeError(f"teacher.logits_dir={self.dir}: the cache is incomplete ({len(m.get('shards', {}))} "
                              f"of {m['num_shards']} shards); rerun `recipe run kd_logits` with the same config to "
                              "finish it")
        for i in range(m["num_shards"]):
            record = m["shards"].get(str(i))
            problem = "not in the manifest" if record is None else shard_problem(self.dir, record)
            if problem is not None:
                raise RecipeError(f"teacher.logits_dir={self.dir}: shard {i}: {problem}; rebuild it with "
                                  "`recipe run kd_logits` (finished shards are kept)")
        self.mode = m.get("mode", "topk")  # caches from before cache.mode are top-k
        if self.mode not in MODES:
            raise RecipeError(f"teacher.logits_dir={self.dir}: cache.mode={self.mode!r} is not one this version "
                              f"reads ({' | '.join(MODES)}); rebuild it with `recipe run kd_logits`")
        # slots per cached row: k (top-k) or N (sampled: the draws, distinct ids first)
        self.width = int(m["top_k"] if self.mode == "topk" else m["samples"])
        self.temperature = float(m["temperature"])
        self.vocab_size = int(m["vocab_size"])
        self.teacher_args = ModelArgs.from_hf_config(m["teacher"]["config"], source=f"{self.dir / MANIFEST}")
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, torch.Tensor] = {}
        self._entries: dict[int, torch.Tensor] = {}  # sampled: per shard, the first entry of each row
        self._run: dict[str, Any] = {}

    @classmethod
    def for_run(cls, cache_dir: str | Path, dataset_cfg: Mapping[str, Any], tokenizer_dir: str | Path,
                teacher_dir: str | Path | None, temperature: float) -> LogitsCache:
        """Open and verify the cache, and check it against a run's teacher, tokenizer, dataset keys and temperature
        (the tokenized data itself is checked by `dataset`, once it is built; a sampled cache's divergence by
        `teacher.check_teacher_and_student` before this, and by `SampledTeacher` for library callers)."""
        cache = cls(cache_dir)
        cache.check_teacher(teacher_dir)
        cache._run = run_fields(dataset_cfg, tokenizer_dir, temperature, None)
        cache.check_run(cache._run)
        return cache

    def check_teacher(self, teacher_dir: str | Path | None) -> None:
        """When the run names a teacher folder, it must be the one the cache was built from."""
        if teacher_dir is None or not (Path(teacher_dir) / "config.json").is_file():
            return
        if teacher_fingerprint(teacher_dir) != self.manifest["teacher"]["fingerprint"]:
            raise RecipeError(f"teacher.logits_dir={self.dir}: teacher.checkpoint_dir={teacher_dir} is not the "
                              "teacher the cache was built from (its config/weights fingerprint differs)")

    def check_run(self, fields: Mapping[str, Any], keys=RUN_FIELDS) -> None:
        """One-line error naming the first manifest field that differs from the run's `fields`."""
        key = first_difference(self.manifest["run"], fields, [k for k in keys if k in fields])
        if key is not None:
            cached, now = self.manifest["run"].get(key), fields.get(key)
            name = _CONFIG_KEY.get(key, key)
            # a key of the run's config (not a fingerprint): the override that makes the run the cache's
            fix = (f"train with {override(name, cached)} to use this cache, or " if key.startswith("dataset.")
                   or key == "temperature" else "")
            raise RecipeError(f"teacher.logits_dir={self.dir}: {name} differs: the cache was built with "
                              f"{show_value(cached)}, this run has {show_value(now)}; {fix}build a cache for this "
                              "run with `recipe run kd_logits`")

    def student_vocab(self, student_vocab: int) -> int | None:
        """Vocabulary to slice the student's logits to (None: its whole head), or an error."""
        if student_vocab < self.vocab_size:
            raise RecipeError(student_head_error(self.dir, student_vocab, self.vocab_size))
        return None if student_vocab == self.vocab_size else self.vocab_size

    def rows(self, item: int) -> tuple[torch.Tensor, ...]:
        """Cached rows of dataset item `item`: top-k ``(log-probs fp16 [n, k], tail fp16 [n], ids int64 [n, k])``,
        or sampled ``(log-probs fp16 [n, N], ids int64 [n, N], counts int64 [n, N])``, padded with zeros."""
        per = self.manifest["items_per_shard"]
        shard, local = divmod(item, per)
        if shard not in self._handles:
            record = self.manifest["shards"][str(shard)]
            self._handles[shard] = safe_open(str(self.dir / record["file"]), framework="pt")
            self._offsets[shard] = self._handles[shard].get_tensor("offsets")
            if self.mode == "sampled":
                widths = self._handles[shard].get_tensor("widths").to(torch.int64)
                self._entries[shard] = torch.cat([widths.new_zeros(1), widths.cumsum(0)])
        f, off = self._handles[shard], self._offsets[shard]
        a, b = int(off[local]), int(off[local + 1])
        if self.mode == "topk":
            return f.get_slice("logprobs")[a:b], f.get_slice("tail")[a:b], unpack_ids(f.get_slice("ids")[a:b])
        e, ea, eb = self._entries[shard], int(self._entries[shard][a]), int(self._entries[shard][b])
        return decode_sampled(e[a + 1:b + 1] - e[a:b], f.get_slice("ids")[3 * ea:3 * eb],
                              f.get_slice("counts")[ea:eb], f.get_slice("logprobs")[ea:eb], self.width)

    def teacher(self, batch: Mapping[str, torch.Tensor]) -> CachedTeacher | SampledTeacher:
        """The loss's target (``kd_and_ce``) for a batch collated by `dataset`'s CachedDataset."""
        if self.mode == "topk":
            return CachedTeacher(batch["teacher_logp"], batch["teacher_ids"])
        return SampledTeacher(batch["teacher_logp"], batch["teacher_ids"], batch["teacher_counts"])

    def dataset(self, base: TokenizedDataset) -> CachedDataset:
        """`base` (the run's tokenized transfer set) with the cached targets in each batch, once it is checked to
        be exactly the data the cache was built from (after `for_run`)."""
        self.check_run({**self._run, "data_sha256": data_fingerprint(base.items)})
        if len(base) != self.manifest["num_items"]:  # implied by data_sha256; a clearer message
            raise RecipeError(f"teacher.logits_dir={self.dir}: {len(base)} dataset items, the cache has "
                              f"{self.manifest['num_items']}")
        return CachedDataset(base, self)


class CachedDataset(TokenizedDataset):
    """The run's dataset; items carry their index and `collate` adds the cached teacher rows."""

    def __init__(self, base: TokenizedDataset, cache: LogitsCache) -> None:
        super().__init__(base.items, base.pad_id, base.max_seq_len, base.packed, base.shuffle, base.bucket,
                         base.origin)
        self.cache = cache

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        return {**self.items[i], "cache_index": i}

    def collate(self, batch: list[dict]) -> dict:
        out = collate(batch, self.pad_id)
        labels = out["labels"]
        k, topk = self.cache.width, self.cache.mode == "topk"
        # rows without a target: any proper filler (top-k), no draws (sampled)
        logp = torch.full((*labels.shape, k + 1), -math.log(k + 1)) if topk else torch.zeros((*labels.shape, k))
        ids = torch.zeros((*labels.shape, k), dtype=torch.int64)
        counts = None if topk else torch.zeros((*labels.shape, k), dtype=torch.int64)  # draws: sampled caches only
        for r, item in enumerate(batch):
            rows = self.cache.rows(item["cache_index"])
            where = (labels[r] != IGNORE_INDEX).nonzero().squeeze(1)
            if where.numel() != rows[0].shape[0]:
                raise RecipeError(f"teacher.logits_dir={self.cache.dir}: item {item['cache_index']} has "
                                  f"{where.numel()} targets but {rows[0].shape[0]} cached rows")
            if topk:
                logp[r, where, :k], logp[r, where, k], ids[r, where] = rows[0].float(), rows[1].float(), rows[2]
            else:
                logp[r, where], ids[r, where], counts[r, where] = rows[0].float(), rows[1], rows[2]
        out["teacher_logp"], out["teacher_ids"] = logp, ids
        if not topk:
            out["teacher_counts"] = counts
        return out
