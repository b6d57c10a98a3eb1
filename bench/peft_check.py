"""Does PEFT load the adapter a run wrote, and give our merged model? (issue 23; transformers + peft only).

    python bench/peft_check.py BASE_DIR RUN_DIR [--device cuda] [--tokens 256]

BASE_DIR is the HF folder the run trained on, RUN_DIR its output_dir (adapter/ and model/). Prints one JSON line:
- `merge_mismatch`: the share of weights of our `model/` that differ from PEFT's `merge_and_unload()` of BASE +
  adapter rounded to our stored dtype, and `merge_max_ulp` the largest such difference in steps of that dtype at
  the rounded value (0 / <= 1: ours is PEFT's merge, rounded);
- `logits_rel_rounded`: |logits(our model/) - logits(PEFT's merge rounded to our dtype)| / |logits(PEFT) -
  logits(BASE)|: what is left once both sides store the same dtype, as a share of what the adapter changes;
- `logits_rel`: the same against PEFT's unrounded model. A short run on a bf16 model moves each weight by less
  than bf16's step (measured on two H200s: an adapter delta of rms 2.4e-5 on weights of step ~1e-4), so storing
  the merge in bf16 changes about as much as the adapter did: this number is large whenever the adapter is small
  and says nothing about the adapter file;
- `adapter_changes_logits`: the adapter's own effect, |logits(PEFT) - logits(BASE)| / |logits(BASE)|.
Runs with the machine's own transformers (not our pins): it imports nothing from llm_recipe.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _step(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each value of `w` (already in `dtype`); at 0, the smallest normal number's."""
    a = w.abs().float().clamp_min(torch.finfo(dtype).tiny).to(dtype)
    return (torch.nextafter(a, torch.full_like(a, float("inf"))).float() - a.float())


def _stored_dtypes(folder: Path) -> dict[str, torch.dtype]:
    """Each tensor's dtype in the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_slice(k).get_dtype()
    return {k: getattr(torch, {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(v, "float32"))
            for k, v in out.items()}


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
        merged = peft.merge_and_unload()
        ours_model = load(a.run / "model")
        ours_logits = ours_model(tokens).logits.double()
        stored = _stored_dtypes(a.run / "model")
        ours = ours_model.state_dict()
        worst, worst_key, differ, total = 0.0, None, 0, 0
        rounded = {}
        for k, w in merged.state_dict().items():
            if k not in ours:
                continue
            dt = stored.get(k, stored.get("model.embed_tokens.weight", torch.float32))  # a tied head: the embedding's
            r = w.to(dt)
            rounded[k] = r.float()
            diff = ours[k].to(dt).float() - r.float()
            differ, total = differ + int((diff != 0).sum()), total + diff.numel()
            ulps = float((diff.abs() / _step(r, dt)).max())
            if ulps > worst:
                worst, worst_key = ulps, k
        merged.load_state_dict(rounded, strict=False)
        rounded_logits = merged(tokens).logits.double()
    effect = (peft_logits - base_logits).norm()
    print(json.dumps({
        "run": str(a.run), "merge_mismatch": differ / max(total, 1), "merge_max_ulp": worst,
        "merge_worst_weight": worst_key, "missing_in_ours": sorted(set(rounded) ^ set(ours))[:5],
        "logits_rel_rounded": float((rounded_logits - ours_logits).norm() / effect) if effect > 0 else None,
        "logits_rel": float((peft_logits - ours_logits).norm() / effect) if effect > 0 else None,
        "adapter_changes_logits": float(effect / base_logits.norm()),
    }), flush=True)


if __name__ == "__main__":
    main()
