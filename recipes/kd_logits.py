"""Offline teacher: run the KD teacher once over the transfer set and cache a sample of its tokens (the default),
or its top-k log-probabilities.

The transfer set is tokenized and packed exactly as `kd` does it (the same `dataset:` section, the same builder).
Per target token the cache keeps (`cache.mode`) either N tokens drawn from the teacher's softmax at temperature T,
as the distinct ids, their counts and log-probs: 6 bytes per distinct id + 1, at most 193 at N = 32, ~81 on the
demo set (sampled, the default: an unbiased forward-KL gradient, forward_kl only; docs/losses.md); or the teacher's
k largest log-probs at T (fp16), their ids (3 bytes) and the log of the rest of the mass (fp16): 162 bytes at
k = 32 (topk: any kd.loss, a biased gradient). `recipe run kd ... teacher.logits_dir=DIR` then
distils any number of students without loading the teacher. Shards are written atomically; a rerun after a
crash keeps the finished ones; under torchrun each rank writes every world_size-th shard with its own copy of
the teacher. Format: components/logits_cache/manifest.py.

One output_dir, one cache: a folder holding a cache built with other settings is refused, naming each setting that
differs, unless `overwrite: true` replaces it (the old cache is deleted once the new build has written its first
shard, and put back if the build stops before: components/logits_cache/writer.py). The closing line is the `kd`
command that trains from the cache, with the overrides its `kd_config` needs to match it.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.config import config_source
from llm_recipe.components.data.dataset import DatasetConfig, TokenizedDataset, build_dataset, loss_tokens
from llm_recipe.components.data.sources import check_config_data_files
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.logits_cache import (
    CacheWriter,
    encode_sampled,
    encode_topk,
    item_uniforms,
    run_fields,
    teacher_fingerprint,
    teacher_rows,
)
from llm_recipe.components.logits_cache.hint import kd_command
from llm_recipe.components.logits_cache.manifest import DATASET_FIELDS
from llm_recipe.components.losses.sampled import teacher_samples
from llm_recipe.components.losses.topk import teacher_topk
from llm_recipe.components.models import load_model, read_model_args
from llm_recipe.components.quantization.teacher import (
    check_teacher_quant_config,
    max_drift_setting,
    quantize_setting,
    quantize_teacher,
    resolve_teacher_quant,
)
from llm_recipe.components.runtime import Runtime, prepare_teacher, setup_runtime
from llm_recipe.components.schema import Choice, ModelDir, Range
from llm_recipe.components.settings import REQUIRED, section, setting
from llm_recipe.components.train_config import (
    batch_size_key,
    compile_key,
    device_key,
    dtype_key,
    num_output_chunks_key,
    output_dir_key,
    seed_key,
)
from llm_recipe.components.training import hidden_states, load_tokenizer, to_device


@dataclass(frozen=True, kw_only=True)
class Teacher:
    """The `teacher:` section: the model whose sample (or top-k) is cached."""

    checkpoint_dir: str = setting(REQUIRED, ModelDir(), "HF folder of the teacher")
    quantize: str | None = quantize_setting()
    max_drift: float | None = max_drift_setting()


@dataclass(frozen=True, kw_only=True)
class Cache:
    """The `cache:` section: what the cache keeps per target token, and how it is sharded."""

    mode: str = setting("sampled", Choice("topk", "sampled"), "sampled: cache.samples draws from the teacher "
                        "(unbiased forward-KL gradient; kd.loss forward_kl only) | topk: the k largest teacher "
                        "log-probs + the tail's (any kd.loss)")
    top_k: int = setting(32, Range(int, ge=1, le=2**24), "teacher log-probs kept per token (mode topk)")
    samples: int = setting(32, Range(int, ge=1, le=255), "tokens drawn per token from the teacher's softmax, with "
                           "replacement (mode sampled; seeded by `seed`)")
    temperature: float = setting(1.0, Range(float, gt=0), "the teacher's softmax temperature; kd.temperature must "
                                 "equal it")
    items_per_shard: int = setting(256, Range(int, ge=1), "dataset rows per shard file (the unit of resume and of "
                                   "torchrun work)")


@dataclass(frozen=True, kw_only=True)
class KDLogitsConfig:
    """The kd_logits recipe's keys."""

    output_dir: str = output_dir_key("the cache: shard_NNNNN.safetensors + manifest.json")
    overwrite: bool = setting(False, bool, "replace a cache in output_dir (built with any settings) by a new build; "
                              "false: a cache of other settings is refused, one of these settings is continued")
    kd_config: str | None = setting(None, (str, type(None)), "the kd config that trains from this cache: the closing "
                                    "command names it, with the overrides it needs to match the cache (null: every "
                                    "key the cache fixes)")
    seed: int = seed_key()
    device: str = device_key()
    dtype: str = dtype_key()
    compile: bool = compile_key()
    batch_size: int = batch_size_key()
    num_output_chunks: int = num_output_chunks_key("teacher head + the cache's sample (or top-k) computed in this "
                                                   "many chunks of target rows")
    tokenizer_dir: str | None = setting(None, ModelDir(optional=True), "tokenizes the transfer set: the kd run's "
                                        "student folder (null: the teacher's)")
    teacher: Teacher = section(Teacher, "the teacher")
    # only the keys that decide the cached rows: shuffle and bucket order a training run's batches, which a cache
    # build never draws, so a kd_logits config that sets them is refused (unknown key) instead of silently ignored
    dataset: DatasetConfig = section(DatasetConfig, "the kd run's dataset section (the keys that decide its rows)",
                                     only=DATASET_FIELDS)
    cache: Cache = section(Cache, "what the cache keeps")

    def check(self) -> None:
        """Checks across keys, at load: an fp8 teacher needs a GPU (and bf16), and kd_config names a kd config that
        loads (`recipe validate` says both)."""
        check_teacher_quant_config(self.teacher.quantize, self.device, self.dtype)
        _kd_config(self.kd_config)


