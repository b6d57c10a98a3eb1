"""`activation_checkpointing: auto`: recompute layers in backward only when the activations would not fit.

Checkpointing costs about a third of the student's forward again; it pays only when memory is short. The estimate
is deliberately simple and errs high: the tensors a Llama-style layer keeps for backward (normed inputs, q/k/v,
attention output, gate/up/product of the MLP) at the compute dtype, plus the training state still to come
(gradients, fp32 moments and masters), plus a fixed reserve for the chunked loss and allocator slack.
"""

from __future__ import annotations

import torch
from torch import nn

RESERVE_BYTES = 3 * 2**30  # loss chunks, allocator fragmentation, cuBLAS/cuDNN workspaces
USABLE_FRACTION = 0.9


def activation_bytes(model: nn.Module, micro_batch_tokens: int, dtype: torch.dtype) -> int:
    """Bytes a forward of `micro_batch_tokens` tokens keeps for backward without checkpointing (an upper estimate):
    per layer and token about 10 x hidden + 4 x intermediate values."""
    hidden = model.tok_embeddings.embedding_dim
    per_token = 0
    for layer in model.layers:
        inter = max((m.out_features for m in layer.mlp.modules() if isinstance(m, nn.Linear)), default=4 * hidden)
        per_token += 10 * hidden + 4 * inter
    return per_token * micro_batch_tokens * dtype.itemsize


def training_state_bytes(model: nn.Module) -> int:
    """Gradients plus optimizer state still to be allocated: up to 2 + 12 bytes per trainable parameter
    (bf16 gradient, fp32 moments and master)."""
    return 14 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def needs_checkpointing(model: nn.Module, micro_batch_tokens: int, dtype: torch.dtype,
                        device: torch.device, shards: int = 1) -> tuple[bool, str]:
    """Whether activations + training state + reserve exceed the usable free memory of `device` (always False on
    CPU, where memory is the host's and checkpointing only costs time), and the reason in words. `shards` > 1:
    the model is about to be FSDP-sharded over that many GPUs (its weights are not on this one yet)."""
    if device.type != "cuda":
        return False, "off on CPU"
    acts = activation_bytes(model, micro_batch_tokens, dtype)
    weights = 0 if shards == 1 else sum(p.numel() * p.element_size() for p in model.parameters())
    need = acts + (training_state_bytes(model) + weights) // shards + RESERVE_BYTES
    free = torch.cuda.mem_get_info(device)[0] * USABLE_FRACTION
    on = need > free
    gib = 2**30
    why = (f"{'on' if on else 'off'}: about {acts / gib:.1f} GiB of activations for {micro_batch_tokens} tokens "
           f"per micro-batch + {(need - acts) / gib:.1f} GiB of training state and reserve "
           f"{'>' if on else '<='} {free / gib:.1f} GiB usable free on {device}")
    return on, why
