"""Depth pruning by measured layer importance: score every decoder layer on calibration text, keep the best N.

Two scores per layer, both measured on the same calibration batches (higher = more important):

- **block influence** (ShortGPT, Men et al. 2024): `1 - cos(h_in, h_out)` between the hidden state entering the
  layer and the one leaving it, averaged over target tokens. A layer that barely turns the residual stream
  changes little when removed.
- **loss drop** (as Minitron ranks depth, Muralidharan et al. 2024): the increase of the next-token
  cross-entropy on the calibration text when that layer alone is skipped. It measures what the model's output
  loses, not just what the layer writes, and so also sees the layers whose small change matters (layer 0, the
  last layers).

`keep_by_importance` keeps the N best layers in their original order. The every-k rule
(`llm_recipe.components.models.keep_every`) stays the alternative that needs no calibration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.atomic import atomic_write_bytes
from ..data.collate import collate
from ..errors import RecipeError
from ..losses import chunked_cross_entropy
from ..schema import Choice, ListOf, ModelDir, Range
from ..settings import REQUIRED, check_fields, section, setting
from .attention import batch_to_device

METHODS = ("block_influence", "loss_drop")
IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class PruneSettings:
    """`student.prune`: keep the `keep` layers that matter most, measured on the first tokens of the dataset."""

    method: str = setting("loss_drop", Choice(*METHODS), "loss_drop (CE increase when the layer alone is skipped) | "
                          "block_influence (1 - cos between a layer's input and output)")
    keep: int = setting(REQUIRED, Range(int, ge=1), "layers the student keeps")
    calibration_tokens: int = setting(4096, Range(int, ge=1), "score on the first ~N tokens of the dataset")

    def __post_init__(self) -> None:
        check_fields(self, "student.prune.")  # also built from a mapping by library callers (`importance_keep`)


@dataclass(frozen=True, kw_only=True)
class StudentSettings:
    """kd's `student:` section: its weights, and the teacher layers it keeps (at most one of keep_layers, every,
    prune; none: all of them)."""

    checkpoint_dir: str | None = setting(None, ModelDir(optional=True), "HF folder of the student (null: the "
                                         "teacher's weights)")
    keep_layers: tuple[int, ...] | None = setting(None, ListOf(Range(int, ge=0), min_len=1, unique=True,
                                                               optional=True),
                                                  "teacher layers the student keeps, in order, e.g. [0, 3, 6]")
    every: int | None = setting(None, Range(int, ge=1, optional=True), "keep every k-th layer (plus the last)")
    prune: PruneSettings | None = section(PruneSettings, "keep the layers that matter most (null: no importance "
                                          "scoring)", optional=True)

    def check(self) -> None:
        """At most one of keep_layers, every, prune: a check across keys, run at load by KDConfig.check()."""
        chosen = [k for k in ("keep_layers", "every", "prune") if getattr(self, k) is not None]
        if len(chosen) > 1:
            raise RecipeError(f"student: set one of keep_layers, every or prune, not {' and '.join(chosen)} "
                              "(student.prune=null drops the importance scoring)")


def _loss(model: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Summed next-token cross-entropy from the last layer's output `h` (final norm, chunked output projection)."""
    loss_sum, n = chunked_cross_entropy(model.norm(h), model.output, labels, num_chunks=4)
    return float(loss_sum), int(n)


@torch.no_grad()
def score_layers(model: nn.Module, batches: Sequence[dict]) -> dict:
    """Score every layer of `model` (a torchtune `TransformerDecoder`) on `batches` (collated, on its device).

    Returns `{"base_loss", "tokens", "layers": [{"layer", "block_influence", "loss_drop"}, ...]}`: `loss_drop` in
    nats per target token, `block_influence` in [0, 2]. One full forward per batch keeps every layer's input; the
    model without layer i then only reruns layers i+1.. from layer i's input (about half a forward per layer).
    """
    if not batches:
        raise RecipeError("prune: no calibration batches")
    was_training = model.training
    model.eval()
    layers = list(model.layers)
    n = len(layers)
    influence = torch.zeros(n, dtype=torch.float64)
    total = torch.zeros(n + 1, dtype=torch.float64)  # [i]: summed loss without layer i; [n]: the full model
    count, weight = 0, 0
    try:
        for batch in batches:
            mask, pos, labels = batch.get("mask"), batch.get("input_pos"), batch["labels"]
            keep = labels != IGNORE_INDEX
            h = model.tok_embeddings(batch["tokens"])
            inputs = []
            for layer in layers:
                inputs.append(h)
                out = layer(h, mask=mask, input_pos=pos)
                cos = nn.functional.cosine_similarity(h.float(), out.float(), dim=-1)  # [b, s]
                influence[len(inputs) - 1] += float((1 - cos)[keep].sum())
                h = out
            loss, m = _loss(model, h, labels)
            total[n] += loss
            count += m
            weight += int(keep.sum())
            for i in range(n):
                h = inputs[i]  # what layer i received: the model without it passes this on to layer i+1
                for layer in layers[i + 1 :]:
                    h = layer(h, mask=mask, input_pos=pos)
                total[i] += _loss(model, h, labels)[0]
    finally:
        model.train(was_training)
    base = float(total[n]) / max(count, 1)
    rows = [{"layer": i, "block_influence": float(influence[i]) / max(weight, 1),
             "loss_drop": float(total[i]) / max(count, 1) - base} for i in range(n)]
    return {"base_loss": base, "tokens": count, "layers": rows}