CONFIG = KDLogitsConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys kd_logits`)


def _encoder(c: Cache, seed: int, first: int, rows: list[int], device):
    """``encode(logits, i, j)`` for `teacher_rows` on a batch of items first, first + 1, ... with `rows` target
    rows each: their top-k, or their draws (each item's uniforms from its own generator: the same numbers whatever
    the batch size or chunking)."""
    if c.mode == "topk":
        return lambda logits, i, j: teacher_topk(logits, c.top_k, c.temperature)
    u = torch.cat([item_uniforms(seed, first + r, n, c.samples) for r, n in enumerate(rows)]).to(device)
    return lambda logits, i, j: teacher_samples(logits, u[i:j], c.temperature)


def _kd_config(name: str | None, overrides: list[str] | None = None):
    """The kd config the closing command names, loaded and checked (at the start: a typo fails before the teacher
    runs; at the end with the command's overrides)."""
    if name is None:
        return None
    from llm_recipe.components.config import load_recipe_config
    from llm_recipe.recipes.kd import CONFIG as KD_CONFIG

    try:
        return load_recipe_config(name, overrides or [], KD_CONFIG, recipe="kd")
    except RecipeError as e:
        raise RecipeError(f"kd_config={name}: {e}") from None


def _closing_command(cfg: KDLogitsConfig, kd, header: dict, tokenizer_dir: str) -> str:
    """The `recipe run kd` command that trains from the cache (components/logits_cache/hint.py), loaded once with
    its overrides: a kd config that still refuses them (e.g. a student pruned from another teacher) is said."""
    command = kd_command(cfg.output_dir, header["run"], mode=cfg.cache.mode, teacher_dir=cfg.teacher.checkpoint_dir,
                         tokenizer_dir=tokenizer_dir, kd_config=cfg.kd_config, kd=kd,
                         teacher_fingerprint=teacher_fingerprint)
    try:
        _kd_config(cfg.kd_config, shlex.split(command)[5:])
    except RecipeError as e:
        command += f"\n  note: kd refuses it as it stands ({e})"
    return command


def main(cfg: KDLogitsConfig) -> None:
    check_config_data_files(cfg, config_source(cfg).where)  # a missing file or offline Hub set: one line, now
    kd = _kd_config(cfg.kd_config)
    rt = setup_runtime(cfg.device, cfg.dtype, cfg.seed)
    teacher_dir = cfg.teacher.checkpoint_dir
    mode, temperature, per_shard = cfg.cache.mode, float(cfg.cache.temperature), cfg.cache.items_per_shard
    k, samples = cfg.cache.top_k, cfg.cache.samples
    targs = read_model_args(teacher_dir)
    if targs.vocab_size > 2**24:  # ids are stored in 3 bytes
        raise RecipeError(f"teacher.checkpoint_dir={teacher_dir}: a vocabulary of {targs.vocab_size} tokens is over "
                          "the cache's 2^24 ids")
    # The transfer set exactly as `kd` builds it: same dataset section, same packing, and the tokenizer kd uses
    # (its student's: tokenizer_dir, or the teacher's when the student is pruned from it).
    tokenizer_dir = cfg.tokenizer_dir or teacher_dir
    data_cfg = cfg.dataset.kwargs()
    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = build_dataset(tokenizer, cfg.dataset)
    # A head padded past the tokenizer (Qwen2.5-7B: 152064 rows for 151665 tokens): the cache holds the distribution
    # over the tokenizer's tokens, as live KD slices both heads (losses/vocab.py), so a student whose head is padded
    # less (151936) trains from it too.
    vocab = min(targs.vocab_size, tokenizer.vocab_size)
    if vocab < targs.vocab_size and rt.is_main:
        print(f"kd_logits: the teacher's head has {targs.vocab_size} rows and the tokenizer {vocab} tokens: the "
              f"cache holds the distribution over the {vocab} tokens (padding rows are never targets)", flush=True)
    if mode == "topk" and not 1 <= k <= vocab:
        raise RecipeError(f"cache.top_k={k} must be in [1, {vocab}] (the teacher's vocabulary)")

    # The manifest says what the cache was built from; `kd` refuses a cache whose fields differ from its run. The
    # teacher's precision is the one this machine applies (teacher.quantize=auto resolved), so a cache resumed on a
    # GPU that would compute other targets is refused rather than mixed.
    quantize = resolve_teacher_quant(cfg.teacher.quantize, rt.device, rt.dtype,  # replicated: never sharded
                                     say=rt.is_main)
    header = {
        "run": run_fields(data_cfg, tokenizer_dir, temperature, dataset.items),
        "teacher": {"fingerprint": teacher_fingerprint(teacher_dir), "quantize": quantize,
                    **({"max_drift": cfg.teacher.max_drift} if quantize == "fp8" else {}),
                    "config": json.loads((Path(teacher_dir) / "config.json").read_text()), "dtype": str(rt.dtype)},
        "mode": mode, "temperature": temperature, "vocab_size": vocab, "value_dtype": "float16",
        "id_bytes": 3, "num_items": len(dataset), "items_per_shard": per_shard,
        "num_shards": -(-len(dataset) // per_shard),
        # top-k: k; sampled: N draws per token, seeded from the run seed and the item (item_uniforms)
        **({"top_k": k} if mode == "topk" else {"samples": samples, "sample_seed": cfg.seed}),
    }
    writer = CacheWriter(cfg.output_dir, header, rt, overwrite=cfg.overwrite)
    try:
        manifest = _build(cfg, rt, writer, dataset, header)
    except BaseException:  # stopped before its first shard: the cache overwrite=true was replacing comes back
        if writer.put_back():
            print(f"recipe: overwrite=true: the earlier cache in {cfg.output_dir} was put back as it was",
                  file=sys.stderr, flush=True)
        raise
    if rt.is_main:
        what = f"k={k}" if mode == "topk" else (f"{samples} samples per token (at most "
                                                  f"{manifest['payload_bytes_per_token']}: every draw distinct)")
        command = _closing_command(cfg, kd, header, tokenizer_dir)
        print(f"cache: {cfg.output_dir} ({manifest['tokens']} tokens, {manifest['num_shards']} shards, "
              f"{manifest['bytes_per_token']} bytes/token at {what})\n"
              f"train from it: {command}", flush=True)
    rt.teardown()


def _build(cfg: KDLogitsConfig, rt: Runtime, writer: CacheWriter, dataset: TokenizedDataset, header: dict) -> dict:
    """Run the teacher over the shards `writer` has left to write, write them, and return the finished manifest."""
    teacher_dir, mode, chunks = cfg.teacher.checkpoint_dir, cfg.cache.mode, cfg.num_output_chunks
    vocab_size = header["vocab_size"]
    todo = writer.todo()
    if rt.is_main and writer.replaced is not None:
        r = writer.replaced
        print(f"overwrite=true: replacing the cache in {cfg.output_dir} ({r['shards']} of {r['num_shards']} shards"
              f"{', complete' if r['complete'] else ''}); it is deleted once the first new shard is written",
              flush=True)
    if rt.is_main and writer.records and todo:
        print(f"resuming: {len(writer.records)} of {header['num_shards']} shards already written and verified",
              flush=True)
    elif rt.is_main and len(writer.records) == header["num_shards"]:
        print(f"{cfg.output_dir} already holds this cache, every shard verified: nothing to write (overwrite=true "
              "builds it again)", flush=True)

    # The teacher: frozen, under inference mode, optionally fp8/int8 and compiled; a full copy on every rank
    # (each rank runs its own shards, so a sharded teacher's collectives would not line up).
    if todo:
        # replicated: the whole teacher ends on this device, so it is built there (only ranks with work get here)
        teacher, _ = load_model(teacher_dir, dtype=rt.dtype, device=rt.device, max_seq_len=dataset.max_seq_len)
        prepare_teacher(rt, teacher, "replicate", cfg.compile)
        # the fp8 drift decision is broadcast from rank 0 when every rank gets here; else each rank with work
        # decides for itself (a collective among some ranks would hang)
        quantize_teacher(teacher, header["teacher"]["quantize"], rt.device, max_drift=cfg.teacher.max_drift,
                         model_dir=teacher_dir, max_seq_len=dataset.max_seq_len,
                         rt=rt if writer.every_rank_has_work() else None)

    bs = cfg.batch_size
    # What is left to do, up front, and a bar over target tokens whose rate gives the ETA after the first batches
    # (on one rank the demo cache takes minutes on a CPU).
    total = sum(loss_tokens(dataset[i]) for shard in todo for i in writer.items(shard))
    if todo and rt.is_main:
        print(f"teacher: {total:,} target tokens to go in {len(todo)} shard(s)"
              f"{f' on each of {rt.world_size} ranks' if rt.world_size > 1 else ''}; ETA on the bar below",
              flush=True)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="teacher top-k" if mode == "topk" else "teacher sample",
               dynamic_ncols=True, disable=not (todo and rt.is_main))
    for shard in todo:
        start, parts, counts = time.perf_counter(), [], []
        items = writer.items(shard)
        for first in range(items.start, items.stop, bs):
            batch = to_device(dataset.collate([dataset[i] for i in range(first, min(first + bs, items.stop))]),
                              rt.device)
            counts += (n := (batch["labels"] != -100).sum(1).tolist())
            bar.update(sum(n))
            encode = _encoder(cfg.cache, cfg.seed, first, n, rt.device)
            with torch.inference_mode():
                hidden = hidden_states(teacher, batch)
                parts += [tuple(x.cpu() for x in rows) for rows in
                          teacher_rows(hidden, teacher.output, batch["labels"], encode, vocab_size, chunks)]
        rows = (torch.cat([p[j] for p in parts]) for j in range(3))
        writer.write(shard, encode_topk(*rows) if mode == "topk" else encode_sampled(*rows), counts)
        line = (f"rank {rt.rank}: shard {shard + 1}/{header['num_shards']}: {sum(counts)} tokens, "
                f"{sum(counts) / (time.perf_counter() - start):,.0f} tokens/s")
        if bar.disable:
            print(line, flush=True)
        else:
            bar.write(line)  # above the bar, which stays at the bottom
    bar.close()
    return writer.finish()


if __name__ == "__main__":
    run_recipe_script(KDLogitsConfig, main)
