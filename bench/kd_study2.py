"""Second KD study (issue 11): does distillation beat plain fine-tuning once the student can learn?

Differences from bench/kd_study.py (the "before" in docs/kd_study.md): the student is pruned by measured layer
importance (`student.prune`, >= 20 of 30 layers kept), every run sees >= 20M tokens of teacher-written transfer
data (`recipe run transfer`), students train with the configs' optimizer (MasterWeightAdamW: fp32 master weights), and
every cell carries a standard error. Rows:

- teacher (bf16) and teacher_ptq (8da4w post-training quantization of the teacher);
- pruned: the importance-pruned student, untrained; sft (kd_ratio 0), kd (forward KL, kd_ratio 0.5), kd_r1
  (kd_ratio 1.0) and kd_cache (kd_ratio 0.5 from the teacher's top-32 cache, `recipe run kd_logits` +
  `teacher.logits_dir`) from it, same data, steps and tokens; kd_ptq: 8da4w PTQ of the kd student;
- qat: plain QAT fine-tune of the teacher (8da4w fake quantizers, CE only); kd_qat: the same student distilled
  from the bf16 teacher (KD-QAT: kd recipe with `qat:`, kd_ratio 1.0); both at lr 1e-4, converted/evaluated as
  8da4w, with the fraction of the PTQ loss they recover: (row - ptq) / (teacher - ptq);
- onp50, onp100 (issue 22, only when named in --rows): kd_r1 with on-policy KD at equal GPU time, scored by the
  held-out on-policy metric too (bench/kd_study2_onp.py); onp50c, onp100c: the same with on-policy prompts from
  the shipped chat set (`kd.on_policy.prompts`, rows apart from the evaluated ones) instead of passage openings.

    python bench/kd_study2.py plan                  # the commands (the layer list once `prune` has run)
    python bench/kd_study2.py run --jobs 6          # transfer set -> layer scores -> trainings -> evals -> table
    python bench/kd_study2.py run --scale lease --jobs 10   # every row at a size that fits one 30-minute GPU lease
    python bench/kd_study2.py collect               # out/results.json and out/table.md from what is there
Tiny end-to-end check on CPU (tests/test_kd_study2.py): --tiny.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import kd_study2_data as mixdata  # noqa: E402
from bench import kd_study2_onp as onp  # noqa: E402
from bench.kd_study import Job, _run_stats, _status_path, fake_quantize, quantize_for_eval, run_jobs  # noqa: E402, F401

# the rows and sizes, and collect, live in their own modules; their names stay importable from here
from bench.kd_study2_collect import LOWER_IS_BETTER, _fractions, _metrics, _paired, collect  # noqa: E402, F401
from bench.kd_study2_scale import (  # noqa: E402, F401
    CHOICE_TASKS,
    LAMBADA,
    LEASE,
    LEASE_20M,
    PRESETS,
    ROWS,
    STUDENTS,
    TINY,
    TRAINED,
    Scale,
    _keep,
    _teacher,
    parse_variants,
)


def _f(x: float) -> str:
    return f"{x:.1e}"


def _recipe(name: str, recipe: str, config: str, overrides: list[str], deps: list[str], group: str) -> Job:
    argv = [sys.executable, "-m", "llm_recipe.cli.main", "run", recipe, "--config", config, *overrides]
    return Job(name, "train", argv, deps, group, shlex.join(["recipe", "run", recipe, "--config", config, *overrides]))


def setup_jobs(s: Scale, out: Path) -> list[Job]:
    """The teacher-written transfer set, then the layer scores on it (one list for every student)."""
    t = _teacher(s)
    transfer = _recipe("transfer", "transfer", "transfer/smollm2", [
        f"output_dir={out / 'transfer'}", f"teacher.checkpoint_dir={t}", f"device={s.device}",
        f"prompts.passages={'null' if s.passages is None else s.passages}",
        f"prompts.chat={'null' if s.chat is None else s.chat}", f"prompts.samples_per_prompt={s.samples_per_prompt}",
        f"generation.max_new_tokens={s.max_new_tokens}", f"generation.batch_size={s.gen_batch_size}"], [], "data")
    prune = Job("prune", "train", [sys.executable, str(ROOT / "bench" / "kd_study2.py"), "prune", "--out", str(out),
                                   *scale_flags(s)], ["transfer"], "data")
    return [transfer, prune]


def training_jobs(s: Scale, out: Path, keep: list[int]) -> list[Job]:
    """The trainings (equal steps, batch and sequence length: equal tokens) and the teacher's top-k cache.
    Finished jobs are skipped by the scheduler; an unfinished one restarts from scratch (overwrite=true)."""
    t = _teacher(s)
    data = [f"dataset.source={out / 'transfer' / 'passages.jsonl'}", "dataset.format=text",
            f"dataset.max_seq_len={s.seq_len}"]
    common = [f"teacher.checkpoint_dir={t}", f"max_steps={s.steps}", f"batch_size={s.batch_size}",
              f"device={s.device}", "save_every_n_steps=null", *data,
              "overwrite=true"]  # a job that did not finish is run again from scratch
    fast = [f"compile={str(s.compile).lower()}"]
    fast_quant = [f"compile={str(s.compile and s.compile_quant).lower()}"]
    student = [f"student.keep_layers=[{','.join(map(str, keep))}]", "student.every=null",
               f"optimizer.lr={_f(s.lr_student)}", "kd.loss=forward_kl", *fast]
    quant = [f"optimizer.lr={_f(s.lr_quant)}", *fast_quant]
    cache = out / "kd_logits"

    def kd_student(name: str, extra: list[str], deps: list[str]) -> Job:
        return _recipe(name, "kd", "kd/smollm2_study", [f"output_dir={out / 'train' / name}", *common, *student,
                                                        *extra], deps, "kd")

    jobs = [
        kd_student("sft", ["kd.kd_ratio=0.0"], ["prune"]),
        kd_student("kd", ["kd.kd_ratio=0.5"], ["prune"]),
        kd_student("kd_r1", ["kd.kd_ratio=1.0"], ["prune"]),
        # the teacher's top-k log-probs over the same tokenized, packed transfer set (kd checks the manifest);
        # cache.mode=topk pinned: kd_cache is the measured top-32 row, whatever kd_logits' default (sampled)
        _recipe("kd_logits", "kd_logits", "kd_logits/smollm2_demo", [
            f"output_dir={cache}", f"teacher.checkpoint_dir={t}", f"device={s.device}", *data,
            f"batch_size={s.batch_size}", "cache.mode=topk", f"cache.top_k={s.cache_top_k}", "compile=false"],
                ["transfer"], "cache"),
        kd_student("kd_cache", ["kd.kd_ratio=0.5", f"teacher.logits_dir={cache}"], ["prune", "kd_logits"]),
        _recipe("kd_qat", "kd", "kd/smollm2_study", [f"output_dir={out / 'train/kd_qat'}", *common, *quant,
                                                     "student.every=null", "kd.loss=forward_kl", "kd.kd_ratio=1.0",
                                                     "qat={scheme: 8da4w, group_size: 32, include_output: false, convert: false}"],
                ["transfer"], "quant"),
    ]
    qat_common = [o for o in common if not o.startswith("teacher.")] + [f"model.checkpoint_dir={t}", "qat.convert=false"]
    jobs.append(_recipe("qat", "qat", "qat/smollm2_study", [f"output_dir={out / 'train/qat'}", *qat_common, *quant],
                        ["transfer"], "quant"))
    for name, base, overrides in parse_variants(s):
        job = next(j for j in jobs if j.name == base)
        argv = [a for a in job.argv if not a.startswith("output_dir=")] + [f"output_dir={out / 'train' / name}"]
        deps = list(job.deps)
        own = [o for o in overrides if o.startswith("cache.")]  # cache.top_k=K, cache.mode=sampled, cache.samples=N
        if own:  # its own cache with those keys, over the same packed transfer set
            logits = next(j for j in jobs if j.name == "kd_logits")
            cache_dir = out / f"kd_logits_{name}"
            keys = ("output_dir=", *(o.partition("=")[0] + "=" for o in own))
            jobs.append(Job(f"kd_logits_{name}", "train", [a for a in logits.argv if not a.startswith(keys)]
                            + [f"output_dir={cache_dir}", *own], logits.deps, "cache"))
            deps = [d for d in deps if d != "kd_logits"] + [f"kd_logits_{name}"]
            argv = [a for a in argv if not a.startswith("teacher.logits_dir=")] + [f"teacher.logits_dir={cache_dir}"]
        argv, deps, overrides = mixdata.with_mix(argv, deps, overrides, out)  # data=chat_mix: its own data
        argv += [o for o in overrides if o not in own]
        jobs.append(Job(name, "train", argv, deps, job.group, shlex.join(["recipe", *argv[3:]])))
    if mixdata.uses_mix(parse_variants(s)):
        jobs += mixdata.mix_jobs(s, out, t, _recipe, Job)
    jobs += onp.training_jobs(s, out, next(j for j in jobs if j.name == onp.REFERENCE))
    # the most expensive first, so the longest runs start at once and the cheap ones fill in around them
    order = ["kd_qat", "qat", "kd", "kd_r1", "kd_logits", "sft", "kd_cache"]
    return sorted(jobs, key=lambda j: order.index(j.name) if j.name in order else len(order))


def select(jobs: list[Job], s: Scale) -> list[Job]:
    """Only the jobs `Scale.rows` needs: each row's evaluation and, through deps, the trainings behind it."""
    rows = onp.with_reference(s, parse_variants(s))  # on-policy rows bring their off-policy reference
    if rows is None:
        return jobs
    by_name = {j.name: j for j in jobs}
    want: set[str] = set()
    todo = [f"{kind}:{r}" for r in rows for kind in ("eval", "onp_eval")]
    while todo:
        name = todo.pop()
        if name in by_name and name not in want:
            want.add(name)
            todo += by_name[name].deps
    return [j for j in jobs if j.name in want]


