"""fp8 scale granularity for the KD teacher and the fp8 student base: per-row (what ships) vs one scale per tensor.

The fp8 row of issue 19 (fp8 teacher + `lora.quantize_base=fp8`) spends most of its step in the teacher's fp8
matmuls, which torchao runs with one scale per activation row and per weight row (torch's rowwise scaled matmul, a
CUTLASS kernel on sm90) after an Inductor kernel that quantizes each row. With one scale per tensor the matmul is
cuBLAS's fp8 kernel and the activation's scale is one amax over the whole tensor. This times, for every linear
shape of the shipped 8B -> 1B step (Llama-3.1-8B teacher: forward; Llama-3.2-1B student base: forward) at one
micro-batch's tokens: the bf16 matmul, torchao's rowwise fp8 linear and its tensorwise one, each compiled as the
recipes compile it (activation quantization + matmul in one graph), and the scaled matmul alone. It adds them up per
optimizer step (layers x micro-batches) so the saving can be held against the 905 ms step. A diagnosis; one JSON
line per shape, then a total line. GPU time of calls issued back to back; a stand-alone compiled fp8 linear is
host-bound below ~280 us (one call of a tensor-subclass graph), so compare the small shapes by `*_matmul_only_us`
(session 42, docs/benchmarks.md: rowwise and tensorwise matmuls equal to within 1% over a step).

    python bench/fp8_granularity_speed.py [--tokens 4096] [--micro-batches 8] [--iters 30]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from attention_speed import timed_back_to_back  # bench/ is on sys.path when a bench script runs

# (name, in_features, out_features, linears of this shape per forward): Llama-3.1-8B's 32 layers, then
# Llama-3.2-1B's 16 (the student base's forward; its input gradient runs in bf16 either way)
SHAPES = [
    ("teacher q,o", 4096, 4096, 64), ("teacher k,v", 4096, 1024, 64), ("teacher gate,up", 4096, 14336, 64),
    ("teacher down", 14336, 4096, 32),
    ("student q,o", 2048, 2048, 32), ("student k,v", 2048, 512, 32), ("student gate,up", 2048, 8192, 32),
    ("student down", 8192, 2048, 16),
]


def fp8_linear(weight: torch.Tensor, granularity) -> torch.nn.Module:
    """A bias-free linear holding `weight`, quantized by torchao's float8 dynamic config with `granularity`."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    lin.weight.data.copy_(weight)
    quantize_(lin, Float8DynamicActivationFloat8WeightConfig(granularity=granularity, set_inductor_config=False))
    return lin


def scaled_mm_ms(x: torch.Tensor, amax: torch.Tensor, weight, scale_shape: tuple, iters: int) -> float:
    """GPU ms of torch._scaled_mm alone: x quantized with `amax` (per row or one), torchao's fp8 weight."""
    scale = (amax.float() / 448.0).clamp_min(1e-12)
    xq = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq, ws = weight.qdata.t(), weight.scale.reshape(scale_shape).float()
    return timed_back_to_back(lambda: torch._scaled_mm(xq, wq, scale_a=scale, scale_b=ws, out_dtype=torch.bfloat16,
                                                       use_fast_accum=True), iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (shipped: 2 x 2048)")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step (shipped: 8)")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    from torchao.quantization import PerRow, PerTensor

    torch.manual_seed(0)
    totals = {"bf16": 0.0, "rowwise": 0.0, "tensorwise": 0.0}
    for name, k, n, count in SHAPES:
        torch._dynamo.reset()  # each shape compiled from scratch, static: no recompile limit, no dynamic shapes
        x = torch.randn(a.tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        row, tensor = fp8_linear(w, PerRow()), fp8_linear(w, PerTensor())
        runs = {"bf16": torch.compile(lambda x, w=w: F.linear(x, w), dynamic=False),
                "rowwise": torch.compile(row, dynamic=False), "tensorwise": torch.compile(tensor, dynamic=False)}
        ref = F.linear(x.float(), w.float())
        line = {"shape": name, "tokens": a.tokens, "in": k, "out": n}
        for kind, fn in runs.items():
            ms = timed_back_to_back(lambda fn=fn, x=x: fn(x), a.iters)
            err = ((fn(x).float() - ref).norm() / ref.norm()).item()
            line[f"{kind}_us"] = round(ms * 1e3, 1)
            line[f"{kind}_tflops"] = round(2 * a.tokens * k * n / ms / 1e9, 1)
            line[f"{kind}_rel_err"] = round(err, 5)
            totals[kind] += ms * count * a.micro_batches
        # the scaled matmuls alone (operands quantized once, outside the timing)
        mm_row = scaled_mm_ms(x, x.abs().amax(dim=-1, keepdim=True), row.weight, (1, -1), a.iters)
        mm_tensor = scaled_mm_ms(x, x.abs().amax().reshape(1, 1), tensor.weight, (1, 1), a.iters)
        line["rowwise_matmul_only_us"] = round(mm_row * 1e3, 1)
        line["tensorwise_matmul_only_us"] = round(mm_tensor * 1e3, 1)
        line["device"] = torch.cuda.get_device_name()
        print(json.dumps(line), flush=True)
    print(json.dumps({"total_ms_per_step": {k: round(v, 1) for k, v in totals.items()},
                      "tensorwise_saves_ms_per_step": round(totals["rowwise"] - totals["tensorwise"], 1),
                      "micro_batches": a.micro_batches, "tokens": a.tokens}), flush=True)


if __name__ == "__main__":
    main()
