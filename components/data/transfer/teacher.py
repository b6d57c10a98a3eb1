"""Transfer data written by the teacher itself (sequence-level KD data), offline, for a run of any size.

Prompts come from the shipped transfer set: the opening tokens of each passage (the teacher continues the text)
and the user turn of each chat row (the teacher answers through its chat template). Each prompt may be sampled
several times. Output is JSON Lines in the shipped set's own formats, so training configs read it with
`format: text` (`passages.jsonl`: `{"id", "text", "source"}`) or `format: chat` (`chat.jsonl`: `{"id",
"messages", "source"}`).

Deterministic and resumable: the prompt list, its split into batches and each batch's random generator (seeded
from `seed` and the batch index) depend only on the settings, so a run that is stopped and started again writes
the same rows as one that never stopped. Rows are appended batch by batch; on restart the ids already in the file
(or already dropped) are skipped and a torn last line is cut off. A row whose prompt or completion shares a
13-word span with the eval pack is dropped, as in the shipped set (`build_transfer_set.py`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...errors import RecipeError
from . import transfer_set_path
from .build_transfer_set import ngrams

KINDS = ("passages", "chat")


@dataclass(frozen=True)
class Prompt:
    """One generation request: `id` is stable across runs (`p<row>.<sample>` / `c<row>.<sample>`)."""

    id: str
    tokens: list[int]
    source: str
    text: str  # passages: the opening as text; chat: the user message


@dataclass(frozen=True)
class Sampling:
    """How the teacher samples."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    batch_size: int = 16
    compile_mode: str | None = None  # torch.compile mode of the decode step (None: eager); see generate_batch


def _rows(kind: str, limit: int | None) -> list[dict]:
    with open(transfer_set_path(kind), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows if limit is None else rows[:limit]


def build_prompts(tokenizer, kind: str, limit: int | None, samples_per_prompt: int,
                  opening_tokens: int) -> list[Prompt]:
    """Prompts of one kind from the shipped set's first `limit` rows (None: all), each repeated
    `samples_per_prompt` times, sorted by length (batches waste little padding), ties in row order."""
    if kind not in KINDS:
        raise RecipeError(f"transfer prompts: unknown kind '{kind}'; choose from {', '.join(KINDS)}")
    if samples_per_prompt < 1:
        raise RecipeError(f"prompts.samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if opening_tokens < 1:
        raise RecipeError(f"prompts.opening_tokens must be >= 1, got {opening_tokens}")
    prompts = []
    for i, row in enumerate(_rows(kind, limit)):
        if kind == "passages":
            body = tokenizer.encode(row["text"], add_bos=False)[:opening_tokens]
            tokens, text = tokenizer.encode("", add_bos=True) + body, tokenizer.decode(body)
        else:
            text = row["messages"][0]["content"]
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     fixed_date=True)  # the same prompts on every day
            tokens = tokenizer.encode(rendered, add_bos=True)
        prompts += [Prompt(f"{kind[0]}{i}.{s}", tokens, row.get("source", kind), text)
                    for s in range(samples_per_prompt)]
    return sorted(prompts, key=lambda p: len(p.tokens))


def read_done(path: Path) -> set[str]:
    """Ids already in a JSONL output (or a `.dropped` list); a torn last line from a crash is cut off first."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    done = set()
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(json.loads(line)["id"] if path.suffix == ".jsonl" else line.strip())
        except (json.JSONDecodeError, KeyError, TypeError):
            raise RecipeError(f"{path}:{n}: not a row this recipe wrote (no 'id'); move the file away or use "
                              "another output_dir") from None
    return done


def _append(path: Path, lines: Iterable[str]) -> None:
    lines = list(lines)
    if not lines:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


def make_row(kind: str, prompt: Prompt, text: str) -> dict:
    """The output row (in the shipped set's format): passages get the opening and its continuation as `text`,
    chat the user turn and the teacher's reply."""
    if kind == "passages":
        return {"id": prompt.id, "text": text, "source": f"teacher:{prompt.source}"}
    return {"id": prompt.id, "messages": [{"role": "user", "content": prompt.text},
                                          {"role": "assistant", "content": text}],
            "source": f"teacher:{prompt.source}"}


def batch_generator(seed: int, batch_index: int, device: torch.device) -> torch.Generator:
    """The random generator of one batch: a function of the seed and the batch's place only."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + batch_index)


def write_teacher_rows(
    model: torch.nn.Module,
    tokenizer,
    kind: str,
    prompts: Sequence[Prompt],
    out_path: Path,
    sampling: Sampling,
    seed: int,
    banned: set[int] | None,
    log: Callable[[str], None] = print,
) -> dict:
    """Generate the prompts not yet in `out_path`, batch by batch, appending rows (and dropped ids to
    `out_path.dropped`). Returns counts: rows written now, dropped (eval-pack overlap, empty), skipped (done)."""
    from ...models.generation import generate_batch

    if sampling.batch_size < 1:
        raise RecipeError(f"generation.batch_size must be >= 1, got {sampling.batch_size}")
    if sampling.max_new_tokens < 1:
        raise RecipeError(f"generation.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    dropped_path = out_path.with_suffix(".dropped")
    done = read_done(out_path) | read_done(dropped_path)
    device = model.tok_embeddings.weight.device
    stats = {"written": 0, "contaminated": 0, "empty": 0, "skipped": 0, "new_tokens": 0}
    start, bs = time.perf_counter(), sampling.batch_size
    batches = [prompts[i : i + bs] for i in range(0, len(prompts), bs)]
    for k, batch in enumerate(batches):
        todo = [p for p in batch if p.id not in done]
        stats["skipped"] += len(batch) - len(todo)
        if not todo:
            continue
        # The whole batch is generated even when some rows are done, so every row's sample stays the same.
        outs = generate_batch(model, [p.tokens for p in batch], sampling.max_new_tokens, tokenizer.pad_id,
                              sampling.temperature, sampling.top_k, sampling.top_p, tokenizer.stop_ids,
                              batch_generator(seed, k, device), compile_mode=sampling.compile_mode)
        rows, drops = [], []
        for p, ids in zip(batch, outs):
            if p.id in done:
                continue
            stats["new_tokens"] += len(ids)
            completion = tokenizer.decode(ids)
            text = tokenizer.decode(p.tokens + ids) if kind == "passages" else completion
            if not completion.strip():
                stats["empty"] += 1
                drops.append(p.id)
            elif banned is not None and ngrams(p.text + " " + text) & banned:
                stats["contaminated"] += 1
                drops.append(p.id)
            else:
                rows.append(json.dumps(make_row(kind, p, text), ensure_ascii=False))
        _append(dropped_path, drops)  # dropped first: a crash in between only regenerates kept rows
        _append(out_path, rows)
        stats["written"] += len(rows)
        elapsed = time.perf_counter() - start
        log(f"{kind}: batch {k + 1}/{len(batches)}, {stats['written']} rows written, "
            f"{stats['new_tokens'] / max(elapsed, 1e-9):.0f} new tokens/s")
    return stats