def eval_jobs(s: Scale, out: Path) -> list[Job]:
    t = _teacher(s)
    rows = [("teacher", t, [], []), ("teacher_ptq", t, ["--quant", "8da4w"], []),
            ("pruned", t, ["--pruned"], ["prune"]), ("sft", str(out / "train/sft/model"), [], ["sft"]),
            ("kd", str(out / "train/kd/model"), [], ["kd"]),
            ("kd_r1", str(out / "train/kd_r1/model"), [], ["kd_r1"]),
            ("kd_cache", str(out / "train/kd_cache/model"), [], ["kd_cache"]),
            ("kd_ptq", str(out / "train/kd/model"), ["--quant", "8da4w"], ["kd"]),
            ("qat", str(out / "train/qat/model"), ["--quant", "8da4w"], ["qat"]),
            ("kd_qat", str(out / "train/kd_qat/model"), ["--quant", "8da4w"], ["kd_qat"])]
    quant = {name: extra for name, _, extra, _ in rows}
    variants = parse_variants(s)
    rows += [(name, str(out / "train" / name / "model"), quant[base], [name]) for name, base, _ in variants]
    rows += [(n, str(out / "train" / n / "model"), [], [n]) for n in onp.selected(s, variants) if n in onp.ONP_ROWS]
    return onp.eval_jobs(s, out, t, variants) + [
        Job(f"eval:{name}", "eval", [sys.executable, str(ROOT / "bench" / "kd_study2.py"), "eval-one", "--name",
                                     name, "--model", model, "--out", str(out), *extra, *scale_flags(s)],
            deps, "eval") for name, model, extra, deps in rows]


