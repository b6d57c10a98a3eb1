"""The KD loss path alone: student head + CE + forward KL (teacher head under no-grad), forward + backward.

    python bench/loss_path.py [--tokens 4096,16384] [--impls fused,chunked,torchtune,liger]
    python bench/loss_path.py --device cpu --shapes smollm2 --tokens 1024,4096 --impls fused,chunked,torchtune

Shapes of issue 9: student width 2048, teacher width 4096, vocab 128256, bf16, kd_ratio 0.5, the student's head
trainable (its weight gets a gradient, the most work). Times are CUDA-event medians of `--iters` runs after
`--warmup`; "extra GiB" is the peak allocated during one fwd+bwd minus what was allocated before it (inputs,
weights). Implementations:
- fused: llm_recipe.components.losses.kd_and_ce with a plain bias-free head (ours, default path: the fused driver);
- chunked: the same kd_and_ce with a head it cannot fuse (ours before, and the path of LoRA/QAT/NF4 heads:
  checkpointed chunks, heads projected twice);
- torchtune: torchtune 0.6.1's CEWithChunkedOutputLoss + ForwardKLWithChunkedOutputLoss on 8 logit chunks;
- liger: Liger-Kernel's LigerFusedLinearJSD(jsd_beta=0) (forward KL only) plus its fused linear CE
  (skipped when liger_kernel is not installed).
On CPU (`--device cpu`, fp32) times are wall-clock medians and memory is not measured; `--shapes smollm2` uses
the embedded model's widths (576 / 576, vocab 49152).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

SHAPES = {"llama": (128256, 2048, 4096), "smollm2": (49152, 576, 576)}  # vocab, student width, teacher width
CFG = {"device": "cuda", "dtype": torch.bfloat16, "shape": SHAPES["llama"]}


def make_inputs(n: int, seed: int = 0):
    vocab, d_student, d_teacher = CFG["shape"]
    g = torch.Generator(device=CFG["device"]).manual_seed(seed)
    kw = dict(device=CFG["device"], dtype=CFG["dtype"])
    h = (torch.randn(1, n, d_student, generator=g, **kw)).requires_grad_(True)
    th = torch.randn(1, n, d_teacher, generator=g, **kw)
    w = (torch.randn(vocab, d_student, generator=g, **kw) * d_student**-0.5).requires_grad_(True)
    tw = torch.randn(vocab, d_teacher, generator=g, **kw) * d_teacher**-0.5
    y = torch.randint(0, vocab, (1, n), generator=g, device=CFG["device"])
    return h, th, w, tw, y


@functools.lru_cache(maxsize=1)
def _plain_head(w):
    """A bias-free Linear around `w` itself (no copy), built once per weight: not timed after the warmup."""
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    del head.weight
    head.weight = w
    return head


def impl_fused(h, th, w, tw, y):
    from llm_recipe.components.losses import LiveTeacher, build_kd_loss, kd_and_ce

    kd = build_kd_loss("forward_kl")
    return kd_and_ce(h, _plain_head(w), y, LiveTeacher(th, lambda x: x @ tw.t()), kd, 0.5,
                     num_chunks=max(1, h.shape[1] // 1024))["loss"] / h.shape[1]


def impl_chunked(h, th, w, tw, y):
    from llm_recipe.components.losses import LiveTeacher, build_kd_loss, kd_and_ce

    return kd_and_ce(h, lambda x: x @ w.t(), y, LiveTeacher(th, lambda x: x @ tw.t()), build_kd_loss("forward_kl"), 0.5,
                     num_chunks=8)["loss"] / h.shape[1]


def impl_torchtune(h, th, w, tw, y):
    import importlib

    from llm_recipe.components.models.tune import import_torchtune

    import_torchtune()  # torchtune 0.6.1 needs torchao's NF4 module under its old name first
    tt = importlib.import_module("torchtune.modules.loss")
    logits = [c @ w.t() for c in h.tensor_split(8, dim=1)]
    with torch.no_grad():
        t_logits = [c @ tw.t() for c in th.tensor_split(8, dim=1)]
    return 0.5 * tt.CEWithChunkedOutputLoss(8)(logits, y) + 0.5 * tt.ForwardKLWithChunkedOutputLoss(8)(logits, t_logits, y)


def impl_liger(h, th, w, tw, y):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss, LigerFusedLinearJSD

    flat, tflat, yf = h.flatten(0, 1), th.flatten(0, 1), y.flatten()
    kd = LigerFusedLinearJSD(jsd_beta=0.0, temperature=1.0)(flat, w, tflat, tw, yf)
    return 0.5 * LigerFusedLinearCrossEntropyLoss()(w, flat, yf) + 0.5 * kd


IMPLS = {"fused": impl_fused, "chunked": impl_chunked, "torchtune": impl_torchtune, "liger": impl_liger}


def measure(fn, n: int, warmup: int, iters: int) -> dict:
    h, th, w, tw, y = make_inputs(n)
    for _ in range(warmup):
        fn(h, th, w, tw, y).backward()
        h.grad = w.grad = None
    if CFG["device"] == "cpu":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn(h, th, w, tw, y).backward()
            times.append((time.perf_counter() - start) * 1e3)
            h.grad = w.grad = None
        return {"ms": statistics.median(times), "extra_gib": float("nan")}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(h, th, w, tw, y).backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        h.grad = w.grad = None
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"ms": statistics.median(times), "extra_gib": extra}


def check_grads(n: int = 2048) -> dict:
    """Fused vs chunked on the same bf16 inputs: relative difference of the loss and both gradients."""
    out = {}
    grads = {}
    for name in ("fused", "chunked"):
        h, th, w, tw, y = make_inputs(n, seed=1)
        loss = IMPLS[name](h, th, w, tw, y)
        loss.backward()
        grads[name] = (loss.detach().float(), h.grad.float(), w.grad.float())
    for i, key in enumerate(("loss", "grad_hidden", "grad_weight")):
        a, b = grads["fused"][i], grads["chunked"][i]
        out[key] = float((a - b).norm() / b.norm().clamp_min(1e-30))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="llama")
    a = p.parse_args()
    CFG.update(device=a.device, shape=SHAPES[a.shapes], dtype=torch.bfloat16 if a.device == "cuda" else torch.float32)
    name = torch.cuda.get_device_name() if a.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(json.dumps({"device": name, "torch": torch.__version__, "shapes": a.shapes,
                      "fused_vs_chunked_rel_diff": check_grads()}), flush=True)
    rows = []
    for n in (int(t) for t in a.tokens.split(",")):
        for name in a.impls.split(","):
            try:
                r = measure(IMPLS[name], n, a.warmup, a.iters)
            except Exception as e:  # noqa: BLE001  (a failing implementation is a row, not the end of the bench)
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            if a.device == "cuda":
                torch.cuda.empty_cache()
            rows.append({"tokens": n, "impl": name, **r})
            print(json.dumps(rows[-1]), flush=True)
    print("| tokens | impl | ms (fwd+bwd) | extra GiB |\n|---|---|---|---|")
    for r in rows:
        cell = f"{r['ms']:.1f} | {r['extra_gib']:.2f}" if "ms" in r else f"{r['error']} |"
        print(f"| {r['tokens']} | {r['impl']} | {cell} |")


if __name__ == "__main__":
    main()
