"""Does PEFT load the adapter a run wrote, and give our merged model? (issue 23; transformers + peft only).

    python bench/peft_check.py BASE_DIR RUN_DIR [--device cuda] [--tokens 256]

BASE_DIR is the HF folder the run trained on, RUN_DIR its output_dir (adapter/ and model/). Prints one JSON line:
- `merge_max_ulp`: PEFT's `merge_and_unload()` of BASE + adapter against our `model/`, weight by weight, in units
  of the bf16 rounding step of each weight (<= 1: ours is PEFT's merge rounded to the stored dtype);
- `logits_rel`: |logits(PEFT, unmerged) - logits(our model/)| / |logits(PEFT) - logits(BASE)| over random tokens:
  the disagreement as a share of what the adapter changes (0 would be exact; the rounding of the stored weights
  is all that should remain);
- `adapter_changes_logits`: the adapter's own effect, |logits(PEFT) - logits(BASE)| / |logits(BASE)|.
Runs with the machine's own transformers (not our pins): it imports nothing from llm_recipe.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _ulp(w: torch.Tensor) -> torch.Tensor:
    """The bf16 rounding step at each weight's magnitude (its spacing to the next bf16 value)."""
    b = w.abs().to(torch.bfloat16)
    return (torch.nextafter(b.float(), torch.full_like(b.float(), float("inf"))).to(torch.bfloat16).float()
            - b.float()).clamp_min(2.0 ** -133)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", type=Path)
    p.add_argument("run", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=256)
    a = p.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def load(folder: Path):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(a.device).eval()

    g = torch.Generator().manual_seed(0)
    base = load(a.base)
    tokens = torch.randint(0, base.config.vocab_size, (1, a.tokens), generator=g).to(a.device)
    with torch.no_grad():
        base_logits = base(tokens).logits.double()
        peft = PeftModel.from_pretrained(base, a.run / "adapter").eval()
        peft_logits = peft(tokens).logits.double()
        merged = peft.merge_and_unload().state_dict()
        ours_model = load(a.run / "model")
        ours_logits = ours_model(tokens).logits.double()
        ours = ours_model.state_dict()
        worst, worst_key = 0.0, None
        for k, w in merged.items():
            if k not in ours:
                continue
            ulps = float(((ours[k] - w).abs() / _ulp(w)).max())
            if ulps > worst:
                worst, worst_key = ulps, k
    effect = (peft_logits - base_logits).norm()
    print(json.dumps({
        "run": str(a.run), "merge_max_ulp": worst, "merge_worst_weight": worst_key,
        "missing_in_ours": sorted(set(merged) - set(ours))[:5],
        "logits_rel": float((peft_logits - ours_logits).norm() / effect) if effect > 0 else None,
        "adapter_changes_logits": float(effect / base_logits.norm()),
    }), flush=True)


if __name__ == "__main__":
    main()
