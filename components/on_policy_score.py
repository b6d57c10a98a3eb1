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
                  num_chunks: int = 8, vocab_size: int | None = None) -> dict[str, list[float]]:
    """Per prompt: the summed reverse KL(student || teacher) at T = 1 over the student's sampled completion, the
    teacher's summed NLL of it, and its token count. `sample(chunk, rows)` samples a chunk of `batch` prompts
    (`rows`: their indices in `prompts`, which fix their sampling noise). The held-out metric of a KD run
    (`OnPolicy.held_out_eval`) and of a study's evaluation of any trained student (bench/kd_study2_onp.py)."""
    metric, device = build_kd_loss("reverse_kl", 1.0), student.tok_embeddings.weight.device
    out: dict[str, list[float]] = {"reverse_kl_sum": [], "teacher_nll_sum": [], "tokens": []}
    training = student.training
    student.eval()
    try:
        for i in range(0, len(prompts), batch):  # training's sampling batch (and the compiled step's shapes)
            chunk = [list(p) for p in prompts[i : i + batch]]
            b = to_device(completion_batch(chunk, sample(chunk, range(i, i + len(chunk))), pad_id), device)
            with torch.inference_mode():
                t_hidden = hidden_states(teacher, b)
            # not inference mode: a sharded student's gathered weights stay normal tensors; eager: the compiled
            # training layers would compile a no-grad variant for this one pass at the end
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
    finally:
        student.train(training)
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
