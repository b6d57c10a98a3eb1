"""The fp8 teacher's down-projection input: Inductor's fused SiLU x up + per-row fp8 quantization vs Triton kernels.

In the fp8 teacher (torchao Float8Tensor weights, per-row scales) the down projection's input `silu(gate) * up`
(4,096 tokens x 14,336 per micro-batch of the shipped 8B -> 1B row) is quantized per row before the fp8 matmul;
Inductor fuses both into one persistent kernel (session 37's profile: 133 us per call, about 2.2 TB/s on an H200,
where one read of gate and up and one fp8 write take ~70 us). This times that kernel (compiled as the recipe
compiles it, one-pass rows installed) against hand-written Triton variants, alone and with the fp8 matmul after
it, and checks each variant's fp8 values and scales against torchao's eager quantization. A diagnosis (session 38,
docs/benchmarks.md): the persistent variant ran 1.58x Inductor's alone, but the same kernel as a custom op inside
the compiled teacher layer made the shipped KD step 0.7% slower, so it was not kept. One JSON line per variant;
GPU time of calls issued back to back.

    python bench/swiglu_fp8_speed.py [--tokens 4096] [--width 14336] [--out-features 4096] [--iters 50]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from attention_speed import timed_back_to_back  # bench/ is on sys.path when a bench script runs

FP8_MAX = 448.0


def reference(g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's eager per-row quantization of the bf16 `silu(g) * u` (quant_primitives' choose_scale + quantize)."""
    h = F.silu(g) * u
    scale = (h.abs().amax(dim=-1, keepdim=True) / FP8_MAX).float()
    return (h.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@triton.jit
def _swiglu_row_persistent(g_ptr, u_ptr, q_ptr, s_ptr, n, BLOCK: tl.constexpr):
    # one row per program, held in registers: one read of gate and up, one fp8 write
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    g = tl.load(g_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
    h = (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32) * u  # F.silu rounds to bf16, then the product
    h = h.to(tl.bfloat16).to(tl.float32)
    scale = (tl.max(tl.abs(h), axis=0) / 448.0).to(tl.bfloat16).to(tl.float32)
    q = tl.clamp(h / scale, -448.0, 448.0)
    tl.store(q_ptr + row * n + cols, q.to(tl.float8e4nv), mask=inside)
    tl.store(s_ptr + row, scale)


@triton.jit
def _silu_times_up(g_ptr, u_ptr, offsets, inside, EVICT: tl.constexpr):
    # bf16 silu(g) * u as F.silu then the product round it, in fp32
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0, eviction_policy=EVICT).to(tl.float32)
    u = tl.load(u_ptr + offsets, mask=inside, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return ((g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32) * u).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _swiglu_row_two_pass(g_ptr, u_ptr, q_ptr, s_ptr, n, CHUNK: tl.constexpr):
    # pass 1: the row's amax, chunk by chunk; pass 2 reads the row again (from L2, just read) and writes fp8
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, n, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        amax = tl.maximum(amax, tl.abs(_silu_times_up(g_ptr, u_ptr, row * n + cols, cols < n, "evict_last")))
    scale = (tl.max(amax, axis=0) / 448.0).to(tl.bfloat16).to(tl.float32)
    for start in range(0, n, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        h = _silu_times_up(g_ptr, u_ptr, row * n + cols, cols < n, "evict_first")
        q = tl.clamp(h / scale, -448.0, 448.0)
        tl.store(q_ptr + row * n + cols, q.to(tl.float8e4nv), mask=cols < n)
    tl.store(s_ptr + row, scale)


def triton_variant(kind: str, size: int, warps: int, stages: int = 1):
    """A launch of one of the two kernels: `size` is the persistent row block or the two-pass chunk."""
    def run(g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, n = g.shape
        q = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=g.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=g.device)
        if kind == "persistent":
            _swiglu_row_persistent[(m,)](g, u, q, s, n, BLOCK=size, num_warps=warps, num_stages=stages)
        else:
            _swiglu_row_two_pass[(m,)](g, u, q, s, n, CHUNK=size, num_warps=warps, num_stages=stages)
        return q, s
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--width", type=int, default=14336)
    p.add_argument("--out-features", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    from torchao.quantization import quantize_

    from llm_recipe.components.inductor_choices import use_one_pass_row_reductions
    from llm_recipe.components.quantization.schemes import base_config

    use_one_pass_row_reductions()
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(a.tokens, a.width, device="cuda", generator=gen).bfloat16()
    u = torch.randn(a.tokens, a.width, device="cuda", generator=gen).bfloat16()
    down = torch.nn.Linear(a.width, a.out_features, bias=False, device="cuda", dtype=torch.bfloat16)
    quantize_(down, base_config("float8_dynamic"))
    w = down.weight  # torchao Float8Tensor: qdata (out, in) fp8, scale (out, 1) fp32
    q_ref, s_ref = reference(g, u)
    nbytes = 2 * g.numel() * 2 + g.numel() + a.tokens * 4

    inductor_quant = torch.compile(reference)
    inductor_linear = torch.compile(lambda g, u: down(F.silu(g) * u))
    rows = [("inductor", inductor_quant, inductor_linear)]
    for kind, size, warps in [("persistent", 16384, 8), ("persistent", 16384, 16), ("persistent", 16384, 32),
                              ("two_pass", 1024, 4), ("two_pass", 2048, 4), ("two_pass", 2048, 8),
                              ("two_pass", 4096, 8), ("two_pass", 4096, 16), ("two_pass", 8192, 16)]:
        fn = triton_variant(kind, size, warps)

        def linear(g, u, fn=fn):
            q, s = fn(g, u)
            return torch._scaled_mm(q, w.qdata.t(), scale_a=s, scale_b=w.scale.t(), out_dtype=torch.bfloat16,
                                    use_fast_accum=True)
        rows.append((f"{kind}_{size}_w{warps}", fn, linear))
    out_ref = inductor_linear(g, u)
    base = None
    for name, quant, linear in rows:
        try:
            q, s = quant(g, u)
            ms = timed_back_to_back(lambda: quant(g, u), a.iters)  # noqa: B023
            ms_linear = timed_back_to_back(lambda: linear(g, u), a.iters)  # noqa: B023
            out = linear(g, u)
        except Exception as e:  # a launch shape that does not compile is a result too
            print(json.dumps({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
            continue
        base = base or (ms, ms_linear)
        codes = (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item()
        print(json.dumps({
            "variant": name, "us": round(ms * 1e3, 1), "tb_per_s": round(nbytes / ms / 1e9, 2),
            "speedup": round(base[0] / ms, 3), "us_with_matmul": round(ms_linear * 1e3, 1),
            "speedup_with_matmul": round(base[1] / ms_linear, 3),
            "fp8_codes_differing_from_eager": codes, "scale_max_rel_diff": ((s - s_ref).abs() / s_ref).max().item(),
            "out_max_rel_diff_vs_inductor": ((out.float() - out_ref.float()).abs().max()
                                             / out_ref.float().abs().max()).item(),
            "device": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
