"""Compiled flex attention with `BACKEND: "AUTO"` against `"TRITON"` at the shipped shapes (a diagnosis, torch only).

Our compiled decoder layers ask flex attention for its main Triton kernel (components/models/builder.py): with
"AUTO", rows under 128 tokens without grad took Inductor's decoding kernel, which failed to compile on an H200. This
times both settings, forward + backward and forward alone without grad, on packed 2048-token rows with documents
(the 1B student's and the 8B teacher's heads, grouped-query), so a difference at the rows users train on would
show; and compiles the 96-token no-grad case with each setting, which "AUTO" is expected to fail.

    python bench/flex_backend_speed.py              # CUDA; prints one JSON line per case
    python bench/flex_backend_speed.py --code       # whether AUTO and TRITON generate the same code at 2 x 2048
"""

from __future__ import annotations

import argparse
import difflib
import json
import random

import torch
from attention_speed import timed_back_to_back  # bench/ is on the path when run as bench/...py
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

SHAPES = {"student_1b": (32, 8, 64), "teacher_8b": (32, 8, 128)}  # query heads, KV heads, head dim


def document_mask(rows: int, length: int, device: torch.device):
    """A BlockMask of packed rows: documents of 50-1500 tokens, causal within each, nothing across."""
    rng = random.Random(0)
    doc = torch.zeros(rows, length, dtype=torch.long)
    for r in range(rows):
        start, d = 0, 0
        while start < length:
            n = rng.randint(50, 1500)
            doc[r, start:start + n] = d
            start, d = start + n, d + 1
    doc = doc.to(device)

    def same_document_causal(b, h, q, kv):
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    return create_block_mask(same_document_causal, rows, None, length, length, device=device)


def both_ways(attend, q, k, v, grad) -> tuple[float, float]:
    """Milliseconds of forward + backward, and of the forward alone without grad."""

    def train():
        attend(q, k, v).backward(grad)

    def infer():
        with torch.no_grad():
            attend(q, k, v)

    return timed_back_to_back(train, 100), timed_back_to_back(infer, 100)


def generated_code(backend: str, mask, device: torch.device) -> list[str]:
    """Inductor's generated code (forward and backward modules) for the student's heads with `backend`, less its
    comments (they quote the graph, BACKEND included)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    q = torch.randn(2, 32, 2048, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 8, 2048, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    attend = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask, enable_gqa=True,
                                                          kernel_options={"BACKEND": backend}).sum(), dynamic=False)
    _, code = run_and_get_code(lambda: attend(q, k, v).backward())
    return ["\n".join(ln for ln in c.splitlines() if not ln.lstrip().startswith("#")) for c in code]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="store_true", help="instead: whether both settings generate the same code")
    a = p.parse_args()
    device = torch.device("cuda")
    if a.code:
        auto, triton = (generated_code(b, document_mask(2, 2048, device), device) for b in ("AUTO", "TRITON"))
        diff = sum(len(list(difflib.unified_diff(x.splitlines(), y.splitlines(), n=0))) for x, y in zip(auto, triton))
        print(json.dumps({"modules": len(auto), "same_code": auto == triton, "diff_lines": diff}))
        return
    rows, length = 2, 2048
    mask = document_mask(rows, length, device)
    for name, (hq, hkv, d) in SHAPES.items():
        q = torch.randn(rows, hq, length, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(rows, hkv, length, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(rows, hkv, length, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(rows, hq, length, d, device=device, dtype=torch.bfloat16)
        for backend in ("TRITON", "AUTO", "TRITON"):  # TRITON twice: the spread between two runs of one setting
            torch._dynamo.reset()
            attend = torch.compile(lambda q, k, v, b=backend: flex_attention(
                q, k, v, block_mask=mask, enable_gqa=True, kernel_options={"BACKEND": b}), dynamic=False)

            train_ms, infer_ms = both_ways(attend, q, k, v, grad)
            print(json.dumps({"shape": name, "backend": backend, "rows": f"{rows}x{length}",
                              "fwd_bwd_ms": round(train_ms, 3), "fwd_no_grad_ms": round(infer_ms, 3)}), flush=True)
    short = document_mask(4, 96, device)
    for backend in ("AUTO", "TRITON"):
        torch._dynamo.reset()
        q = torch.randn(4, 4, 96, 16, device=device)
        k, v = torch.randn(4, 2, 96, 16, device=device), torch.randn(4, 2, 96, 16, device=device)
        try:
            with torch.no_grad():
                torch.compile(lambda q, k, v, b=backend: flex_attention(
                    q, k, v, block_mask=short, enable_gqa=True, kernel_options={"BACKEND": b}), dynamic=False)(q, k, v)
            result = "compiled"
        except Exception as e:  # noqa: BLE001 - the failure is the finding
            result = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps({"shape": "4x96 fp32 no grad", "backend": backend, "result": result}), flush=True)


if __name__ == "__main__":
    main()
