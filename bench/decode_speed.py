"""Sampling speed: our batched KV-cache `generate_batch` (eager and with the decode step compiled) against
transformers' `generate` with a static cache and a compiled forward, same shapes, same GPU (issue 22).

    python bench/decode_speed.py --shape llama1b --batch 32 --new 256 --out results.jsonl
    python bench/decode_speed.py --shape smollm2 --batch 1024 --new 128      # the transfer set's decode

Random weights (speed does not depend on them); every row samples exactly `--new` tokens (no stop ids, HF with
min_new_tokens), prompts of `--prompt` tokens. Each row is timed on its second run, so compile time is reported
separately (`first_s`). One JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # HF config.json fields of the two students the issues name
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
}


def hf_config(shape: str) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def ours(shape: str, batch: int, prompt: int, new: int, mode: str | None) -> dict:
    from llm_recipe.components.models import ModelArgs, build_model
    from llm_recipe.components.models.generation import generate_batch

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(ModelArgs.from_hf_config(hf_config(shape))).to(torch.bfloat16).eval()
    prompts = torch.randint(3, 1000, (batch, prompt)).tolist()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def run():
        with torch.inference_mode():
            generate_batch(model, prompts, new, pad_id=0, temperature=1.0, generator=gen, compile_mode=mode)

    first = timed(run)
    second = timed(run)
    return {"row": f"ours_{mode or 'eager'}", "first_s": round(first, 2), "s": round(second, 3),
            "tokens_per_s": round(batch * new / second)}


def hf(shape: str, batch: int, prompt: int, new: int, compiled: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(shape)
    cfg.pop("architectures")
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    if compiled:  # transformers' documented recipe: static cache + compiled forward
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda")

    def run():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=True, temperature=1.0, top_k=0, top_p=1.0, cache_implementation="static",
                       pad_token_id=0)

    first = timed(run)
    second = timed(run)
    return {"row": f"hf_static{'_compiled' if compiled else ''}", "first_s": round(first, 2),
            "s": round(second, 3), "tokens_per_s": round(batch * new / second)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="llama1b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--rows", default="ours_eager,ours_default,ours_reduce-overhead,hf_static,hf_static_compiled")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    for row in a.rows.split(","):
        try:
            if row.startswith("ours_"):
                mode = row.removeprefix("ours_")
                r = ours(a.shape, a.batch, a.prompt, a.new, None if mode == "eager" else mode)
            else:
                r = hf(a.shape, a.batch, a.prompt, a.new, row.endswith("_compiled"))
        except Exception as e:  # one failing row must not cost the others (a GPU lease is short)
            r = {"row": row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        r.update(shape=a.shape, batch=a.batch, prompt=a.prompt, new=a.new, device=torch.cuda.get_device_name(),
                 torch=torch.__version__)
        print(json.dumps(r), flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
