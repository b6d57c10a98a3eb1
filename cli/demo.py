"""`recipe demo`: the main job on the embedded default, end to end, offline, on CPU.

teacher (SmolLM2-135M-Instruct) -> layer-pruned student -> evaluate both -> `recipe run kd --config
kd/smollm2_demo` -> evaluate the distilled student -> 8da4w PTQ + GGUF export -> evaluate -> one summary table.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from components.errors import RecipeError

TASKS = ("recipe_lambada_openai", "recipe_hellaswag", "recipe_arc_easy")
STUDENT_EVERY = 3  # keep layers 0, 3, ..., 27 and 29 of 30, as kd/smollm2_demo does


@dataclass
class Row:
    """One line of the summary table."""

    name: str
    metrics: dict
    params: int
    size_bytes: int
    tokens_per_s: float


def _metric(results: dict, task: str, name: str) -> float:
    return float(results["results"][task][f"{name},none"])


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
    from components.eval.run import evaluate

    print(f"\n== evaluating {name} (first {limit} items of {', '.join(TASKS)})", flush=True)
    results = evaluate((model, tokenizer), list(TASKS), limit=limit, batch_size=16,
                       output_dir=out / "eval" / name.replace(" ", "_").replace("+", ""))
    metrics = {
        "lambada_acc": _metric(results, "recipe_lambada_openai", "acc"),
        "lambada_ppl": _metric(results, "recipe_lambada_openai", "perplexity"),
        "hellaswag_acc_norm": _metric(results, "recipe_hellaswag", "acc_norm"),
        "arc_easy_acc": _metric(results, "recipe_arc_easy", "acc"),
    }
    params = sum(p.numel() for p in model.parameters())
    return Row(name, metrics, params, size_bytes, _forward_tokens_per_s(model, tokenizer.vocab_size))


def _fmt_ppl(x: float) -> str:
    return f"{x:.3g}" if x < 1e4 else f"{x:.2e}" if math.isfinite(x) else "inf"


def summary_table(rows: list[Row]) -> str:
    head = ("model", "LAMBADA acc", "LAMBADA ppl", "HellaSwag acc_norm", "ARC-Easy acc", "params",
            "size on disk", "tokens/s")
    lines = [head]
    for r in rows:
        m = r.metrics
        lines.append((r.name, f"{m['lambada_acc']:.3f}", _fmt_ppl(m["lambada_ppl"]), f"{m['hellaswag_acc_norm']:.3f}",
                      f"{m['arc_easy_acc']:.3f}", f"{r.params / 1e6:.1f}M", f"{r.size_bytes / 1024**2:.0f} MiB",
                      f"{r.tokens_per_s:.0f}"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    fmt = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    fmt.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(fmt)


def run_demo(output_dir: str = "outputs/demo", limit: int = 40, steps: int | None = None,
             kd_overrides: tuple[str, ...] = ()) -> list[Row]:
    """Run the whole demo; returns the table rows (also written to output_dir/summary.json).

    `kd_overrides` are extra `key=value` overrides for kd/smollm2_demo (tests use them to shrink the run).
    """
    from cli.recipes import load_recipe
    from components.assets import ensure_assets
    from components.config import load_config, validate_config
    from components.folders import prepared_run
    from components.models import keep_every, load_model, save_model
    from components.models.tokenizer import Tokenizer
    from components.quantization import quantize_model, size_on_disk
    from components.quantization.export_gguf import export_gguf
    from components.quantization.export_hf import export_hf_torchao

    start = time.perf_counter()
    out = Path(output_dir).resolve()
    teacher_dir = ensure_assets()
    tokenizer = Tokenizer.from_dir(teacher_dir)
    rows = []

    print(f"== 1/5 teacher: {teacher_dir}", flush=True)
    teacher, targs = load_model(teacher_dir)
    rows.append(_measure("teacher", teacher, tokenizer, size_on_disk(teacher_dir), limit, out))
    keep = keep_every(targs.num_layers, STUDENT_EVERY)
    del teacher

    print(f"\n== 2/5 pruned student: teacher layers {keep}", flush=True)
    student, sargs = load_model(teacher_dir, keep_layers=keep)
    student_init = save_model(student, sargs, out / "student_init", teacher_dir)
    rows.append(_measure("pruned student", student, tokenizer, size_on_disk(student_init), limit, out))
    del student

    print("\n== 3/5 recipe run kd --config kd/smollm2_demo", flush=True)
    overrides = [f"output_dir={out / 'kd'}", f"student.keep_layers={keep}", "student.every=null"]
    if steps is not None:
        overrides.append(f"max_steps={steps}")
    overrides += list(kd_overrides)
    name, recipe = load_recipe("kd")
    cfg = load_config("kd/smollm2_demo", overrides)
    validate_config(cfg, recipe.SCHEMA, recipe=name)
    with prepared_run(cfg, recipe.SCHEMA):  # folder checks and the output_dir lock, as `recipe run` does
        recipe.main(cfg)
    distilled_dir = out / "kd" / "model"
    distilled, dargs = load_model(distilled_dir)
    rows.append(_measure("student after KD", distilled, tokenizer, size_on_disk(distilled_dir), limit, out))

    print("\n== 4/5 quantize the distilled student: 8da4w (torchao) + GGUF Q4_0", flush=True)
    quantize_model(distilled, "8da4w", 32)
    hf_dir = export_hf_torchao(distilled, dargs, distilled_dir, out / "quantized" / "hf", "8da4w", 32)
    gguf = export_gguf(distilled, dargs, distilled_dir, out / "quantized" / "student-Q4_0.gguf", qtype="Q4_0")
    rows.append(_measure("after KD + 8da4w", distilled, tokenizer, size_on_disk(hf_dir), limit, out))

    print("\n== 5/5 summary", flush=True)
    table = summary_table(rows)
    print(table)
    stderr = 0.5 / math.sqrt(max(limit, 1))
    print(f"\n(first {limit} items per task, so accuracies carry a standard error up to ~{stderr:.2f}; LAMBADA "
          f"perplexity is the clearest signal. Size on disk: HF folder, 8da4w as a torchao checkpoint; GGUF Q4_0 is "
          f"{size_on_disk(gguf) / 1024**2:.0f} MiB. tokens/s: forward pass on 4x128 tokens on this machine)")
    print(f"distilled student:   {distilled_dir}")
    print(f"8da4w checkpoint:    {hf_dir}  (transformers loads it)")
    print(f"GGUF export:         {gguf}  (llama.cpp loads it)")
    print(f"metrics:             {out / 'kd' / 'metrics.jsonl'}")
    print(f"loss curves:         {out / 'kd' / 'loss.png'}")
    print(f"done in {time.perf_counter() - start:.0f}s")
    (out / "summary.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
    (out / "summary.txt").write_text(table + "\n")
    if not rows[2].metrics["lambada_ppl"] < rows[1].metrics["lambada_ppl"]:
        raise RecipeError("demo: the distilled student did not improve on the pruned student; see "
                          f"{out / 'kd' / 'metrics.jsonl'}")
    return rows
