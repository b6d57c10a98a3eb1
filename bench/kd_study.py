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
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASKS_MAIN = ["recipe_lambada_openai", "recipe_arc_easy", "recipe_piqa"]
TASK_HELLASWAG = "recipe_hellaswag"


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


@dataclass
class Job:
    """One process of the study: a training command line or an evaluation of a model folder."""

    name: str
    kind: str  # "train" | "eval"
    argv: list[str]
    deps: list[str] = field(default_factory=list)
    group: str = ""
    recipe_cmd: str = ""  # the user-facing `recipe run ...` form of a training command

    def command(self) -> str:
        return shlex.join(self.argv)


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


# ----------------------------------------------------------------------------------------------------- run


def _status_path(out: Path, name: str) -> Path:
    return out / "status" / (name.replace(":", "__") + ".json")


def _done(out: Path, name: str) -> bool:
    p = _status_path(out, name)
    return p.is_file() and json.loads(p.read_text()).get("rc") == 0


def _job_env(**extra: str) -> dict[str, str]:
    """The environment of a study subprocess: unbuffered output (llm_recipe comes from the install)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **extra)


def run_jobs(jobs: list[Job], out: Path, max_jobs: int) -> int:
    """Run `jobs` as subprocesses, at most `max_jobs` at once, each after its deps; returns the failure count."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "status").mkdir(parents=True, exist_ok=True)
    env = _job_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    pending = [j for j in jobs if not _done(out, j.name)]
    running: dict[str, tuple[subprocess.Popen, float, Any]] = {}
    failed: set[str] = set()
    t_start = time.time()
    while pending or running:
        for name, (proc, t0, fh) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            fh.close()
            wall = time.time() - t0
            _status_path(out, name).write_text(json.dumps({"rc": rc, "wall_s": round(wall, 1)}) + "\n")
            print(f"[{time.time() - t_start:7.1f}s] {'done' if rc == 0 else f'FAILED rc={rc}'} {name} "
                  f"({wall:.0f}s)", flush=True)
            if rc != 0:
                failed.add(name)
            del running[name]
        for job in list(pending):
            if len(running) >= max_jobs:
                break
            deps = job.deps
            active = {j.name for j in pending} | set(running)
            if any(d in failed or (d not in active and not _done(out, d)) for d in deps):
                print(f"skip {job.name}: a dependency failed", flush=True)
                failed.add(job.name)
                pending.remove(job)
                continue
            if not all(_done(out, d) for d in deps):
                continue
            log = open(out / "logs" / (job.name.replace(":", "__") + ".log"), "w")
            log.write(f"$ {job.command()}\n")
            log.flush()
            proc = subprocess.Popen(job.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running[job.name] = (proc, time.time(), log)
            pending.remove(job)
            print(f"[{time.time() - t_start:7.1f}s] start {job.name}", flush=True)
        time.sleep(1.0)
    return len(failed)


# ------------------------------------------------------------------------------------------------ eval-one


def _metric(res: dict, task: str, key: str) -> float | None:
    v = res.get("results", {}).get(task, {}).get(key)
    return None if v in (None, "N/A") else float(v)


def eval_one(name: str, model_spec: str, out: Path, every: int | None, quant: str | None, s: Scale) -> dict:
    """Evaluate one model on LAMBADA, ARC-Easy, PIQA (+ HellaSwag, maybe limited); write evals/<name>/summary.json."""
    import torch

    from llm_recipe.components.assets import embedded_model_dir
    from llm_recipe.components.eval.run import evaluate
    from llm_recipe.components.models import keep_every, load_model, read_model_args
    from llm_recipe.components.models.tokenizer import Tokenizer

    device = "cuda" if s.device == "auto" and torch.cuda.is_available() else ("cpu" if s.device == "auto"
                                                                               else s.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    src = embedded_model_dir() if model_spec == "embedded" else Path(model_spec)
    keep = keep_every(read_model_args(src).num_layers, every) if every else None
    t0 = time.time()
    model, _ = load_model(src, dtype=dtype, device=device, keep_layers=keep)
    model.eval()
    method = f"{str(dtype).removeprefix('torch.')} weights"
    check: dict[str, Any] = {}
    if quant:
        numerics = s.quant_numerics if s.quant_numerics != "auto" else ("fake" if device.startswith("cuda") else "real")
        if numerics == "fake":
            fake_quantize(model, quant)
            method = f"fake quantization ({quant}, group 32; torchao QAT fake quantizers)"
            check = compare_with_real(model, src, dtype, device, keep, quant)
        else:
            method = quantize_for_eval(model, src, dtype, device, keep, quant)
            if method.startswith("fake"):  # the real quantized model failed here: reload and fake-quantize instead
                model, _ = load_model(src, dtype=dtype, device=device, keep_layers=keep)
                model.eval()
                fake_quantize(model, quant)
    tok = Tokenizer.from_dir(src)
    dest = out / "evals" / name
    res_main = evaluate((model, tok), TASKS_MAIN, limit=s.eval_limit, batch_size=s.eval_batch_size,
                        output_dir=dest / "main")
    write_summary(dest, name, src, keep, quant, method, res_main, {}, t0, check)  # partial, if HellaSwag is cut off
    hs_limit = s.hellaswag_limit if s.eval_limit is None else min(s.eval_limit, s.hellaswag_limit or s.eval_limit)
    res_hs = evaluate((model, tok), [TASK_HELLASWAG], limit=hs_limit, batch_size=s.eval_batch_size,
                      output_dir=dest / "hellaswag")
    return write_summary(dest, name, src, keep, quant, method, res_main, res_hs, t0, check)


def write_summary(dest: Path, name: str, src: Path, keep: list[int] | None, quant: str | None, method: str,
                  res_main: dict, res_hs: dict, t0: float, check: dict | None = None) -> dict:
    """The numbers the study reports for one model, from lm-eval's results, into dest/summary.json."""
    import torch

    n = {**res_main.get("n-samples", {}), **res_hs.get("n-samples", {})}
    summary = {
        "name": name, "model": str(src), "keep_layers": keep, "quant": quant, "method": method, **(check or {}),
        "lambada_acc": _metric(res_main, "recipe_lambada_openai", "acc,none"),
        "lambada_ppl": _metric(res_main, "recipe_lambada_openai", "perplexity,none"),
        "hellaswag_acc_norm": _metric(res_hs, TASK_HELLASWAG, "acc_norm,none"),
        "hellaswag_acc_norm_stderr": _metric(res_hs, TASK_HELLASWAG, "acc_norm_stderr,none"),
        "arc_easy_acc": _metric(res_main, "recipe_arc_easy", "acc,none"),
        "arc_easy_acc_norm": _metric(res_main, "recipe_arc_easy", "acc_norm,none"),
        "piqa_acc": _metric(res_main, "recipe_piqa", "acc,none"),
        "piqa_acc_norm": _metric(res_main, "recipe_piqa", "acc_norm,none"),
        "n_samples": {k: v.get("effective") for k, v in n.items()},
        "eval_s": round(time.time() - t0, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return summary


def quantize_for_eval(model: Any, src: Path, dtype: Any, device: str, keep: list[int] | None, scheme: str) -> str:
    """Quantize `model` in place with torchao (PTQ, as deployment would); if that fails or cannot run a forward
    on this device, say so: the caller then evaluates the same numerics with fake quantization."""
    import torch

    from llm_recipe.components.quantization import quantize_model

    try:
        quantize_model(model, scheme, 32)
        with torch.no_grad():
            model(torch.zeros(1, 8, dtype=torch.long, device=device) + 100)
        return f"torchao {scheme} quantized tensors (group 32)"
    except Exception as e:  # noqa: BLE001 - any failure of the real kernel falls back to fake quant, and is reported
        print(f"real {scheme} quantization failed on {device}: {type(e).__name__}: {e}", file=sys.stderr)
        return f"fake quantization ({scheme}, group 32; real kernel failed: {type(e).__name__})"


def compare_with_real(fake: Any, src: Path, dtype: Any, device: str, keep: list[int] | None, scheme: str) -> dict:
    """Logits of the fake-quantized model vs torchao's real quantized one on a fixed batch (both on `device`):
    the evidence that evaluating through fake quantization measures the deployed numerics."""
    import torch

    from llm_recipe.components.models import load_model
    from llm_recipe.components.quantization import quantize_model

    real, _ = load_model(src, dtype=dtype, device=device, keep_layers=keep)
    real.eval()
    quantize_model(real, scheme, 32)
    tokens = torch.randint(0, 49152, (4, 128), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        a, b = real(tokens).float(), fake(tokens).float()
    return {"real_vs_fake_max_abs_logit_diff": float((a - b).abs().max()),
            "real_vs_fake_argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


def fake_quantize(model: Any, scheme: str) -> None:
    """torchao's QAT fake quantizers (the same int8 dynamic-activation / int4 group-32 rounding), switched on."""
    from llm_recipe.components.quantization import prepare_qat, set_fake_quant_enabled

    prepare_qat(model, scheme, 32)
    set_fake_quant_enabled(model, True)


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


def _run_stats(run_dir: Path) -> dict | None:
    """A training run's steps, final losses (mean of the last 20 steps), tokens/s (mean after the first 5 steps)
    and peak memory, from its metrics.jsonl; None if it has none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    tail = rows[-20:]
    steady = rows[5:] or rows

    def mean(key: str, rs: list[dict]) -> float | None:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "steps": rows[-1].get("step"),
        "final_loss": mean("loss", tail), "final_ce": mean("ce_loss", tail), "final_kd": mean("kd_loss", tail),
        "tokens_per_s": mean("tokens_per_s", steady),
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in rows),
    }


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
