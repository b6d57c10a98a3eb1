"""The fused loss's kernel over the logits: Inductor's compile of the closed form vs our two Triton passes (issue 19).

Per chunk of `rows` x 128,256 bf16 logits (the shipped KD row's chunk is 256 rows): forward KL + CE against live
teacher logits (temperature 1 and 2) and CE alone, each way, and the largest difference of their gradients. Then
the whole fused loss of one micro-batch of the shipped KD row (2 x 2048 tokens, Llama-3.2-1B student head, Llama-3.1-8B
teacher head, 16 chunks, forward and backward) with each kernel. Medians of CUDA-event timings, one JSON line each.

    python bench/logits_kernel_speed.py [--rows 256 512] [--iters 50] [--sweep]
"""

from __future__ import annotations

import argparse
import json

import torch
from attention_speed import timed  # bench/ is on sys.path when a bench script runs

from llm_recipe.components.losses import LiveTeacher, build_kd_loss, kd_and_ce, logits_kernel
from llm_recipe.components.losses import fused as fused_module
from llm_recipe.components.losses.divergences import IGNORE_INDEX
from llm_recipe.components.losses.logits_kernel import forward_kl_ce_logits

VOCAB = 128_256


def chunk_rows(rows: int, iters: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    s = (3 * torch.randn(rows, VOCAB, device="cuda", generator=g)).bfloat16()
    t = (3 * torch.randn(rows, VOCAB, device="cuda", generator=g)).bfloat16()
    y = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    y[: rows // 4] = IGNORE_INDEX
    compiled = fused_module._compiled(fused_module.forward_kl_ce_chunk)
    for name, teacher, temperature in [("forward_kl_ce", t, 1.0), ("forward_kl_ce_T2", t, 2.0), ("ce", None, 1.0)]:
        args = (s, teacher, y)
        kw = dict(ce_w=0.5, kd_w=0.5, temperature=temperature, ignore_index=IGNORE_INDEX)
        ce_a, kd_a, g_a = compiled(*args, **kw)
        ce_b, kd_b, g_b = forward_kl_ce_logits(*args, **kw)
        row = {"case": name, "rows": rows, "vocab": VOCAB,
               "inductor_ms": timed(lambda: compiled(*args, **kw), iters),  # noqa: B023
               "triton_ms": timed(lambda: forward_kl_ce_logits(*args, **kw), iters),  # noqa: B023
               "max_grad_diff": (g_a.float() - g_b.float()).abs().max().item(),
               "ce_rel_diff": abs(ce_a.item() - ce_b.item()) / abs(ce_a.item()),
               "kd_rel_diff": abs(kd_a.item() - kd_b.item()) / max(abs(kd_a.item()), 1e-30)}
        row["speedup"] = row["inductor_ms"] / row["triton_ms"]
        print(json.dumps(row), flush=True)


def sweep(rows: int, iters: int) -> None:
    """The kernel's launch shape: vocabulary columns per program, per loop iteration, warps per program."""
    g = torch.Generator(device="cuda").manual_seed(0)
    s = (3 * torch.randn(rows, VOCAB, device="cuda", generator=g)).bfloat16()
    t = (3 * torch.randn(rows, VOCAB, device="cuda", generator=g)).bfloat16()
    y = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    kw = dict(ce_w=0.5, kd_w=0.5, temperature=1.0, ignore_index=IGNORE_INDEX)
    shipped = (logits_kernel.SLICE, logits_kernel.BLOCK, logits_kernel.WARPS)
    for slice_, block, warps in [(sl, b, w) for sl in (2048, 4096, 8192, 16384) for b in (512, 1024, 2048, 4096)
                                 for w in (4, 8) if b <= sl]:
        logits_kernel.SLICE, logits_kernel.BLOCK, logits_kernel.WARPS = slice_, block, warps
        ms = timed(lambda: forward_kl_ce_logits(s, t, y, **kw), iters)
        print(json.dumps({"case": "sweep", "rows": rows, "slice": slice_, "block": block, "warps": warps,
                          "triton_ms": ms, "shipped": (slice_, block, warps) == shipped}), flush=True)
    logits_kernel.SLICE, logits_kernel.BLOCK, logits_kernel.WARPS = shipped


def whole_loss(iters: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(2, 2048, 2048, device="cuda", generator=g).bfloat16().requires_grad_(True)
    head = torch.nn.Linear(2048, VOCAB, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    th = torch.randn(2, 2048, 4096, device="cuda", generator=g).bfloat16()
    tw = (torch.randn(VOCAB, 4096, device="cuda", generator=g) / 64).bfloat16()
    y = torch.randint(0, VOCAB, (2, 2048), device="cuda", generator=g)
    kd = build_kd_loss("forward_kl", temperature=1.0)

    def step() -> None:
        out = kd_and_ce(h, head, y, LiveTeacher(th, lambda x: x @ tw.t()), kd, kd_ratio=0.5, num_chunks=16,
                        compile=True)
        out["loss"].backward()
        h.grad = None

    times = {}
    real = fused_module.logits_kernel_available
    for name, available in [("inductor", lambda s: False), ("triton", real)]:
        fused_module.logits_kernel_available = available
        times[name] = timed(step, iters)
    fused_module.logits_kernel_available = real
    print(json.dumps({"case": "fused_loss_micro_batch", "tokens": 4096, "inductor_ms": times["inductor"],
                      "triton_ms": times["triton"], "speedup": times["inductor"] / times["triton"]}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernel's launch shapes")
    args = p.parse_args()
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    for rows in args.rows:
        chunk_rows(rows, args.iters)
    whole_loss(max(args.iters // 5, 5))
    if args.sweep:
        sweep(args.rows[0], args.iters)


if __name__ == "__main__":
    main()