def scale_flags(s: Scale) -> list[str]:
    return ["--scale", json.dumps(asdict(s))]


# ---------------------------------------------------------------------------------------------- prune / eval


def prune(s: Scale, out: Path) -> list[int]:
    """Score the teacher's layers on the transfer set (loss_drop and block influence) and keep the best `keep`."""
    import torch

    from llm_recipe.components.models.prune import importance_keep

    device = "cuda" if s.device == "auto" and torch.cuda.is_available() else ("cpu" if s.device == "auto"
                                                                               else s.device)
    dataset = {"source": str(out / "transfer" / "passages.jsonl"), "format": "text", "max_seq_len": s.seq_len,
               "packed": True}
    return importance_keep(_teacher(s), {"method": "loss_drop", "keep": s.keep,
                                         "calibration_tokens": s.calibration_tokens},
                           dataset, 8, device, torch.float32, out / "layers")


def eval_one(name: str, model_dir: str, out: Path, quant: str | None, pruned: bool, s: Scale) -> dict:
    """LAMBADA (acc, perplexity) and the multiple-choice tasks (acc_norm) with standard errors and per-item values
    (for paired comparisons) into out/evals/<name>/summary.json."""
    import torch

    from llm_recipe.components.eval.run import evaluate
    from llm_recipe.components.eval.stats import loglikelihood_task_stats, mean_se, per_item
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer

    device = "cuda" if s.device == "auto" and torch.cuda.is_available() else ("cpu" if s.device == "auto"
                                                                               else s.device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.time()
    model, _ = load_model(model_dir, dtype=dtype, device=device, keep_layers=_keep(out) if pruned else None)
    model.eval()
    method = str(dtype).removeprefix("torch.")
    if quant:  # CUDA: fake quantizers (bench/kd_study.py measured them equal to torchao's real tensors); CPU: real
        if device.startswith("cuda"):
            fake_quantize(model, quant)
            method = f"fake {quant}"
        else:
            method = quantize_for_eval(model, Path(model_dir), dtype, device, None, quant)
    tok = Tokenizer.from_dir(model_dir)
    res = evaluate((model, tok), [LAMBADA, *CHOICE_TASKS.values()], limit=s.eval_limit,
                   batch_size=s.eval_batch_size, log_samples=True, bootstrap_iters=0,
                   output_dir=out / "evals" / name / "lm_eval")
    lam = res["samples"][LAMBADA]
    summary = {"name": name, "model": model_dir, "quant": quant, "method": method,
               "lambada": loglikelihood_task_stats(lam),
               "per_item": {"lambada_acc": per_item(lam, "acc"),
                            "lambada_nll": {i: -v for i, v in per_item(lam, "perplexity").items()}}}
    for key, task in CHOICE_TASKS.items():
        acc = per_item(res["samples"][task], "acc_norm")
        mean, se = mean_se(list(acc.values()))
        summary[key] = {"items": len(acc), "acc_norm": mean, "acc_norm_se": se}
        summary["per_item"][f"{key}_acc_norm"] = acc
    summary.update(eval_s=round(time.time() - t0, 1),
                   device=torch.cuda.get_device_name() if device.startswith("cuda") else "cpu")
    dest = out / "evals" / name
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["plan", "run", "collect", "plot", "prune", "eval-one", "mix"])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "kd_study2")
    p.add_argument("--jobs", type=int, default=6, help="processes at once (they share one GPU)")
    p.add_argument("--tiny", action="store_true", help="CPU-sized settings: checks the pipeline end to end")
    p.add_argument("--teacher", default=None, help="teacher HF folder (default: the embedded model)")
    p.add_argument("--scale", default=None,
                   help="a preset: gpu (default; 20.5M tokens per run), lease (fits one 30-minute H200 lease: "
                        "6.6M tokens per run), lease20m (20.5M per run over 8 continuations per opening), "
                        "tiny (= --tiny); or a Scale as JSON (what `run` passes to its jobs)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's training steps (every row)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=BASE:k=v[,k=v]",
                   help="a sweep row: BASE's training (sft, kd, kd_r1, kd_cache, qat, kd_qat) with these overrides "
                        "(cache.top_k=K, cache.mode=sampled, cache.samples=N: its own cache; data=chat_mix: passages "
                        "+ the teacher's chat answers, bench/kd_study2_data.py); repeatable")
    p.add_argument("--pair", action="append", default=[], metavar="BASE:ROW",
                   help="also compare ROW with BASE on the same items (collect); repeatable")
    p.add_argument("--rows", default=None, help="comma-separated rows to run (and what they need); default: all")
    p.add_argument("--name")
    p.add_argument("--model")
    p.add_argument("--quant", default=None)
    p.add_argument("--pruned", action="store_true", help="eval-one: the importance-pruned student, untrained")
    args = p.parse_args(argv)
    if args.scale and args.scale.lstrip().startswith("{"):
        s = Scale(**json.loads(args.scale))
    else:
        preset = "tiny" if args.tiny else (args.scale or "gpu")
        if preset not in PRESETS:
            p.error(f"--scale {preset}: use one of {', '.join(PRESETS)} (or a JSON Scale)")
        s = Scale(**PRESETS[preset])
    if args.steps is not None:
        s.steps = args.steps
    if args.variant:
        s.variants = args.variant
    if args.rows:
        s.rows = args.rows.split(",")
    if args.pair:
        s.pairs = args.pair
    parse_variants(s)  # a malformed --variant fails here, before any job starts
    if args.teacher:
        s.teacher = str(Path(args.teacher).resolve())
    out = args.out.resolve()
    if args.phase == "collect" and not (args.scale or args.tiny or args.steps) and (out / "scale.json").is_file():
        s = Scale(**json.loads((out / "scale.json").read_text()))  # the scale the run used
        s.pairs = s.pairs + args.pair
    if args.phase == "prune":
        prune(s, out)
    elif args.phase == "plot":
        from bench.kd_study2_plot import plot

        print(plot(out))
    elif args.phase == "mix":  # the data=chat_mix rows' file (bench/kd_study2_data.py)
        mixdata.write_mix(out, _teacher(s))
    elif args.phase == "eval-one":
        eval_one(args.name, args.model, out, args.quant, args.pruned, s)
    elif args.phase == "plan":
        keep = _keep(out)
        train = training_jobs(s, out, keep) if keep else []
        ref = next((j for j in train if j.name == onp.REFERENCE), None)
        probes = onp.probe_jobs(s, out, ref, parse_variants(s)) if ref else []
        jobs = setup_jobs(s, out) + probes + select(train + eval_jobs(s, out), s)
        for j in jobs:
            print(f"# {j.name} (after: {', '.join(j.deps) or '-'})\n{j.recipe_cmd or j.command()}\n")
        if not keep:
            print("# sft, kd, kd_r1, kd_logits, kd_cache, kd_qat, qat: printed once `prune` has written the layer "
                  "list")
        if onp.selected(s, parse_variants(s)) and not (out / onp.STEPS_FILE).is_file():
            print(f"# {', '.join(r for r in onp.selected(s, parse_variants(s)) if r in onp.ONP_ROWS)}: printed once "
                  "the probes have run (their steps match kd_r1's GPU time)")
    elif args.phase == "run":
        out.mkdir(parents=True, exist_ok=True)
        (out / "scale.json").write_text(json.dumps(asdict(s), indent=2) + "\n")
        if run_jobs(setup_jobs(s, out), out, args.jobs):
            return 1
        ref = next(j for j in training_jobs(s, out, _keep(out)) if j.name == onp.REFERENCE)
        if run_jobs(onp.probe_jobs(s, out, ref, parse_variants(s)), out, 1):  # one at a time: alone on the GPU
            return 1
        onp.equal_time_steps(s, out)
        failed = run_jobs(select(training_jobs(s, out, _keep(out)) + eval_jobs(s, out), s), out, args.jobs)
        collect(s, out)
        return 1 if failed else 0
    else:
        collect(s, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
