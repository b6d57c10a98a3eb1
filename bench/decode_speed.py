"""Sampling speed: our batched KV-cache `generate_batch` (eager and with the decode step compiled), on-policy KD's
sampler, and transformers' `generate` with a static cache, same shapes, same GPU (issue 22).

    python bench/decode_speed.py --shape llama1b --batch 32 --new 256 --out results.jsonl
    python bench/decode_speed.py --shape smollm2 --batch 1024 --new 128      # the transfer set's decode

Rows: `ours_eager`, `ours_default`, `ours_reduce-overhead` (generate_batch's `compile_mode`, the transfer recipe's);
`onpolicy_compiled`: what `recipe run kd` with `kd.on_policy` samples with on one GPU with `compile: true`
(`sample_completions` with a `StaticDecode`: the layers compiled for training as rt.prepare_model does, the model
in train mode, its decode step compiled over the whole model as a CUDA graph, inverse-CDF sampling from seeded
uniforms); `onpolicy_compiled_lora`: the same with the shipped 8B -> 1B KD config's LoRA section (rank 64, alpha
128, q, v, o, gate, up, down; B made nonzero as after training); `onpolicy_compiled_expanded` / `_fullcdf`: the same as before session 57, with torchtune's attention
(the KV cache copied out to every query head each step) / one fp64 cumsum over the vocabulary per token; `hf_static`: transformers' `generate(cache_implementation="static")`, which on CUDA compiles its own
forward (mode "reduce-overhead", fullgraph) in recent transformers: "a static cache + torch.compile" as
transformers ships it; `hf_static_compiled`: `model.forward` wrapped in torch.compile on top of that (the old
recipe; it failed on the H200 with "accessing tensor output of CUDAGraphs that has been overwritten");
`hf_static_nocompile`: the static cache with `disable_compile=True`. `dynamo_graphs` counts the graphs Dynamo compiled for a row (0: it ran eagerly).
`--profile` (on-policy rows): a third run under torch.profiler, then the row's CUDA kernels by total time, per
decode step (which kernels a decode step of this shape is made of, and what each costs).

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


def onpolicy(shape: str, batch: int, prompt: int, new: int, row: str = "onpolicy_compiled",
             profile: bool = False) -> dict:
    """The on-policy sampler's row; `_expanded` / `_fullcdf` put back what session 57 replaced, for this row only."""
    from llm_recipe.components import on_policy_sampling
    from llm_recipe.components.models.builder import tune_layers

    attention, sampler = tune_layers().Attention._cached_attention, on_policy_sampling.sample_with_uniforms
    if "_expanded" in row:  # torchtune's forward with the KV cache: k and v copied out to every query head
        from torchtune.modules import MultiHeadAttention

        tune_layers().Attention._cached_attention = lambda self, x, y, mask, pos: MultiHeadAttention.forward(
            self, x, y, mask=mask, input_pos=pos)
    if "_fullcdf" in row:  # one fp64 cumsum over the whole vocabulary per token
        def full_cdf(logits, temperature, uniforms):
            cdf = torch.softmax(logits.float() / temperature, dim=-1).double().cumsum(-1)
            u = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
            return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)

        on_policy_sampling.sample_with_uniforms = full_cdf
    try:
        return {**_onpolicy(shape, batch, prompt, new, "_lora" in row, profile), "row": row}
    finally:
        tune_layers().Attention._cached_attention, on_policy_sampling.sample_with_uniforms = attention, sampler


def _onpolicy(shape: str, batch: int, prompt: int, new: int, lora: bool = False, profile: bool = False) -> dict:
    from llm_recipe.components.models import ModelArgs, build_model
    from llm_recipe.components.models.builder import LoRASettings
    from llm_recipe.components.models.generation import StaticDecode
    from llm_recipe.components.on_policy_sampling import sample_completions

    torch.manual_seed(0)
    with torch.device("cuda"):
        settings = LoRASettings(rank=64, alpha=128.0, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                                "down_proj")) if lora else None
        model = build_model(ModelArgs.from_hf_config(hf_config(shape)), settings).to(torch.bfloat16).train()
    with torch.no_grad():  # a trained adapter: B nonzero (it starts at zero)
        for name, param in model.named_parameters():
            if name.endswith("lora_b.weight"):
                param.normal_(0, 1e-3)
    for layer in model.layers:  # as rt.prepare_model compiles a training model's layers
        layer.compile()
    prompts = torch.randint(3, 1000, (batch, prompt)).tolist()
    static = StaticDecode(batch, "reduce-overhead")

    def run():
        sample_completions(model, prompts, new, 1.0, pad_id=0, stop_ids=[], seed=0, rows=range(batch), width=batch,
                           static=static)

    first = timed(run)
    second = timed(run)
    if profile:
        kernel_table(run, new)
    return {"first_s": round(first, 2), "s": round(second, 3), "tokens_per_s": round(batch * new / second)}


def kernel_table(run, steps: int, top: int = 30) -> None:
    """One more `run` under torch.profiler: its CUDA kernels by total time, with calls and microseconds per decode
    step (`steps` tokens), and the kernels' total per step against the run's wall time per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = timed(run)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in kernels)
    calls = sum(e.count for e in kernels)
    print(f"kernels {total / steps:.0f} us per decode step ({calls / steps:.0f} of them); wall {wall * 1e6 / steps:.0f} "
          f"us per decode step")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        print(f"{e.device_time_total / steps:8.1f} us {e.count / steps:6.1f} calls  {e.key[:110]}")


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


def hf(shape: str, batch: int, prompt: int, new: int, row: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(shape)
    cfg.pop("architectures")
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    if row == "hf_static_compiled":  # the old recipe: forward compiled by hand on top of transformers' own
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(3, 1000, (batch, prompt), device="cuda")
    off = {"disable_compile": True} if row == "hf_static_nocompile" else {}  # else transformers compiles itself

    def run():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=True, temperature=1.0, top_k=0, top_p=1.0, cache_implementation="static",
                       pad_token_id=0, **off)

    first = timed(run)
    second = timed(run)
    return {"row": row, "first_s": round(first, 2),
            "s": round(second, 3), "tokens_per_s": round(batch * new / second)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="llama1b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--rows", default="ours_eager,ours_reduce-overhead,onpolicy_compiled,hf_static,hf_static_nocompile")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="on-policy rows: their kernels per decode step")
    a = p.parse_args()
    from torch._dynamo.utils import counters

    for row in a.rows.split(","):
        counters.clear()
        try:
            if row.startswith("ours_"):
                mode = row.removeprefix("ours_")
                r = ours(a.shape, a.batch, a.prompt, a.new, None if mode == "eager" else mode)
            elif row.startswith("onpolicy_compiled"):
                r = onpolicy(a.shape, a.batch, a.prompt, a.new, row, a.profile)
            elif row in ("hf_static", "hf_static_nocompile", "hf_static_compiled"):
                r = hf(a.shape, a.batch, a.prompt, a.new, row)
            else:
                raise ValueError(f"unknown row {row}")
            r["dynamo_graphs"] = counters["stats"]["unique_graphs"]
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