def keep_by_importance(scores: dict, keep: int, method: str) -> list[int]:
    """The `keep` layers with the highest `method` score, in their original order."""
    if method not in METHODS:
        raise RecipeError(f"student.prune.method: unknown '{method}'; choose one of {', '.join(METHODS)}")
    n = len(scores["layers"])
    if not 1 <= keep <= n:
        raise RecipeError(f"student.prune.keep must be between 1 and {n} (the model's layers), got {keep}")
    ranked = sorted(scores["layers"], key=lambda r: (-r[method], r["layer"]))
    return sorted(r["layer"] for r in ranked[:keep])


def score_table(scores: dict, kept: Sequence[int], method: str) -> str:
    """Plain-text table: one line per layer with both scores, their ranks and whether it is kept."""
    rows = scores["layers"]
    rank = {m: {r["layer"]: k + 1 for k, r in enumerate(sorted(rows, key=lambda r: (-r[m], r["layer"])))}
            for m in METHODS}
    # the tokens whose next-token loss was scored (labelled positions), fewer than the calibration rows' tokens
    lines = [f"layer importance on {scores['tokens']} scored target tokens (base loss {scores['base_loss']:.3f}); "
             f"kept by {method}: {len(kept)} of {len(rows)}",
             "layer | block influence (rank) | loss drop, nats (rank) | kept"]
    for r in rows:
        i = r["layer"]
        lines.append(f"{i:5d} | {r['block_influence']:9.4f} ({rank['block_influence'][i]:2d})     | "
                     f"{r['loss_drop']:10.4f} ({rank['loss_drop'][i]:2d})     | {'yes' if i in kept else '-'}")
    return "\n".join(lines)


def calibration_batches(dataset: Sequence[dict], tokens: int, batch_size: int, pad_id: int,
                        device: torch.device | str) -> list[dict]:
    """Collated batches from the first items of a tokenized dataset until about `tokens` tokens are covered."""
    if tokens < 1:
        raise RecipeError(f"student.prune.calibration_tokens must be positive, got {tokens}")
    items, seen = [], 0
    for item in dataset:
        items.append(item)
        seen += len(item["tokens"])
        if seen >= tokens:
            break
    return [batch_to_device(collate(items[i : i + batch_size], pad_id), torch.device(device))
            for i in range(0, len(items), batch_size)]


