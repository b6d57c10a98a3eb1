"""The KD teacher as the `kd` recipe sees it: a frozen model (placed, quantized, compiled), or its offline cache
(`teacher.logits_dir`, written by `recipe run kd_logits`), in which case the teacher is never loaded; and the
vocabulary the loss runs over."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from .errors import RecipeError
from .logits_cache import LogitsCache
from .losses import check_sampled_loss, same_tokenizer, shared_vocab
from .models import ModelArgs, load_model
from .models.builder import is_sharded
from .quantization.teacher import (
    check_teacher_quant_device,
    max_drift_setting,
    quantize_setting,
    quantize_teacher,
    resolve_teacher_quant,
)
from .runtime import TEACHER_PLACEMENTS, Runtime, prepare_teacher
from .schema import Choice, ModelDir
from .settings import setting


@dataclass(frozen=True, kw_only=True)
class TeacherSettings:
    """kd's `teacher:` section: the frozen teacher, or its cache (`logits_dir`: a sample of its tokens or its top-k)."""

    checkpoint_dir: str | None = setting(None, ModelDir(optional=True), "HF folder of the teacher (frozen, no grad)")
    placement: str = setting("auto", Choice(*TEACHER_PLACEMENTS), "several GPUs: replicate (a full copy per GPU), "
                             "shard (FSDP) or auto (replicate if it takes <= half the free memory)")
    quantize: str | None = quantize_setting()
    max_drift: float | None = max_drift_setting()
    logits_dir: str | None = setting(None, (str, type(None)), "a `recipe run kd_logits` cache: its sample (or top-k) "
                                     "replaces the teacher, which is never loaded")


def check_teacher_and_student(t: TeacherSettings, student_dir: str | Path, tokenizer_vocab: int,
                              kd_loss: str) -> None:
    """Teacher and student speak the same tokens, and each config.json describes its weights: checked from
    config.json, the safetensors headers, tokenizer.json and the cache manifest alone, before any expensive step
    (importance scoring, loading weights), on every config path (pruned or not, online teacher or cache). The
    vocabulary errors are the ones `loss_vocab` would raise later; a sampled cache takes `kd_loss` forward_kl only."""
    from .logits_cache.manifest import MANIFEST, read_manifest, student_head_error, tokenizer_fingerprint
    from .models import read_model_args
    from .models.args import check_weight_shapes

    sargs = read_model_args(student_dir)
    check_weight_shapes(student_dir, sargs)
    student_vocab = sargs.vocab_size
    if t.logits_dir is not None:
        manifest = Path(t.logits_dir) / MANIFEST
        if manifest.is_file():  # a missing or unfinished cache is reported by LogitsCache with its own words
            m = read_manifest(manifest)
            if isinstance(m.get("vocab_size"), int) and student_vocab < m["vocab_size"]:
                raise RecipeError(student_head_error(t.logits_dir, student_vocab, m["vocab_size"]))
            if m.get("mode") == "sampled":
                check_sampled_loss(kd_loss, t.logits_dir)
            cached = m.get("run", {}).get("tokenizer")
            if cached is not None and cached != tokenizer_fingerprint(student_dir):
                raise RecipeError(f"teacher.logits_dir={t.logits_dir}: tokenizer (tokenizer.json + chat template) "
                                  f"differs: the cache was built with another tokenizer than {student_dir}'s; "
                                  "build a cache for this run with `recipe run kd_logits`")
        shared_vocab(student_vocab, student_vocab, tokenizer_vocab, student_dir=student_dir)
        return
    teacher_dir = t.checkpoint_dir or student_dir
    targs = read_model_args(teacher_dir)
    check_weight_shapes(teacher_dir, targs)
    shared_vocab(student_vocab, targs.vocab_size, tokenizer_vocab,
                 Path(teacher_dir) == Path(student_dir) or same_tokenizer(student_dir, teacher_dir),
                 student_dir, teacher_dir)


def load_teacher(t: TeacherSettings, dataset: dict[str, Any], rt: Runtime, student_dir: str | Path,
                 temperature: float, max_seq_len: int,
                 compile: bool, phase: Callable[[str], AbstractContextManager[None]] | None = None,
                 ) -> tuple[nn.Module | None, ModelArgs, LogitsCache | None]:
    """`(teacher, teacher_args, None)`, or `(None, teacher_args, cache)` with `teacher.logits_dir`: the cache is
    verified (shards, checksums) and checked against this run (teacher, tokenizer, `dataset` section, temperature)
    here, before any model is loaded; one-line errors name what differs. `compile`: the run's `compile:`.
    `phase` (a SetupLog's): times the weights and the quantization apart."""
    phase = phase or (lambda _: nullcontext())
    if t.logits_dir is not None:
        cache = LogitsCache.for_run(t.logits_dir, dataset, student_dir, t.checkpoint_dir, temperature)
        return None, cache.teacher_args, cache
    # Frozen, under inference mode; replicated or sharded under torchrun (teacher.placement); optionally
    # quantized (fp8 / int8; `auto`: fp8 where it can run) and compiled.
    check_teacher_quant_device(t.quantize, rt.device)  # an fp8 teacher on a GPU without fp8: refused before loading
    with phase("teacher weights"):
        teacher, targs = load_model(t.checkpoint_dir, dtype=rt.dtype, device=rt.build_device(t.checkpoint_dir),
                                    max_seq_len=max_seq_len)
        prepare_teacher(rt, teacher, t.placement, compile)
    mode = resolve_teacher_quant(t.quantize, rt.device, rt.dtype, sharded=is_sharded(teacher), say=rt.is_main)
    with phase(f"teacher {mode}") if mode is not None else nullcontext():
        quantize_teacher(teacher, mode, rt.device, max_drift=t.max_drift, model_dir=t.checkpoint_dir,
                         max_seq_len=max_seq_len, rt=rt)
    return teacher, targs, None


def loss_vocab(rt: Runtime, student_vocab: int, targs: ModelArgs, tokenizer_vocab: int, student_dir: str | Path,
               teacher_dir: str | Path | None, cache: LogitsCache | None) -> int | None:
    """The vocabulary both heads' logits are sliced to (None: whole heads). Heads that differ only by padding
    rows are trimmed to the tokenizer (logged); different tokenizers are an error (llm_recipe.components.losses.vocab)."""
    if cache is not None:
        return cache.student_vocab(student_vocab)
    vocab, note = shared_vocab(student_vocab, targs.vocab_size, tokenizer_vocab,
                               same_tokenizer(student_dir, teacher_dir), student_dir, teacher_dir)
    if note and rt.is_main:
        print(note, flush=True)
    return None if vocab == student_vocab == targs.vocab_size else vocab
