"""How fast the packed-document attention of the issue-19 rows runs, and how much faster it could (a diagnosis).

The teacher's attention (Llama-3.1-8B shape, forward only, no grad) and the student's (Llama-3.2-1B shape, forward
and backward) on one micro-batch of the shipped KD row (4 x 1024 tokens, documents packed into each row), timed with
CUDA events after warm-up (defaults: the shipped kd config's micro-batch, 2 rows x 2048 tokens, and document lengths
of the transfer passages under the SmolLM2 tokenizer, the one the recorded KD rows used in `.carry/tok`: mean 254,
10th-90th percentile 126-381 tokens; under Llama 3's they are 240, 120-361):
- `flex`: flex attention with the document BlockMask, compiled, as the recipes run it;
- `flex_autotune`: the same compiled with mode="max-autotune-no-cudagraphs" (Inductor tries its block sizes);
- `varlen_flash`: flash attention over the documents themselves (torch's varlen attention: each document is its own
  causal sequence, given by cumulative lengths; no mask);
- `nested_cudnn` / `nested_flash` / `nested_efficient`: SDPA on a nested (jagged) batch of the documents, with
  one SDPA backend each (full heads: nested SDPA takes no GQA);
- `flex_causal`: flex attention with a plain causal mask (the same work as the SDPA rows);
- `sdpa_cudnn_causal` / `sdpa_flash_causal`: plain causal attention over the whole row (documents NOT separated:
  not a substitute, the speed a fused Hopper kernel reaches on this shape, as a bound);
- `bucketed_cudnn` / `bucketed_flash` (`_full`: K and V repeated to the query heads instead of `enable_gqa`): the
  documents gathered into one right-padded batch [documents, heads, L, dim] (L: the longest document, rounded up
  to 64), plain causal SDPA with one backend, the rows scattered back; exact (under the causal mask no real token
  attends to the padding after it), and the gather and scatter are timed with it;
- `fa4_varlen`: FlashAttention-4's CuTe DSL kernels (`flash_attn.cute`, Hopper and Blackwell; not one of our
  dependencies: `bash bench/device_kd.sh attention` installs it on the device) over the documents, as varlen_flash;
- `cudnn_ragged` / `cudnn_ragged_8_layouts`: cuDNN's ragged (THD) fused kernel over the documents in place
  (bench/cudnn_ragged_attention.py; needs `nvidia-cudnn-frontend` in `.whl`, see there), on this micro-batch / cycling
  through 8 other draws of documents (the cuDNN graphs are built once per bucket and reused); `--cudnn
  DOC_STEP,POW2_SPAN,IMPLEMENTATION` picks its variant (e.g. `1,0,COMPOSITE`). It also prints its largest
  difference from flex (output and, for the student, input gradients) and the seconds its first calls took.

Each row prints `ms` (median of single calls, each timed alone: includes the host's launch latency when the
kernels are short) and `ms_gpu` (the mean of `--iters` calls issued back to back between two events: GPU time,
as in a training step where the host runs ahead).

    python bench/attention_speed.py [--doc-len 128 512] [--iters 50] [--only flex,fa4_varlen] [--cudnn 8,1,AUTO]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import time

import torch
import torch.nn.functional as F
from cudnn_ragged_attention import DocumentLayout, cudnn_version, document_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

SHAPES = {"teacher_8b_fwd": (32, 8, 128, False), "student_1b_fwd_bwd": (32, 8, 64, True)}  # q heads, kv heads, dim


def packed_positions(rows: int, length: int, lo: int, hi: int, seed: int = 0) -> torch.Tensor:
    """[rows, length] positions restarting at 0 at each document (lengths uniform in [lo, hi])."""
    rng, out = random.Random(seed), []
    for _ in range(rows):
        pos: list[int] = []
        while len(pos) < length:
            pos += list(range(rng.randint(lo, hi)))
        out.append(pos[:length])
    return torch.tensor(out)


def timed(fn, iters: int) -> float:
    """Milliseconds per call (median of `iters` CUDA-event timings, after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def timed_back_to_back(fn, iters: int) -> float:
    """Milliseconds per call of `iters` calls issued back to back (after 5 warm-up calls): the GPU's time per call
    once the host runs ahead of it, as in a training step."""
    for _ in range(5):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--doc-len", type=int, nargs=2, default=[126, 381], help="document lengths, uniform in [lo, hi]")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--only", default="", help="comma-separated rows to time (default: all)")
    p.add_argument("--cudnn", default="", help="cudnn_ragged variant: DOC_STEP,POW2_SPAN(0/1),IMPLEMENTATION")
    args = p.parse_args()
    if args.cudnn:
        import cudnn_ragged_attention as da

        step, pow2, da.IMPLEMENTATION = args.cudnn.split(",")
        da.DOC_STEP, da.POW2_SPAN = int(step), pow2 == "1"
    dev = torch.device("cuda")
    positions = packed_positions(args.rows, args.length, *args.doc_len)
    doc = (positions == 0).cumsum(-1).to(dev)
    starts = torch.nonzero(positions.flatten() == 0).flatten()
    cu_seqlens = torch.cat([starts, torch.tensor([positions.numel()])]).to(dev, torch.int32)

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    mask = create_block_mask(same_document_causal, args.rows, None, args.length, args.length, device=dev)
    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, args.length, args.length, device=dev)
    compiled = {"flex": torch.compile(flex_attention),
                "flex_autotune": torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")}
    for shape, (hq, hkv, dim, backward) in SHAPES.items():
        measure(shape, args, hq, hkv, dim, backward, mask, causal, compiled, cu_seqlens, positions)


def tokens(t: torch.Tensor) -> torch.Tensor:
    """[b, h, s, d] -> [b * s, h, d]: the packed rows as one sequence of tokens, as the varlen kernels take them."""
    b, h, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, h, d)


