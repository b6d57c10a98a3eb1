"""The attention mask of packed rows, built on the device from their positions: a flex-attention `BlockMask` on
GPUs, a dense boolean mask elsewhere.

A packed row holds several documents, and a token attends only to earlier tokens of its own document; the
documents are read from `input_pos`, which restarts at 0 at each one. A dense [b, s, s] mask keeps SDPA off
flash attention (its masked kernels compute all s x s scores of every row), and building it in the collator took
tens of milliseconds per micro-batch of host time while the GPU waited. On an sm80+ GPU the mask is a
`BlockMask`, and torchtune's attention runs flex attention with it, which skips every block above the diagonal
and every block between two documents (docs/benchmarks.md measures both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .host_embedding import HOST_TOKENS


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device` (non-blocking copies); packed rows (with `input_pos`) also get their
    attention mask there (`packed_attention_mask`). Host tokens are also kept as they are, under `host_tokens`: a
    teacher whose embedding table stays on the host gathers its rows from them (components/models/host_embedding.py)
    without a device-to-host copy, which would wait for the GPU every micro-batch."""
    out = {k: v if k == HOST_TOKENS else v.to(device, non_blocking=True) for k, v in batch.items()}
    if "input_pos" in out:
        out["mask"] = packed_attention_mask(out["input_pos"])
    tokens = batch.get("tokens")
    if HOST_TOKENS not in out and isinstance(tokens, Tensor) and tokens.device.type == "cpu":
        out[HOST_TOKENS] = tokens  # a reference, no copy
    return out


def use_flex_attention(device: torch.device) -> bool:
    """Whether packed rows on `device` get a flex-attention BlockMask (CUDA, compute capability 8.0 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def packed_attention_mask(input_pos: Tensor):
    """The mask packed rows with positions `input_pos [b, s]` attend through, on their device: a BlockMask on a
    flex-capable GPU, else the dense boolean mask."""
    if use_flex_attention(input_pos.device):
        return document_block_mask(input_pos)
    return document_mask(input_pos)


def document_mask(input_pos: Tensor) -> Tensor:
    """Bool `[b, s, s]` from positions `[b, s]`: True where token i may attend to token j (same document, j <= i)."""
    doc = _document_ids(input_pos)
    length = input_pos.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=input_pos.device).tril_()
    return causal & (doc[:, :, None] == doc[:, None, :])


def document_block_mask(input_pos: Tensor):
    """BlockMask of packed rows from their positions `[b, s]`: causal within each document, nothing across."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = _document_ids(input_pos)

    def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    rows, length = input_pos.shape
    return create_block_mask(same_document_causal, rows, None, length, length, device=input_pos.device)


def _document_ids(input_pos: Tensor) -> Tensor:
    """[b, s]: which document of its row each token belongs to (positions restart at 0 at each document)."""
    return (input_pos == 0).cumsum(-1)
