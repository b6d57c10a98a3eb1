"""The KD study's `eval-one`: lm-eval of one model, bf16 or quantized, kept apart from its job planner."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.kd_study import Scale

TASKS_MAIN = ["recipe_lambada_openai", "recipe_arc_easy", "recipe_piqa"]
TASK_HELLASWAG = "recipe_hellaswag"


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
