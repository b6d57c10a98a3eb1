"""How far a quantized KD teacher moves from the bf16 one: mean per-token KL(bf16 teacher || quantized teacher).

    python bench/teacher_quant_kl.py [--model DIR] [--modes fp8,fp8@0.01,int8_weight_only] [--rows 64] [--seq-len 512]

The embedded SmolLM2-135M-Instruct by default (real weights), over the shipped transfer passages packed as
`recipe run kd` packs them (the data KD trains on), with `teacher.quantize`'s own code path
(llm_recipe.components.quantization.teacher). Prints one JSON line per mode: mean and 99th-percentile token KL in nats and
the top-1 agreement with the bf16 teacher. `fp8@BOUND` is `teacher.quantize=fp8` with `teacher.max_drift=BOUND` (the
shipped default 0.01): the projections the setup-time drift check keeps in bf16 stay there; plain `fp8` is
`teacher.max_drift=null` (every linear in fp8). `emulated@KEEP` is the setup's emulation of fp8 (KEEP: projection
prefixes kept in bf16, joined by +, e.g. `emulated@mlp.`) on the same tokens, to check it against the kernels.
"""

from __future__ import annotations

import argparse
import json

import torch

from llm_recipe.components.assets import embedded_model_dir
from llm_recipe.components.data.dataset import build_dataset, build_loader
from llm_recipe.components.models import load_model
from llm_recipe.components.models.tokenizer import Tokenizer
from llm_recipe.components.quantization.fp8_drift import emulated_fp8
from llm_recipe.components.quantization.teacher import quantize_teacher
from llm_recipe.components.training import hidden_states


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--modes", default="fp8,fp8@0.01,int8_weight_only")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    model_dir = a.model or str(embedded_model_dir())
    device = torch.device(a.device)
    dataset = build_dataset(Tokenizer.from_dir(model_dir), source="transfer:passages", format="text",
                            max_seq_len=a.seq_len, packed=True, use_chat_template=False, limit=None, shuffle=False)
    loader = build_loader(dataset, a.batch_size, seed=0)
    batches = []
    for batch in loader:
        batches.append({k: v.to(device) for k, v in batch.items()})
        if len(batches) * a.batch_size >= a.rows:
            break

    def logprobs(model) -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for b in batches:
                h = hidden_states(model, b)
                out.append(torch.log_softmax(model.output(h).float(), dim=-1)[b["labels"] != -100])
        return out

    ref_model, _ = load_model(model_dir, dtype=torch.bfloat16, device=device, max_seq_len=a.seq_len)
    ref = logprobs(ref_model.eval())
    for mode in a.modes.split(","):
        model, _ = load_model(model_dir, dtype=torch.bfloat16, device=device, max_seq_len=a.seq_len)
        name, _, bound = mode.partition("@")
        if name == "emulated":  # teacher.max_drift's emulation (fp8_drift.py) on these tokens; @KEEP: kept prefixes
            with emulated_fp8(model.eval(), tuple(k for k in bound.split("+") if k)):
                quantized = logprobs(model)
            fp8_linears = 0
        else:
            quantize_teacher(model.eval(), name, device, max_drift=float(bound) if bound else None,
                             model_dir=model_dir, max_seq_len=a.seq_len)
            fp8_linears = sum(type(m.weight).__name__ == "Float8Tensor" for m in model.modules()
                              if hasattr(m, "weight"))
            quantized = logprobs(model)
        kls, agree, n = [], 0, 0
        for lp_ref, lp_q in zip(ref, quantized):
            kls.append((lp_ref.exp() * (lp_ref - lp_q)).sum(-1))
            agree += int((lp_ref.argmax(-1) == lp_q.argmax(-1)).sum())
            n += lp_ref.shape[0]
        kl = torch.cat(kls)
        print(json.dumps({"model": model_dir, "mode": mode, "device": torch.cuda.get_device_name(device)
                          if device.type == "cuda" else "cpu", "tokens": n, "mean_kl_nats": float(kl.mean()),
                          "p99_kl_nats": float(kl.quantile(0.99)), "top1_agreement": agree / n,
                          "fp8_weights": fp8_linears}), flush=True)


if __name__ == "__main__":
    main()
