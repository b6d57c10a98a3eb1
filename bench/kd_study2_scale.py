"""The second KD study's rows and sizes (Scale, presets, --variant rows), shared by its plan and collect."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from bench import kd_study2_onp as onp

LAMBADA = "recipe_lambada_openai"
# multiple-choice tasks scored by acc_norm (lm-eval's length-normalized choice): summary key -> offline task
CHOICE_TASKS = {"hellaswag": "recipe_hellaswag", "arc_easy": "recipe_arc_easy", "piqa": "recipe_piqa"}
ROWS = ("teacher", "teacher_ptq", "pruned", "sft", "kd", "kd_r1", "kd_cache", "kd_ptq", "qat", "kd_qat")
STUDENTS = ("sft", "kd", "kd_r1", "kd_cache")  # the pruned students, all trained from the same layer list
TRAINED = (*STUDENTS, "qat", "kd_qat")


@dataclass
class Scale:
    """Defaults: the GPU run (1250 steps x 32 x 512 = 20.5M tokens per training run)."""

    teacher: str = "embedded"
    steps: int = 1250
    batch_size: int = 32
    seq_len: int = 512
    keep: int = 20  # student layers (of 30), chosen by loss_drop importance
    calibration_tokens: int = 16384
    lr_student: float = 2e-4
    lr_quant: float = 5e-5  # QAT and KD-QAT start from the teacher's weights; at 20.5M tokens 5e-5 beat 1e-4 (KD-QAT
    #                         recovered 85% of the PTQ loss instead of 77%; docs/kd_study.md, the sweep); 2e-5
    #                         recovered half at 6.6M tokens, where 1e-4 won (the `lease` preset keeps it)
    samples_per_prompt: int = 16  # transfer set: 16 continuations per passage opening
    max_new_tokens: int = 480
    gen_batch_size: int = 512
    passages: int | None = None  # transfer prompts (None: all shipped ones)
    chat: int | None = 0  # chat answers: none (the students train on passages.jsonl only)
    mix_chat: int = 1043  # data=chat_mix rows: the teacher answers the first N chat questions (the on-policy rows'
    #                       prompts and held-out metric use the rest: transfer:chat train[1043:])
    eval_limit: int | None = None  # None: full LAMBADA (5153), HellaSwag (10042), ARC-Easy (2376), PIQA (1838)
    eval_batch_size: int = 64
    device: str = "auto"
    compile: bool = True  # torch.compile each layer of the bf16 students (the fast setting on a GPU)
    compile_quant: bool = False  # also for QAT / KD-QAT (their fake quantizers are compiled on a GPU anyway;
    #                              layer compile around them is not measured yet, so off: a failure costs a lease)
    cache_top_k: int = 32  # kd_cache: teacher log-probs kept per token
    # sweep rows, "NAME=BASE:key=value,key=value": BASE's training with the overrides appended, evaluated like
    # BASE and compared with it on the same items; `cache.*` keys (cache.top_k=K, cache.mode=sampled,
    # cache.samples=N) give the row its own cache built with them
    variants: list[str] = field(default_factory=list)
    rows: list[str] | None = None  # run only these rows (their evaluations and the jobs they need); None: all
    pairs: list[str] = field(default_factory=list)  # extra paired comparisons "BASE:ROW" (collect)
    onp_probe_steps: int = 40  # on-policy rows: steps of each row's timing probe (the first quarter is warm-up)
    onp_prompts: int = 512  # held-out chat prompts of the on-policy metric
    onp_new_tokens: int = 64  # tokens each student samples per prompt there (kd.on_policy's default)
    onp_batch: int = 256  # prompts sampled at once there
    onp_overrides: list[str] = field(default_factory=list)  # appended to the on-policy rows' training

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.batch_size * self.seq_len


TINY = dict(steps=2, batch_size=2, seq_len=32, keep=2, calibration_tokens=64, samples_per_prompt=1,
            max_new_tokens=8, gen_batch_size=4, passages=4, chat=0, mix_chat=16, eval_limit=4, eval_batch_size=4, device="cpu",
            compile=False, onp_probe_steps=3, onp_prompts=4, onp_new_tokens=4, onp_batch=4,
            onp_overrides=["kd.on_policy.max_new_tokens=8", "kd.on_policy.prompt_tokens=8"])
# One 30-minute lease of one H200 (bench/device_study2.sh, bench/README.md): every row, full evals, 400 steps x
# 32 x 512 = 6.6M tokens per training run (the 20.5M does not fit with six trainings, two of them 30-layer
# QAT runs, at the first study's measured GPU rate) over ~3-4.5M teacher-written tokens (4 continuations of each of
# the 2507 passage openings): about 2 epochs.
LEASE = dict(steps=400, samples_per_prompt=4, gen_batch_size=1024, lr_quant=1e-4)
# The 20.5M tokens per row in one lease, planned from the measured lease: the transfer set with the compiled
# decode step (2.45x eager) at 8 continuations (~10M tokens, 2 epochs), trainings ~3.1x the lease rows.
LEASE_20M = dict(steps=1250, samples_per_prompt=8, gen_batch_size=1024)
PRESETS = {"gpu": {}, "lease": LEASE, "lease20m": LEASE_20M, "tiny": TINY}


def _teacher(s: Scale) -> str:
    if s.teacher == "embedded":
        from llm_recipe.components.assets import embedded_model_dir

        return str(embedded_model_dir())
    return s.teacher


def parse_variants(s: Scale) -> list[tuple[str, str, list[str]]]:
    """`Scale.variants` as (name, base row, overrides); a malformed one is a one-line error naming it."""
    out = []
    for v in s.variants:
        name, _, rest = v.partition("=")
        base, _, overrides = rest.partition(":")
        if not name.isidentifier() or name in (*ROWS, *onp.ONP_ROWS) or base not in TRAINED or not overrides:
            raise SystemExit(f"--variant {v!r}: expected NAME=BASE:key=value[,key=value] with a new NAME and BASE "
                             f"one of {', '.join(TRAINED)}")
        out.append((name, base, overrides.split(",")))
    return out


def _keep(out: Path) -> list[int] | None:
    p = out / "layers" / "layer_importance.json"
    return json.loads(p.read_text())["kept"] if p.is_file() else None
