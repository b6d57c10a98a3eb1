"""Would one matmul for q, k, v (and one for gate, up) be faster than three (two)? A diagnosis for issue 19.

torchtune's layers (and so ours and torchtune's recipes) run q_proj, k_proj, v_proj as three matmuls over the same
input, and gate_proj, up_proj as two. Concatenating the frozen weights along the output dim gives one larger matmul
per group (and, in fp8, one activation quantization instead of several, unless Inductor already shares them).
This times both ways on one micro-batch of the shipped KD row (4,096 tokens), each compiled as the recipes compile:
- `teacher_bf16` / `teacher_fp8`: Llama-3.1-8B shapes, forward only (no grad); fp8 is torchao's per-row
  Float8DynamicActivationFloat8WeightConfig, the fp8 teacher's;
- `student_bf16`: Llama-3.2-1B shapes, forward + the input's gradient (a LoRA student's frozen base).
Prints one JSON line per case: milliseconds per call (median of CUDA-event timings) for `separate` and `fused`.

    python bench/projection_fusion_speed.py [--tokens 4096] [--iters 50]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn as nn
from attention_speed import timed  # bench/ is on sys.path when a bench script runs

SHAPES = {  # hidden, q width, k/v width, MLP width
    "teacher": (4096, 4096, 1024, 14336),
    "student": (2048, 2048, 512, 8192),
}


class Separate(nn.Module):
    """Several linears over the same input, as torchtune's layers run them."""

    def __init__(self, d: int, widths: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(nn.Linear(d, w, bias=False) for w in widths)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [p(x) for p in self.parts]


class Fused(nn.Module):
    """One linear over the concatenated weights, split after."""

    def __init__(self, d: int, widths: list[int]) -> None:
        super().__init__()
        self.widths = widths
        self.proj = nn.Linear(d, sum(widths), bias=False)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.proj(x).split(self.widths, dim=-1))


def case(kind: str, group: str, tokens: int, iters: int) -> dict:
    """Time Separate against Fused for one (model kind, projection group)."""
    model, mode = kind.split("_")
    d, q, kv, ff = SHAPES[model]
    widths = [q, kv, kv] if group == "qkv" else [ff, ff]
    out = {"case": kind, "group": group, "tokens": tokens, "widths": widths}
    for name, cls in (("separate", Separate), ("fused", Fused)):
        torch.manual_seed(0)
        m = cls(d, widths).to("cuda", torch.bfloat16).requires_grad_(False)
        if mode == "fp8":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

            quantize_(m, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
        f = torch.compile(m)
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        if model == "teacher":
            def run(f=f, x=x):
                with torch.inference_mode():
                    f(x)
        else:
            x.requires_grad_(True)
            grads = [torch.randn(tokens, w, device="cuda", dtype=torch.bfloat16) for w in widths]

            def run(f=f, x=x, grads=grads):
                torch.autograd.backward(f(x), grads)
                x.grad = None
        out[f"{name}_ms"] = round(timed(run, iters), 4)
    out["fused_vs_separate"] = round(out["separate_ms"] / out["fused_ms"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    for kind in ("teacher_bf16", "teacher_fp8", "student_bf16"):
        for group in ("qkv", "gate_up"):
            print(json.dumps(case(kind, group, a.tokens, a.iters)), flush=True)


if __name__ == "__main__":
    main()