def varlen(q, k, v, cu_seqlens, max_len: int):
    """torch's varlen flash attention, causal within each document, on [b, h, s, d] tensors; its keyword for
    causal masking changed between torch releases (`is_causal`, then `window_size=(-1, 0)`)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    b, h, s, d = q.shape
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params and k.shape[1] != h:
        causal["enable_gqa"] = True
    out = varlen_attn(tokens(q), tokens(k), tokens(v), cu_seqlens, cu_seqlens, max_len, max_len, **causal)
    return out.reshape(b, s, h, d).transpose(1, 2)


def fa4_varlen(q, k, v, cu_seqlens, max_len: int):
    """FlashAttention-4 (CuTe DSL) over the documents, causal within each, GQA native, on [b, h, s, d] tensors."""
    from flash_attn.cute import flash_attn_varlen_func

    b, h, s, d = q.shape
    out = flash_attn_varlen_func(tokens(q), tokens(k), tokens(v), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                 max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(b, s, h, d).transpose(1, 2)


def bucket_index(cu_seqlens, tokens_total: int, pad_to: int = 64) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For `bucketed`, computed once per micro-batch (on the host in a recipe): the flat token index of each padded
    slot [documents * width] (`tokens_total`: a zero row, for the padding), the padded slot of each token, width."""
    lens = cu_seqlens.diff()
    width = -(-int(lens.max()) // pad_to) * pad_to
    slot = torch.arange(width, device=cu_seqlens.device)
    valid = slot[None, :] < lens[:, None]
    gather = torch.where(valid, cu_seqlens[:-1, None] + slot[None, :], tokens_total).flatten()
    scatter = torch.nonzero(valid.flatten()).flatten()
    return gather, scatter, width


def bucketed(q, k, v, index, backend, sdpa_only: bool = False):
    """The documents as one right-padded batch, causal SDPA with `backend`, scattered back to [b, h, s, d].
    `sdpa_only`: the padded inputs are made once outside (the kernel alone: the gather and scatter's floor)."""
    b, h, s, d = q.shape
    gather, scatter, width = index

    def padded(t):
        flat = tokens(t)
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])]).index_select(0, gather)
        return flat.reshape(-1, width, *flat.shape[1:]).transpose(1, 2)

    pq, pk, pv = (q, k, v) if sdpa_only else (padded(q), padded(k), padded(v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(pq, pk, pv, is_causal=True, enable_gqa=pk.shape[1] != pq.shape[1])
    if sdpa_only:
        return out
    out = out.transpose(1, 2).reshape(-1, h, d).index_select(0, scatter)
    return out.reshape(b, s, h, d).transpose(1, 2)


def cudnn_ragged_inputs(q, k, v, grad, positions, args, backward: bool) -> dict:
    """`cudnn_ragged` rows: the same q, k, v in the packed [tokens, heads, dim] layout the recipes' projections
    give, the micro-batch's DocumentLayout, and 8 layouts of other document draws to cycle through (graph reuse)."""
    dev = q.device
    qkv = [tokens(t).detach().contiguous().requires_grad_(backward) for t in (q, k, v)]
    layouts = [DocumentLayout.from_positions(packed_positions(args.rows, args.length, *args.doc_len, seed=i), dev)
               for i in range(1, 9)]
    return {"qkv": qkv, "grad": tokens(grad).contiguous(), "cycle": itertools.cycle(layouts),
            "layout": DocumentLayout.from_positions(positions, dev), "layouts": layouts}


def compare_cudnn_ragged(shape: str, q, k, v, grad, mask, compiled: dict, ragged: dict, backward: bool) -> None:
    """Print cuDNN ragged attention's largest difference from flex's document mask (output, and the input
    gradients for the backward shape), and the seconds its first calls took (the cuDNN graphs are built then)."""
    qkv = ragged["qkv"]
    try:
        start = time.perf_counter()
        for layout in ragged["layouts"]:
            out = document_attention(*qkv, layout)
            if backward:
                out.backward(ragged["grad"])
        torch.cuda.synchronize()
        built = time.perf_counter() - start
        qf, kf, vf = (t.detach().requires_grad_(backward) for t in (q, k, v))
        ref = compiled["flex"](qf, kf, vf, block_mask=mask, enable_gqa=True)
        for t in qkv:
            t.grad = None
        out = document_attention(*qkv, ragged["layout"])
        line = {"cudnn_ragged_vs_flex_max_abs_diff": float((out - tokens(ref)).detach().abs().max()),
                "first_9_calls_s": round(built, 2), "cudnn": cudnn_version()}
        if backward:
            ref.backward(grad)
            out.backward(ragged["grad"])
            for name, mine, theirs in zip("qkv", qkv, (qf, kf, vf)):
                line[f"d{name}_max_abs_diff"] = float((mine.grad - tokens(theirs.grad)).abs().max())
                line[f"d{name}_max_abs"] = float(tokens(theirs.grad).abs().max())
    except Exception as e:  # no frontend, no Hopper, an unsupported graph: say so, go on
        line = {"cudnn_ragged": f"{type(e).__name__}: {str(e)[:600]}"}
    print(json.dumps({"shape": shape, **line}), flush=True)


def nested(q, k, v, cu_seqlens, backend):
    """SDPA over the documents as a nested (jagged) batch, causal within each, with one SDPA backend."""
    b, h, s, d = q.shape
    offsets = cu_seqlens.to(torch.int64)
    nts = [torch.nested.nested_tensor_from_jagged(tokens(t), offsets).transpose(1, 2) for t in (q, k, v)]
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(*nts, is_causal=True)
    return out.transpose(1, 2).values().reshape(b, s, h, d).transpose(1, 2)


def measure(shape: str, args, hq: int, hkv: int, dim: int, backward: bool, mask, causal, compiled: dict,
            cu_seqlens, positions) -> None:
    """Print one JSON line per row for one attention shape."""
    dev = torch.device("cuda")

    def make(heads):
        return torch.randn(args.rows, heads, args.length, dim, device=dev, dtype=torch.bfloat16, requires_grad=backward)

    q, k, v = make(hq), make(hkv), make(hkv)
    index = bucket_index(cu_seqlens, args.rows * args.length)
    n_docs = (cu_seqlens.numel() - 1)
    padded_inputs = [torch.randn(n_docs, heads, index[2], dim, device=dev, dtype=torch.bfloat16,
                                 requires_grad=backward) for heads in (hq, hkv, hkv)]
    grad_padded = torch.randn(n_docs, hq, index[2], dim, device=dev, dtype=torch.bfloat16)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)  # SDPA kernels: full heads
    grad = torch.randn(args.rows, hq, args.length, dim, device=dev, dtype=torch.bfloat16)
    cudnn_rows = not args.only or "cudnn_ragged" in args.only  # its inputs only when asked for
    ragged = cudnn_ragged_inputs(q, k, v, grad, positions, args, backward) if cudnn_rows else {}
    grads = {g.shape: g for g in (grad, grad_padded, ragged.get("grad", grad))}

    def run(attend):
        def step():
            if backward:
                out = attend()
                out.backward(grads[out.shape])
            else:
                with torch.no_grad():
                    attend()
        return step

    def sdpa(backend):
        def attend():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
        return attend

    rows = {
        "flex": run(lambda: compiled["flex"](q, k, v, block_mask=mask, enable_gqa=True)),
        "flex_autotune": run(lambda: compiled["flex_autotune"](q, k, v, block_mask=mask, enable_gqa=True)),
        "varlen_flash": run(lambda: varlen(q, k, v, cu_seqlens, args.length)),
        "varlen_flash_full_heads": run(lambda: varlen(q, kr, vr, cu_seqlens, args.length)),
        "nested_cudnn": run(lambda: nested(q, kr, vr, cu_seqlens, SDPBackend.CUDNN_ATTENTION)),
        "nested_flash": run(lambda: nested(q, kr, vr, cu_seqlens, SDPBackend.FLASH_ATTENTION)),
        "nested_efficient": run(lambda: nested(q, kr, vr, cu_seqlens, SDPBackend.EFFICIENT_ATTENTION)),
        "flex_causal": run(lambda: compiled["flex"](q, k, v, block_mask=causal, enable_gqa=True)),
        "sdpa_cudnn_causal": run(sdpa(SDPBackend.CUDNN_ATTENTION)),
        "sdpa_flash_causal": run(sdpa(SDPBackend.FLASH_ATTENTION)),
        "fa4_varlen": run(lambda: fa4_varlen(q, k, v, cu_seqlens, args.length)),
        "bucketed_cudnn": run(lambda: bucketed(q, k, v, index, SDPBackend.CUDNN_ATTENTION)),
        "bucketed_cudnn_full": run(lambda: bucketed(q, kr, vr, index, SDPBackend.CUDNN_ATTENTION)),
        "bucketed_flash": run(lambda: bucketed(q, k, v, index, SDPBackend.FLASH_ATTENTION)),
        "bucketed_flash_full": run(lambda: bucketed(q, kr, vr, index, SDPBackend.FLASH_ATTENTION)),
        "bucketed_cudnn_sdpa_only": run(lambda: bucketed(*padded_inputs, index, SDPBackend.CUDNN_ATTENTION, True)),
        "cudnn_ragged": run(lambda: document_attention(*ragged["qkv"], ragged["layout"])),
        "cudnn_ragged_8_layouts": run(lambda: document_attention(*ragged["qkv"], next(ragged["cycle"]))),
    }
    if args.only:
        rows = {name: fn for name, fn in rows.items() if name in args.only.split(",")}
    same = {"varlen": lambda: varlen(q, k, v, cu_seqlens, args.length),  # the same attention as flex's mask?
            **{f"nested_{b.name}": functools.partial(nested, q, kr, vr, cu_seqlens, b)
               for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)},
            **{f"bucketed_{b.name}": functools.partial(bucketed, q, kr, vr, index, b)
               for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)}}
    if "fa4_varlen" in rows:  # only when asked for: it is not installed where the others are
        same["fa4_varlen"] = lambda: fa4_varlen(q, k, v, cu_seqlens, args.length)
    if cudnn_rows:
        compare_cudnn_ragged(shape, q, k, v, grad, mask, compiled, ragged, backward)
    with torch.no_grad():
        ref = compiled["flex"](q, k, v, block_mask=mask, enable_gqa=True)
        for name, attend in same.items():
            try:
                line = {f"{name}_vs_flex_max_abs_diff": float((attend() - ref).abs().max())}
            except Exception as e:  # a backend this build or GPU lacks
                line = {name: f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps({"shape": shape, **line}), flush=True)
    for name, fn in rows.items():
        try:
            ms, ms_gpu = timed(fn, args.iters), timed_back_to_back(fn, args.iters)
        except Exception as e:  # a backend this build or GPU lacks: say so, go on
            print(json.dumps({"shape": shape, "row": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}))
            continue
        print(json.dumps({"shape": shape, "row": name, "ms": round(ms, 3), "ms_gpu": round(ms_gpu, 4),
                          "gpu": torch.cuda.get_device_name()}), flush=True)

if __name__ == "__main__":
    main()