def save_scores(path: str | Path, scores: dict, kept: Sequence[int], method: str, table: str) -> Path:
    """Write the scores and the chosen layers as JSON (atomically) next to the printed table."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"method": method, "kept": list(kept), **scores}
    if not all(math.isfinite(r["loss_drop"]) for r in scores["layers"]):
        doc["note"] = "non-finite loss drops: the model diverges without some layer"
    atomic_write_bytes(path, (json.dumps(doc, indent=2) + "\n").encode())
    atomic_write_bytes(path.with_suffix(".txt"), (table + "\n").encode())
    return path


def importance_keep(model_dir: str | Path, prune: PruneSettings | Mapping, dataset: dict, batch_size: int,
                    device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
                    out_dir: str | Path | None = None, log=print, data: Sequence[dict] | None = None) -> list[int]:
    """Score the layers of the model in `model_dir` on the first `calibration_tokens` of `dataset` (a `dataset:`
    section, e.g. the transfer set the student will train on) and return the `keep` most important ones. `data`:
    that section already tokenized (a run's training data: not tokenized, nor held in memory, twice).

    With `out_dir`, writes `out_dir/layer_importance.json` (scores + kept layers) and `.txt` (the table) and
    prints the table through `log`.
    """
    from ..data.dataset import build_dataset
    from .args import read_model_args
    from .loader import load_model
    from .tokenizer import Tokenizer, check_tokenizer_fits

    p = prune if isinstance(prune, PruneSettings) else PruneSettings(**prune)  # a mapping: bench/kd_study2.py
    method, keep, tokens = p.method, p.keep, p.calibration_tokens
    layers = read_model_args(model_dir).num_layers
    if keep > layers:
        raise RecipeError(f"student.prune.keep={keep} but {model_dir} has only {layers} layers")
    tokenizer = Tokenizer.from_dir(model_dir)
    check_tokenizer_fits(model_dir, tokenizer)
    ds = data if data is not None else build_dataset(tokenizer, **dataset)
    model, _ = load_model(model_dir, dtype=dtype, device=device, max_seq_len=dataset.get("max_seq_len"))
    batches = calibration_batches(ds, tokens, batch_size, tokenizer.pad_id, device)
    found = sum(len(item["tokens"]) for item in ds)
    if found < tokens:  # a small dataset scores the layers on what it has: said, the choice is noisier
        log(f"note: student.prune.calibration_tokens={tokens}, but the dataset has only {found} tokens: the layers "
            "are scored on those (a noisier choice; more rows or student.keep_layers / every make it firmer)")
    scores = score_layers(model, batches)
    del model
    kept = keep_by_importance(scores, keep, method)
    if out_dir is not None:
        table = score_table(scores, kept, method)
        path = save_scores(Path(out_dir) / "layer_importance.json", scores, kept, method, table)
        log(f"{table}\nlayer scores: {path}")
    return kept


def check_student_layers(student: StudentSettings, model_dir: str | Path,
                         where: Callable[[str], str] | None = None) -> int:
    """The student's layer choice against `model_dir`'s config.json alone (no weights, no data): a `keep_layers`
    index past the model's last layer, or `prune.keep` above its layer count, is a one-line RecipeError naming the
    key, where it was set (`where(dotted key)`: file:line or the override) and config.json. What the run checks
    before anything loads and `recipe validate` checks where the folder is. Returns the model's layer count."""
    from .args import read_model_args

    def at(key: str) -> str:
        return f"{where(key)}: key '{key}'" if where is not None else f"key '{key}'"

    layers = read_model_args(model_dir).num_layers
    config = Path(model_dir) / "config.json"
    if student.keep_layers is not None and (last := max(int(i) for i in student.keep_layers)) >= layers:
        raise RecipeError(f"{at('student.keep_layers')}: layer {last} does not exist: {config} has {layers} layers "
                          f"(0..{layers - 1})")
    if student.prune is not None and student.prune.keep > layers:
        raise RecipeError(f"{at('student.prune.keep')}: {student.prune.keep} layers to keep, but {config} has "
                          f"{layers} (keep at most {layers}; {layers} keeps them all)")
    return layers


def student_layers(student: StudentSettings, model_dir: str | Path, dataset: dict, batch_size: int,
                   device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
                   out_dir: str | Path | None = None, score: bool = True,
                   where: Callable[[str], str] | None = None, log: Callable[[str], None] = print,
                   data: Sequence[dict] | None = None) -> list[int] | None:
    """Which layers of `model_dir` a KD student keeps, from its `student:` section: `keep_layers: [...]`,
    `every: k` (layers 0, k, 2k, ... and the last), `prune: {method, keep, calibration_tokens}` (the `keep` layers
    that matter most, measured on the first tokens of `dataset`, or of `data`, the run's tokenized training rows
    when given; skipped with `score=False`, e.g. when a full student resumes its own weights, and when `keep` is
    every layer: nothing to remove, said through `log` where `out_dir` is set), or all of them (None); at most one
    is set (`StudentSettings.check()`, at load). Cheap checks come first, before any model loads
    (`check_student_layers`; `where(dotted key)` names the config line in errors)."""
    from .loader import keep_every

    layers = check_student_layers(student, model_dir, where)
    if student.keep_layers is not None:
        return [int(i) for i in student.keep_layers]
    if student.every is not None:
        return keep_every(layers, student.every)
    if student.prune is not None and student.prune.keep == layers:  # scoring would rank layers only to keep all
        if out_dir is not None:
            log(f"student.prune.keep={layers} keeps all {layers} layers of {model_dir}: nothing to remove, layer "
                "scoring skipped")
        return None
    if student.prune is not None and score:
        return importance_keep(model_dir, student.prune, dataset, batch_size, device, dtype, out_dir, data=data)
    return None
