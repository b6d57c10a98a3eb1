"""On-policy KD's held-out metric (components/on_policy.py): per prompt, the teacher-scored reverse KL of the
student's sampled completion and the teacher's NLL of it; what a KD run reports at its end and what
bench/kd_study2_onp.py scores every student of the KD study with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .losses import LiveTeacher, build_kd_loss, kd_and_ce
from .on_policy_sampling import completion_batch
from .training import hidden_states, to_device


def score_samples(student: nn.Module, teacher: nn.Module, prompts: Sequence[Sequence[int]],
                  sample: Callable[[list[list[int]], range], list[list[int]]], batch: int, pad_id: int,
                  num_chunks: int = 8, vocab_size: int | None = None, rank: int = 0, world: int = 1,
                  gather: Callable[[Any], list[Any]] | None = None) -> dict[str, list[float]]:
    """Per prompt: the summed reverse KL(student || teacher) at T = 1 over the student's sampled completion, the
    teacher's summed NLL of it, and its token count. `sample(chunk, rows)` samples a chunk of `batch` prompts
    (`rows`: their indices in `prompts`, which fix their sampling noise). The held-out metric of a KD run
    (`OnPolicy.held_out_eval`) and of a study's evaluation of any trained student (bench/kd_study2_onp.py).

    On `world` processes rank r samples and scores chunks r, r + world, ... (each a `world`-th of the time), and
    `gather` (an all_gather_object: a list of every rank's object) gives every rank all the scores in prompt order.
    A rank left a chunk short in the last round scores a chunk of its own again and drops it: every rank runs as
    many forwards and decode loops as the others (a sharded model's collectives, the eager sampler's all-reduce)."""
    starts = list(range(0, len(prompts), batch))
    mine: list[tuple[int, dict[str, list[float]]]] = []
    training = student.training
    student.eval()
    try:
        for k in range(rank, -(-len(starts) // world) * world, world):
            i = starts[k if k < len(starts) else rank % len(starts)]  # past the end: a real chunk, scored again
            chunk = [list(p) for p in prompts[i : i + batch]]
            scores = _score_chunk(student, teacher, chunk, sample(chunk, range(i, i + len(chunk))), pad_id,
                                  num_chunks, vocab_size)
            if k < len(starts):
                mine.append((k, scores))
    finally:
        student.train(training)
    ranks = gather(mine) if gather is not None else [mine]
    out: dict[str, list[float]] = {"reverse_kl_sum": [], "teacher_nll_sum": [], "tokens": []}
    for _, scores in sorted((part for parts in ranks for part in parts), key=lambda part: part[0]):
        for key, values in scores.items():
            out[key] += values
    return out


def _score_chunk(student: nn.Module, teacher: nn.Module, chunk: list[list[int]], completions: list[list[int]],
                 pad_id: int, num_chunks: int, vocab_size: int | None) -> dict[str, list[float]]:
    """`score_samples`' sums for one chunk of prompts and their sampled completions."""
    metric, device = build_kd_loss("reverse_kl", 1.0), student.tok_embeddings.weight.device
    out: dict[str, list[float]] = {"reverse_kl_sum": [], "teacher_nll_sum": [], "tokens": []}
    b = to_device(completion_batch(chunk, completions, pad_id), device)
    # eager, both: the compiled layers would compile a variant of another shape (for dynamic sizes) for this pass
    with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
        t_hidden = hidden_states(teacher, b)
    # not inference mode: a sharded student's gathered weights stay normal tensors
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        s_hidden = hidden_states(student, b)
        for r in range(len(chunk)):  # one prompt at a time: its own sums (a row is one prompt's sample)
            labels, t = b["labels"][r : r + 1], t_hidden[r : r + 1]
            parts = kd_and_ce(s_hidden[r : r + 1], student.output, labels, LiveTeacher(t, teacher.output),
                              metric, 1.0, num_chunks=num_chunks, vocab_size=vocab_size)
            nll = kd_and_ce(t, teacher.output, labels, num_chunks=num_chunks, vocab_size=vocab_size)["ce"]
            out["reverse_kl_sum"].append(float(parts["kd"]))
            out["teacher_nll_sum"].append(float(nll))
            out["tokens"].append(int(parts["n"]))
    return out


def per_prompt_summary(scores: dict[str, list[float]]) -> dict[str, Any]:
    """`score_samples`' sums as per-prompt means per sampled token (rounded: the file stays small), their means
    over prompts (each prompt weighs the same, as in a paired comparison across prompts) and the prompt count."""
    n = [max(int(k), 1) for k in scores["tokens"]]
    rkl = [round(v / k, 6) for v, k in zip(scores["reverse_kl_sum"], n, strict=True)]
    nll = [round(v / k, 6) for v, k in zip(scores["teacher_nll_sum"], n, strict=True)]
    return {"prompts": len(n), "reverse_kl_mean": sum(rkl) / max(len(rkl), 1),
            "teacher_nll_mean": sum(nll) / max(len(nll), 1),
            "per_prompt": {"reverse_kl": rkl, "teacher_nll": nll, "tokens": [int(k) for k in scores["tokens"]]}}
