"""The attention mask of packed rows, built on the device: a flex-attention `BlockMask` on GPUs, else dense.

A packed row holds several documents, and a token attends only to earlier tokens of its own document. The
collator writes that as a dense boolean [b, s, s] mask, which SDPA cannot hand to flash attention: the masked
kernels compute all s x s scores of every row. On an sm80+ GPU the mask becomes a `BlockMask` instead, and
torchtune's attention runs flex attention with it, which skips every block above the diagonal and every block
between two documents (docs/benchmarks.md measures the step both ways). The documents are read from
`input_pos` (it restarts at 0 at each document), so nothing but the positions crosses to the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor


def use_flex_attention(device: torch.device) -> bool:
    """Whether packed rows on `device` get a flex-attention BlockMask (CUDA, compute capability 8.0 or newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def document_block_mask(input_pos: Tensor):
    """BlockMask of packed rows from their positions `[b, s]`: causal within each document, nothing across."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = (input_pos == 0).cumsum(-1)  # [b, s]: which document of its row each token belongs to

    def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (q >= kv) & (doc[b, q] == doc[b, kv])

    rows, length = input_pos.shape
    return create_block_mask(same_document_causal, rows, None, length, length, device=input_pos.device)

