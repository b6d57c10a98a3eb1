"""The command `recipe run kd_logits` closes with: `recipe run kd` training from the cache just built, with the
overrides that make the kd config's run match the cache (dataset keys, temperature, teacher, tokenizer, a loss a
sampled cache can train), so that it works when pasted instead of being refused by the cache checks (reader.py)."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..on_policy import KD_OPTIONS
from ..output_kinds import free_folder
from .manifest import DATASET_FIELDS, first_difference, override, tokenizer_fingerprint

__all__ = ["kd_command"]


def _same_folder(a: str | None, b: str | None, fingerprint: Callable[[str], str]) -> bool:
    """Whether two model folders are the same one: the same path, or the same `fingerprint`."""
    if a is None or b is None:
        return a is b
    if Path(a).expanduser().resolve() == Path(b).expanduser().resolve():
        return True
    try:
        return fingerprint(a) == fingerprint(b)
    except (OSError, ValueError, RecipeError):  # not there, unreadable or without a tokenizer on this machine (the
        return False                            # kd config's default folders, not downloaded yet): another folder


def kd_command(out_dir: str, run: Mapping[str, Any], *, mode: str, teacher_dir: str, tokenizer_dir: str,
               kd_config: str | None, kd: Any | None, teacher_fingerprint: Callable[[str], str]) -> str:
    """`recipe run kd --config <kd_config> teacher.logits_dir=<out_dir> ...` for the cache whose manifest `run`
    fields are `run` (tokenized with `tokenizer_dir`, taught by `teacher_dir`). `kd`: the kd config, typed (the
    kd recipe's CONFIG), to add only what differs from it; None: every key the cache fixes, for any kd config."""
    temperature = run["temperature"]
    dataset = {k: run[f"dataset.{k}"] for k in DATASET_FIELDS}
    words = ["recipe", "run", "kd", "--config", shlex.quote(kd_config or "KD_CONFIG"), override("teacher.logits_dir",
                                                                                                  out_dir)]
    if kd is None:
        words += [override(f"dataset.{k}", v) for k, v in dataset.items()]
        words += [override("kd.temperature", temperature)]
        words += [override("kd.loss", "forward_kl")] if mode == "sampled" else []
        return " ".join(words)
    # The teacher: kd checks that a teacher it names is the cache's (its fingerprint).
    teacher = kd.teacher.checkpoint_dir
    if teacher is not None and not _same_folder(teacher, teacher_dir, teacher_fingerprint):
        teacher = teacher_dir
        words.append(override("teacher.checkpoint_dir", teacher))
    # The tokenizer: kd tokenizes with its student's folder (student.checkpoint_dir, else the teacher's).
    student = kd.student.checkpoint_dir or teacher
    if not _same_folder(student, tokenizer_dir, tokenizer_fingerprint):
        words.append(override("student.checkpoint_dir", tokenizer_dir))
    # The dataset keys that decide the tokenized items, and the temperature.
    mine = {k: v for k, v in kd.dataset.kwargs().items() if k in dataset}
    words += [override(f"dataset.{k}", dataset[k]) for k in DATASET_FIELDS
              if first_difference(mine, dataset, [k]) is not None]
    if first_difference({"t": kd.kd.temperature}, {"t": temperature}, ["t"]) is not None:
        words.append(override("kd.temperature", temperature))
    # A sampled cache trains forward KL only (and without the options of other divergences); no cache on-policy.
    if mode == "sampled" and kd.kd.loss != "forward_kl":
        words.append(override("kd.loss", "forward_kl"))
        words += [override(f"kd.{o}", None) for o in KD_OPTIONS if getattr(kd.kd, o, None) is not None]
    if kd.kd.on_policy is not None:
        words.append(override("kd.on_policy", None))
    # A new kd run is refused a folder holding an earlier run: when the config's own output_dir holds one (the kd
    # run this cache was built for, say), a free folder beside it.
    out = free_folder(kd.output_dir, "_from_cache")
    if out != kd.output_dir:
        words.append(override("output_dir", out))
    return " ".join(words)
