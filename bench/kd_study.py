"""The KD / QAT / low-bit-optimizer study on the embedded SmolLM2-135M-Instruct (docs/kd_study.md).

Every training row is one `recipe run ...` command line (printed by `plan`, stored in results.json); every
evaluation row is one `eval-one` of this script (lm-eval through llm_recipe.components.eval.run.evaluate on the offline
task pack). Jobs run as parallel processes on one GPU (a 135M model leaves it mostly idle), in dependency order,
and a job already finished in `--out` is skipped, so an interrupted study resumes.

    python bench/kd_study.py plan                        # the jobs and their exact commands
    python bench/kd_study.py run --jobs 14               # train + evaluate everything (GPU)
    python bench/kd_study.py run --only sft,kd_fkl_0.5   # a subset (dependencies are not added)
    python bench/kd_study.py collect                     # results.json + markdown tables from --out
    python bench/kd_study.py plot --png docs/kd_study_loss.png
    python bench/kd_study.py throughput                  # single-run tokens/s (run with the device otherwise idle)
    python bench/kd_study.py eval-one --name teacher --model embedded   # used by `run`
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the scheduler and eval-one live in their own modules; their names stay importable from here
from bench.kd_study_eval import (  # noqa: E402, F401
    TASK_HELLASWAG,
    TASKS_MAIN,
    _metric,
    compare_with_real,
    eval_one,
    fake_quantize,
    quantize_for_eval,
    write_summary,
)
from bench.kd_study_jobs import Job, _done, _job_env, _run_stats, _status_path, run_jobs  # noqa: E402, F401


@dataclass
class Scale:
    """The knobs that size the study (defaults: the GPU run in docs/kd_study.md)."""

    steps: int = 500
    batch_size: int = 16
    seq_len: int = 256
    lr_student: float = 2e-4
    lr_teacher: float = 2e-5
    warmup: int = 20
    every: int = 2
    eval_limit: int | None = None  # None: full validation sets
    hellaswag_limit: int | None = None  # first N HellaSwag items (None: all 10042)
    eval_batch_size: int = 64
    device: str = "auto"
    quant_numerics: str = "auto"  # quantized evals: "real" torchao tensors, "fake" quantizers, auto = fake on CUDA



def _f(x: float) -> str:
    return f"{x:.1e}"  # 2.0e-04: a float in omegaconf and YAML alike


def training_jobs(s: Scale, out: Path) -> list[Job]:
    """The training rows: teacher fine-tune (also QAT's plain FT), QAT FT, and the students."""
    common = [f"max_steps={s.steps}", f"batch_size={s.batch_size}", f"dataset.max_seq_len={s.seq_len}",
              f"lr_scheduler.warmup_steps={s.warmup}", f"device={s.device}",
              *(["compile=false"] if s.device == "cpu" else [])]  # the study configs compile (a GPU setting)
    rows: list[tuple[str, str, str, list[str], list[str], str]] = [
        ("teacher_ft", "full", "full/smollm2_study", [f"optimizer.lr={_f(s.lr_teacher)}"], [], "qat"),
        ("qat_ft", "qat", "qat/smollm2_study", [f"optimizer.lr={_f(s.lr_teacher)}"], [], "qat"),
    ]
    # The same two fine-tunes with bf16 stochastic rounding in the optimizer (torchao's AdamW): in pure bf16 an
    # update of lr 2e-5 rounds away for most weights, which leaves QAT little room to adapt (docs/kd_study.md).
    sr = ["optimizer._component_=torchao.optim._AdamW", "optimizer.bf16_stochastic_round=true"]
    rows += [
        ("teacher_ft_sr", "full", "full/smollm2_study", [f"optimizer.lr={_f(s.lr_teacher)}", *sr], [], "qat_sr"),
        ("qat_ft_sr", "qat", "qat/smollm2_study", [f"optimizer.lr={_f(s.lr_teacher)}", *sr], [], "qat_sr"),
    ]
    student = [f"student.every={s.every}", f"optimizer.lr={_f(s.lr_student)}"]
    kd_rows = [
        ("sft", ["kd.kd_ratio=0.0"], "kd"),
        ("kd_fkl_0.25", ["kd.loss=forward_kl", "kd.kd_ratio=0.25"], "kd"),
        ("kd_fkl_0.5", ["kd.loss=forward_kl", "kd.kd_ratio=0.5"], "kd"),
        ("kd_fkl_0.75", ["kd.loss=forward_kl", "kd.kd_ratio=0.75"], "kd"),
        ("kd_fkl_1.0", ["kd.loss=forward_kl", "kd.kd_ratio=1.0"], "kd"),
        ("kd_rkl_0.5", ["kd.loss=reverse_kl", "kd.kd_ratio=0.5"], "kd"),
        ("kd_skl_0.5", ["kd.loss=symmetric_kl", "kd.kd_ratio=0.5"], "kd"),
        ("kd_jsd_0.5", ["kd.loss=jsd", "kd.beta=0.5", "kd.kd_ratio=0.5"], "kd"),
        ("kd_fkl_0.5_adamw8bit", ["kd.loss=forward_kl", "kd.kd_ratio=0.5",
                                  "optimizer._component_=torchao.optim.AdamW8bit"], "optim"),
        ("kd_fkl_0.5_adamw4bit", ["kd.loss=forward_kl", "kd.kd_ratio=0.5",
                                  "optimizer._component_=torchao.optim.AdamW4bit"], "optim"),
    ]
    for name, extra, group in kd_rows:
        rows.append((name, "kd", "kd/smollm2_study", student + extra, [], group))
    rows.append(("kd_fkl_0.5_ftteacher", "kd", "kd/smollm2_study",
                 student + ["kd.loss=forward_kl", "kd.kd_ratio=0.5",
                            f"teacher.checkpoint_dir={out / 'train' / 'teacher_ft' / 'model'}"],
                 ["teacher_ft"], "kd"))
    jobs = []
    for name, recipe, config, extra, deps, group in rows:
        # a job that did not finish is run again from scratch: overwrite=true replaces its partial outputs
        overrides = [f"output_dir={out / 'train' / name}", "overwrite=true", *common, *extra]
        argv = [sys.executable, "-m", "llm_recipe.cli.main", "run", recipe, "--config", config, *overrides]
        jobs.append(Job(name, "train", argv, deps, group,
                        shlex.join(["recipe", "run", recipe, "--config", config, *overrides])))
    return jobs


def eval_jobs(s: Scale, out: Path) -> list[Job]:
    """The evaluation rows: teacher (bf16, PTQ), fine-tuned teacher (bf16, PTQ), QAT, pruned baseline, students."""
    # the QAT groups' fine-tunes are evaluated by the explicit rows below (bf16, PTQ, QAT); every student as is
    students = [j.name for j in training_jobs(s, out) if j.group not in ("qat", "qat_sr")]
    rows: list[tuple[str, str, list[str], list[str], str]] = [
        ("teacher", "embedded", [], [], "kd"),
        ("teacher_ptq", "embedded", ["--quant", "8da4w"], [], "qat"),
        ("student_base", "embedded", ["--every", str(s.every)], [], "kd"),
        ("teacher_ft", str(out / "train/teacher_ft/model"), [], ["teacher_ft"], "qat"),
        ("teacher_ft_ptq", str(out / "train/teacher_ft/model"), ["--quant", "8da4w"], ["teacher_ft"], "qat"),
        ("qat_ft_8da4w", str(out / "train/qat_ft/model"), ["--quant", "8da4w"], ["qat_ft"], "qat"),
        ("teacher_ft_sr", str(out / "train/teacher_ft_sr/model"), [], ["teacher_ft_sr"], "qat_sr"),
        ("teacher_ft_sr_ptq", str(out / "train/teacher_ft_sr/model"), ["--quant", "8da4w"], ["teacher_ft_sr"],
         "qat_sr"),
        ("qat_ft_sr_8da4w", str(out / "train/qat_ft_sr/model"), ["--quant", "8da4w"], ["qat_ft_sr"], "qat_sr"),
    ]
    for name in students:
        rows.append((name, str(out / "train" / name / "model"), [], [name], "kd"))
    jobs = []
    for name, model, extra, deps, group in rows:
        argv = [sys.executable, "bench/kd_study.py", "eval-one", "--name", name, "--model", model,
                "--out", str(out), *extra, *scale_flags(s)]
        jobs.append(Job(f"eval:{name}", "eval", argv, [d for d in deps], group))
    return jobs


def scale_flags(s: Scale) -> list[str]:
    """The CLI flags that reproduce `s` (eval-one needs the eval knobs)."""
    flags = ["--eval-batch-size", str(s.eval_batch_size), "--device", s.device, "--quant-numerics", s.quant_numerics]
    if s.eval_limit is not None:
        flags += ["--eval-limit", str(s.eval_limit)]
    flags += ["--hellaswag-limit", "all" if s.hellaswag_limit is None else str(s.hellaswag_limit)]
    return flags


def all_jobs(s: Scale, out: Path) -> list[Job]:
    return training_jobs(s, out) + eval_jobs(s, out)


# ---------------------------------------------------------------------------------------------- throughput


def throughput(s: Scale, out: Path, steps: int) -> dict:
    """Single-run training speed (each run alone on the device): the KD student and the 135M full fine-tune,
    `steps` steps of the study's own command lines; the first 5 steps (warm-up, allocator growth) are dropped."""
    result = {}
    for name in ("kd_fkl_0.5", "teacher_ft", "qat_ft"):
        job = next(j for j in training_jobs(s, out) if j.name == name)
        dest = out / "throughput" / name
        new = {"output_dir": str(dest), "max_steps": str(steps)}
        argv = [f"{k}={new[k]}" if (k := a.split("=")[0]) in new else a for a in job.argv]
        t0 = time.time()
        subprocess.run(argv, cwd=ROOT, env=_job_env(), check=True, stdout=subprocess.DEVNULL)
        stats = _run_stats(dest) or {}
        result[name] = {"steps": steps, "tokens_per_s": stats.get("tokens_per_s"),
                        "peak_memory_gib": stats.get("peak_memory_gib"),
                        "process_wall_s": round(time.time() - t0, 1), "command": shlex.join(argv)}
        print(name, json.dumps(result[name]), flush=True)
    (out / "throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# ------------------------------------------------------------------------------------------------- collect


def _train_summary(out: Path, name: str) -> dict | None:
    stats = _run_stats(out / "train" / name)
    if stats is None:
        return None
    status = _status_path(out, name)
    return {**stats, "train_wall_s": json.loads(status.read_text()).get("wall_s") if status.is_file() else None}


def collect(s: Scale, out: Path) -> dict:
    """Gather every job's command, training summary and eval summary into out/results.json."""
    jobs = all_jobs(s, out)
    result: dict[str, Any] = {"scale": asdict(s), "train": {}, "eval": {}}
    for j in jobs:
        if j.kind == "train":
            result["train"][j.name] = {"command": j.recipe_cmd, "group": j.group, **(_train_summary(out, j.name) or {})}
        else:
            name = j.name.removeprefix("eval:")
            p = out / "evals" / name / "summary.json"
            result["eval"][name] = {"command": j.command().replace(sys.executable, "python"), "group": j.group,
                                    **(json.loads(p.read_text()) if p.is_file() else {})}
    tp = out / "throughput.json"
    if tp.is_file():
        result["throughput"] = json.loads(tp.read_text())
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(out: Path, png: Path) -> None:
    """Loss curves: students' CE on the transfer set, teacher FT vs QAT FT, and the KD run's three optimizers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(name: str, key: str) -> tuple[list[int], list[float]]:
        path = out / "train" / name / "metrics.jsonl"
        if not path.is_file():
            return [], []
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        xs = [r["step"] for r in rows if r.get(key) is not None]
        ys = [r[key] for r in rows if r.get(key) is not None]
        k = 10  # moving average over 10 steps
        sm = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
        return xs, sm

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    for name in ("sft", "kd_fkl_0.25", "kd_fkl_0.5", "kd_fkl_0.75", "kd_fkl_1.0", "kd_rkl_0.5", "kd_skl_0.5",
                 "kd_jsd_0.5", "kd_fkl_0.5_ftteacher"):
        xs, ys = curve(name, "ce_loss")
        if xs:
            ax.plot(xs, ys, label=name, lw=1.2)
    ax.set(title="students: CE on the transfer set (10-step mean)", xlabel="step", ylabel="cross-entropy (nats)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 8))
    ax.legend(fontsize=7)
    ax = axes[1]
    labels = {"teacher_ft": "full FT (bf16)", "qat_ft": "QAT FT (8da4w fake quant)",
              "teacher_ft_sr": "full FT (bf16 + stochastic rounding)", "qat_ft_sr": "QAT FT (+ stochastic rounding)"}
    for name, label in labels.items():
        xs, ys = curve(name, "loss")
        if xs:
            ax.plot(xs, ys, label=label, ls="--" if name.endswith("_sr") else "-")
    ax.set(title="135M model: plain vs QAT fine-tune", xlabel="step", ylabel="CE loss")
    ax.legend(fontsize=8)
    ax = axes[2]
    for name, label in (("kd_fkl_0.5", "AdamW"), ("kd_fkl_0.5_adamw8bit", "AdamW8bit"),
                        ("kd_fkl_0.5_adamw4bit", "AdamW4bit")):
        xs, ys = curve(name, "loss")
        if xs:
            ax.plot(xs, ys, label=label)
    ax.set(title="KD (forward KL, ratio 0.5): optimizers", xlabel="step", ylabel="0.5 CE + 0.5 KD")
    ax.set_ylim(top=min(ax.get_ylim()[1], 8))
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


# ---------------------------------------------------------------------------------------------------- main


def _scale_from(args: argparse.Namespace) -> Scale:
    hs = None if args.hellaswag_limit in (None, "all", "None") else int(args.hellaswag_limit)
    return Scale(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr_student=args.lr_student,
                 lr_teacher=args.lr_teacher, warmup=args.warmup, every=args.student_every,
                 eval_limit=args.eval_limit, hellaswag_limit=hs, eval_batch_size=args.eval_batch_size,
                 device=args.device, quant_numerics=args.quant_numerics)


def main(argv: list[str] | None = None) -> int:
    """Parse the phase and the scale flags, then plan / run / collect / plot / eval-one."""
    d = Scale()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["plan", "run", "collect", "plot", "eval-one", "throughput"])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "kd_study")
    p.add_argument("--jobs", type=int, default=14, help="processes at once (they share one GPU)")
    p.add_argument("--only", default=None, help="comma-separated job names (eval jobs: eval:NAME)")
    p.add_argument("--kind", choices=["train", "eval"], default=None, help="run only training or only eval jobs")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr-student", type=float, default=d.lr_student)
    p.add_argument("--lr-teacher", type=float, default=d.lr_teacher)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--student-every", type=int, default=d.every)
    p.add_argument("--eval-limit", type=int, default=d.eval_limit)
    p.add_argument("--hellaswag-limit", default="all" if d.hellaswag_limit is None else str(d.hellaswag_limit))
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--device", default=d.device)
    p.add_argument("--quant-numerics", choices=["auto", "real", "fake"], default=d.quant_numerics,
                   help="quantized evals: torchao's real tensors or QAT fake quantizers (auto: fake on CUDA, where "
                        "real 8da4w evaluated slower than bf16; summary.json records how far the two differ)")
    p.add_argument("--throughput-steps", type=int, default=60, help="throughput: steps of each single run")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "kd_study_loss.png")
    # eval-one
    p.add_argument("--name")
    p.add_argument("--model")
    p.add_argument("--every", type=int, default=None, help="eval-one: prune to every k-th layer first")
    p.add_argument("--quant", default=None, help="eval-one: quantize (8da4w) before evaluating")
    args = p.parse_args(argv)
    s = _scale_from(args)
    out = args.out.resolve()
    if out.is_relative_to(ROOT):  # commands name paths relative to the repo root (jobs run there)
        out = out.relative_to(ROOT)
    if args.phase == "eval-one":
        eval_one(args.name, args.model, out, args.every, args.quant, s)
        return 0
    if args.phase == "plot":
        plot(out, args.png)
        return 0
    if args.phase == "throughput":
        throughput(s, out, args.throughput_steps)
        collect(s, out)
        return 0
    jobs = all_jobs(s, out)
    if args.kind:
        jobs = [j for j in jobs if j.kind == args.kind]
    if args.only:
        keep = set(args.only.split(","))
        jobs = [j for j in jobs if j.name in keep]
    if args.phase == "plan":
        for j in jobs:
            print(f"# {j.name} (after: {', '.join(j.deps) or '-'})\n{j.recipe_cmd or j.command()}\n")
        return 0
    if args.phase == "run":
        failed = run_jobs(jobs, out, args.jobs)
        collect(s, out)
        return 1 if failed else 0
    res = collect(s, out)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
