"""cuDNN's ragged (THD) fused attention over packed documents, for `bench/attention_speed.py` (a diagnosis, not
used by the recipes): each document of a micro-batch is its own causal sequence, read in place from the packed
[tokens, heads, dim] projections (no mask, no padding, no transposes).

Why it was tried: flex attention's document mask is the recipes' attention on GPUs, and cuDNN's dense causal kernel
ran 1.65-1.83x faster than it on padded documents (docs/benchmarks.md, session 39); torch's own ragged cuDNN path
(nested tensors, `aten::_cudnn_attention_forward`) builds a new cuDNN graph on every call (~50 ms). Here a graph is
built once per (documents, longest document) bucket through cuDNN's frontend (`nvidia-cudnn-frontend`, carried in
`.whl` for the bench only) and reused; the micro-batch's document table is a device tensor bound at execution.
Measured (session 43, cuDNN 9.19 as torch 2.11 ships it): the same output and gradients as flex, and 1.4x
(teacher forward) to 2x (student forward + backward) slower, so the recipes keep flex.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Buckets of a graph's shape: the document count is rounded up to a multiple of DOC_STEP (the extra documents are
# empty) and the longest document to a power of two of at least MIN_SPAN tokens, so a run builds a few graphs.
DOC_STEP = 8
MIN_SPAN = 128
POW2_SPAN = True  # else the longest document rounded up to a multiple of 64
IMPLEMENTATION = "AUTO"  # cuDNN's attention implementation: AUTO, COMPOSITE or UNIFIED


@dataclass(frozen=True)
class DocumentLayout:
    """Where each document of a packed micro-batch lies: `table[0]` the cumulative token counts (documents then
    padding entries equal to the token total), `table[1]` the lengths (0 for padding), int32 on the GPU; `shape`
    (documents bucket, longest-document bucket) on the host, as a CPU tensor (its values are not guarded by
    torch.compile, so new micro-batches never recompile)."""

    table: Tensor
    shape: Tensor

    @staticmethod
    def from_positions(input_pos: Tensor, device: torch.device) -> DocumentLayout:
        """From host positions [b, s] (restarting at 0 at each document), the layout on `device`."""
        _ops()  # registered before torch.compile traces a layer that calls them
        flat = input_pos.reshape(-1)
        starts = torch.nonzero(flat == 0).flatten()
        lengths = torch.diff(starts, append=torch.tensor([flat.numel()]))
        docs, total = lengths.numel(), flat.numel()
        table = torch.zeros(2, total + 1, dtype=torch.int32)
        table[0, 1 : docs + 1] = torch.cumsum(lengths, 0)
        table[0, docs + 1 :] = total
        table[1, :docs] = lengths
        bucket = -(-docs // DOC_STEP) * DOC_STEP
        longest = int(lengths.max())
        span = max(MIN_SPAN, 1 << (longest - 1).bit_length()) if POW2_SPAN else -(-longest // 64) * 64
        return DocumentLayout(table.to(device, non_blocking=True), torch.tensor([bucket, span]))


def document_attention(q: Tensor, k: Tensor, v: Tensor, layout: DocumentLayout) -> Tensor:
    """Causal attention within each document: q [tokens, heads, dim], k and v [tokens, kv heads, dim] (grouped
    query heads as they are) -> [tokens, heads, dim]."""
    out, _ = torch.ops.recipe_bench.document_attention(q, k, v, layout.table, layout.shape)
    return out


def cudnn_version() -> str:
    """The cuDNN library the frontend runs on (torch's own, e.g. 9.19.0 with torch 2.11.0+cu130)."""
    import cudnn

    return cudnn.backend_version_string()


@functools.cache
def _handle(device_index: int):
    import cudnn

    with torch.cuda.device(device_index):
        return cudnn.create_handle()


@functools.cache
def _graph(backward: bool, docs: int, span: int, total: int, hq: int, hkv: int, dim: int,
           dtype: torch.dtype, device_index: int):
    """A built cuDNN graph for one bucket (the forward, which keeps the softmax statistics, or the backward) and
    its named tensors."""
    import cudnn

    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=_handle(device_index))
    i32 = cudnn.data_type.INT32

    def offsets(name):
        return graph.tensor(name=name, dim=[docs + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)

    def packed(name, heads, offset, data_type=io, width=dim):
        return graph.tensor(name=name, dim=[docs, heads, span, width], stride=[span * heads * width, width,
                            heads * width, 1], data_type=data_type, ragged_offset=offset)

    t = {name: offsets(name) for name in ("q_off", "kv_off", "stats_off")}
    t["seq_len"] = graph.tensor(name="seq_len", dim=[docs, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
    t["q"], t["k"], t["v"] = packed("q", hq, t["q_off"]), packed("k", hkv, t["kv_off"]), packed("v", hkv, t["kv_off"])
    common = dict(attn_scale=1.0 / math.sqrt(dim), use_padding_mask=True, seq_len_q=t["seq_len"],
                  seq_len_kv=t["seq_len"], diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                  diagonal_band_right_bound=0)
    if not backward:
        o, lse = graph.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                            implementation=getattr(cudnn.attention_implementation, IMPLEMENTATION), **common)
        outputs = {"o": o, "stats": lse}
    else:
        t["o"], t["do"] = packed("o", hq, t["q_off"]), packed("do", hq, t["q_off"])
        t["stats"] = packed("stats", hq, t["stats_off"], cudnn.data_type.FLOAT, 1)
        dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"],
                                         stats=t["stats"], max_total_seq_len_q=total, max_total_seq_len_kv=total,
                                         **common)
        outputs = {"dq": dq, "dk": dk, "dv": dv}
    layouts = {"o": (hq, "q_off", io, dim), "stats": (hq, "stats_off", cudnn.data_type.FLOAT, 1),
               "dq": (hq, "q_off", io, dim), "dk": (hkv, "kv_off", io, dim), "dv": (hkv, "kv_off", io, dim)}
    for name, tensor in outputs.items():
        heads, offset, data_type, width = layouts[name]
        tensor.set_output(True).set_dim([docs, heads, span, width]).set_stride(
            [span * heads * width, width, heads * width, 1]).set_data_type(data_type).set_ragged_offset(t[offset])
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, {**t, **outputs}


def _run(graph_and_tensors, bound: dict, device: torch.device) -> None:
    import cudnn

    graph, tensors = graph_and_tensors
    handle = _handle(device.index)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    graph.execute({tensors[name]: value for name, value in bound.items()}, workspace, handle=handle)


def _offsets(table: Tensor, docs: int, hq: int, hkv: int, dim: int) -> dict:
    cum = table[0, : docs + 1].view(docs + 1, 1, 1, 1)
    return {"q_off": cum * (hq * dim), "kv_off": cum * (hkv * dim), "stats_off": cum * hq,
            "seq_len": table[1, :docs].reshape(docs, 1, 1, 1).contiguous()}


@functools.cache
def _ops() -> None:
    """Register the two custom ops (on first use: nothing happens at import): forward and backward are opaque
    to torch.compile, which sees their shapes through the fake functions."""

    @torch.library.custom_op("recipe_bench::document_attention", mutates_args=())
    def forward(q: Tensor, k: Tensor, v: Tensor, table: Tensor, shape: Tensor) -> tuple[Tensor, Tensor]:
        docs, span = shape.tolist()
        total, hq, dim = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(total, hq, dtype=torch.float32, device=q.device)
        graph = _graph(False, docs, span, total, hq, k.shape[1], dim, q.dtype, q.device.index)
        _run(graph, {"q": q, "k": k, "v": v, "o": out, "stats": lse, **_offsets(table, docs, hq, k.shape[1], dim)},
             q.device)
        return out, lse

    @forward.register_fake
    def _(q, k, v, table, shape):
        return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)

    @torch.library.custom_op("recipe_bench::document_attention_backward", mutates_args=())
    def backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, table: Tensor,
                 shape: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        docs, span = shape.tolist()
        total, hq, dim = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        graph = _graph(True, docs, span, total, hq, k.shape[1], dim, q.dtype, q.device.index)
        _run(graph, {"q": q, "k": k, "v": v, "o": out, "do": grad.contiguous(), "stats": lse, "dq": dq, "dk": dk,
                     "dv": dv, **_offsets(table, docs, hq, k.shape[1], dim)}, q.device)
        return dq, dk, dv

    @backward.register_fake
    def _(grad, q, k, v, out, lse, table, shape):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, table, shape = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], table, shape)

    def gradients(ctx, grad_out, grad_lse):
        q, k, v, out, lse, table, shape = ctx.saved_tensors
        dq, dk, dv = torch.ops.recipe_bench.document_attention_backward(grad_out, q, k, v, out, lse, table, shape)
        return dq, dk, dv, None, None

    forward.register_autograd(gradients, setup_context=setup_context)
