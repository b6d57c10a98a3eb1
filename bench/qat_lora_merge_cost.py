"""What QAT + LoRA's effective weight costs per micro-batch, two ways: `w + s * B @ A` computed in fp32 and
rounded once (how models/loader.py merges plain LoRA for `model/`) against `w + (s * B) @ A` in bf16 (what QAT
trains against and keeps, quantization/qat.py `_merged_weight`), forward + backward over the linears of a
Llama-3.2-1B-shaped model at LoRA rank 64, each compiled. Prints one JSON line.

    python bench/qat_lora_merge_cost.py [--rank 64] [--iters 50]
"""

from __future__ import annotations

import argparse
import json

import torch

# (out, in, count) of the 1B model's linears: q, o (32), k, v (32), gate, up (32), down (16) over 16 layers
SHAPES = [(2048, 2048, 32), (512, 2048, 32), (8192, 2048, 32), (2048, 8192, 16)]


def fp32_once(w, a, b, s):
    return (w.float() + (s * b.float()) @ a.float()).to(w.dtype)


def bf16(w, a, b, s):
    return w + (s * b) @ a


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = {"device": torch.cuda.get_device_name(), "rank": a.rank}
    for name, fn in (("fp32_once", fp32_once), ("bf16", bf16)):
        step = torch.compile(fn)
        total = 0.0
        for o, i, n in SHAPES:
            w = torch.randn(o, i, device=dev, dtype=dt)
            la = torch.randn(a.rank, i, device=dev, dtype=dt, requires_grad=True)
            lb = torch.randn(o, a.rank, device=dev, dtype=dt, requires_grad=True)
            g = torch.randn(o, i, device=dev, dtype=dt)
            for _ in range(3):
                step(w, la, lb, 2.0).backward(g)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(a.iters):
                step(w, la, lb, 2.0).backward(g)
            end.record()
            torch.cuda.synchronize()
            total += start.elapsed_time(end) / a.iters * n
        out[f"{name}_ms_per_forward_backward"] = round(total, 2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
