"""`activation_checkpointing: auto`: recompute layers in backward only when the activations would not fit; and
on-policy KD's sampling KV budget, chosen by the same estimate (`sampling_kv_positions`).

Checkpointing costs about a third of the student's forward again; it pays only when memory is short. The
activations are what autograd saves for backward in an eager forward of the student's layers
(`layer_saved_bytes_per_token`, a formula measured with `torch.autograd.graph.saved_tensors_hooks`;
tests/test_activation_estimate.py re-measures it), plus the training state still to come (gradients, fp32 moments
and masters), plus a fixed reserve for the chunked loss and allocator slack.
"""

from __future__ import annotations

import torch
from torch import nn

RESERVE_BYTES = 3 * 2**30  # loss chunks, allocator fragmentation, cuBLAS/cuDNN workspaces
USABLE_FRACTION = 0.9
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_saved_bytes_per_token(*, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                                dtype_bytes: int, trains: frozenset[str] | set[str], adapter_rank_sum: int = 0,
                                norms_train: bool = False) -> int:
    """Bytes one Llama-style decoder layer (our builder's torchtune layer, eager) saves for backward per token.

    Measured on CPU with `saved_tensors_hooks` (storages counted once, weights and buffers left out) for full and
    LoRA students; what is saved, per token:
    - each of the two RMSNorms: its input upcast to fp32 (4 x hidden) and the fp32 rstd (4); when the norm's
      scale trains, also the fp32 normed input (4 x hidden), for the scale's gradient;
    - attention (SDPA, flash path): q, k and v (k and v copied out to every query head by torchtune, so heads x
      head_dim each) and the output, at the run dtype, plus the fp32 log-sum-exp per head;
    - RoPE: the cos/sin tables cast to the run dtype for q and for k (4 x head_dim per position; counted per token,
      i.e. for one packed row, an upper bound for several shorter rows);
    - a linear's input only when its weight trains or it carries an adapter (`trains`, PEFT names): a frozen
      weight needs no input for its gradient. q/k/v share one input, gate/up another; o_proj's input is the
      attention output already kept; down_proj's is the MLP product (intermediate);
    - the MLP: gate output, silu(gate) and up output (3 x intermediate), kept whenever the layer's input needs a
      gradient, whether or not its weights train. This, not the linears' inputs, is most of a LoRA student's share;
    - each LoRA adapter: its rank-wide `lora_a` output (`adapter_rank_sum` = the ranks summed over the layer).
    Not covered: DoRA's extra tensors and LoRA dropout masks (shipped dropout is 0). A frozen fp8 base saves only
    its weight, like a frozen bf16 one (quantization/fp8_base.py). On GPU the fused rms_norm keeps the input at the
    run dtype and torch.compile recomputes pointwise ops (about 0.6-0.7x of this measured on CPU with the min-cut
    partitioner), so this is an upper estimate there.
    """
    e = dtype_bytes
    norms = 2 * (4 * hidden + 4) + (2 * 4 * hidden if norms_train else 0)
    attention = e * 4 * heads * head_dim + 4 * heads
    rope = 4 * head_dim * e
    inputs = e * (hidden * bool(trains & {"q_proj", "k_proj", "v_proj"})
                  + hidden * bool(trains & {"gate_proj", "up_proj"}) + intermediate * ("down_proj" in trains))
    return norms + attention + rope + inputs + 3 * intermediate * e + adapter_rank_sum * e


def _out_dim(m: nn.Module) -> int:
    return m.out_features if isinstance(m, nn.Linear) else m.out_dim  # torchtune's LoRA/DoRA layers: out_dim


def activation_bytes(model: nn.Module, micro_batch_tokens: int, dtype: torch.dtype) -> int:
    """Bytes a forward of `micro_batch_tokens` tokens keeps for backward without checkpointing: every decoder
    layer's `layer_saved_bytes_per_token` (shapes and which linears train read off the model), plus the final
    norm's."""
    hidden = model.tok_embeddings.embedding_dim
    per_token = 0
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        mods = dict(zip(LINEARS, (attn.q_proj, attn.k_proj, attn.v_proj, attn.output_proj,
                                  mlp.w1, mlp.w3, mlp.w2), strict=True))
        trains = {n for n, m in mods.items() if any(p.requires_grad for p in m.parameters())}
        ranks = sum(m.lora_a.out_features for m in mods.values() if hasattr(m, "lora_a"))
        per_token += layer_saved_bytes_per_token(
            hidden=hidden, intermediate=_out_dim(mlp.w1), heads=attn.num_heads, kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim, dtype_bytes=dtype.itemsize, trains=trains, adapter_rank_sum=ranks,
            norms_train=layer.sa_norm.scale.requires_grad)
    final = model.norm.scale.requires_grad
    per_token += 4 * hidden + 4 + (4 * hidden if final else 0)
    return per_token * micro_batch_tokens


def training_state_bytes(model: nn.Module) -> int:
    """Gradients plus optimizer state still to be allocated: up to 2 + 12 bytes per trainable parameter
    (bf16 gradient, fp32 moments and master)."""
    return 14 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a wrapper subclass's inner tensors (NF4 stores ~0.52 bytes per element while its
    element_size() says 2; fp8 bases their data and scales), else numel * element_size."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes all of `model`'s weights hold as stored (NF4 and fp8 bases at their real size)."""
    return sum(stored_bytes(p) for p in model.parameters())


def gathered_bytes(model: nn.Module) -> int:
    """Bytes a process holds while `model` is gathered for a whole step (components/fsdp.py): every weight as
    stored, plus an unsharded gradient, in its weight's dtype, for each trained one."""
    return weight_bytes(model) + sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def needs_checkpointing(model: nn.Module, micro_batch_tokens: int, dtype: torch.dtype, device: torch.device,
                        shards: int = 1, built_here: bool = False, gathered: bool = False) -> tuple[bool, str]:
    """Whether activations + training state + reserve exceed the usable free memory of `device` (always False on
    CPU, where memory is the host's and checkpointing only costs time), and the reason in words. `shards` > 1:
    the model is about to be FSDP-sharded over that many GPUs, so 1/shards of its weights and optimizer state will
    be here; `gathered`: its layers stay gathered for a whole step (components/fsdp.py), so all of its weights and
    an unsharded gradient per trained weight are here too; `built_here`: its full copy is on this GPU now
    (Runtime.build_device) and the sharding frees it."""
    if device.type != "cuda":
        return False, "off on CPU"
    acts = activation_bytes(model, micro_batch_tokens, dtype)
    weights = 0 if shards == 1 else weight_bytes(model)
    resident = gathered_bytes(model) if gathered and shards > 1 else weights // shards
    need = acts + training_state_bytes(model) // shards + resident + RESERVE_BYTES
    free = (torch.cuda.mem_get_info(device)[0] + (weights if built_here else 0)) * USABLE_FRACTION
    on = need > free
    gib = 2**30
    why = (f"{'on' if on else 'off'}: about {acts / gib:.1f} GiB of activations for {micro_batch_tokens} tokens "
           f"per micro-batch + {(need - acts) / gib:.1f} GiB of training state and reserve "
           f"{'>' if on else '<='} {free / gib:.1f} GiB usable free on {device}")
    return on, why


def kv_bytes_per_position(model: nn.Module) -> int:
    """Bytes a KV cache holds per position: every layer's K and V at the model's dtype (Llama-3.2-1B: 32 KiB)."""
    size = model.tok_embeddings.weight.element_size()
    return sum(2 * layer.attn.num_kv_heads * layer.attn.head_dim * size for layer in model.layers)


def prefill_bytes_per_token(model: nn.Module) -> int:
    """Bytes a prompt's no-grad forward holds per token at its widest point, an upper estimate: a layer's MLP
    (gate, up, their product and SiLU: 4 x intermediate) and four hidden-wide tensors (input, norm, attention
    output, residual) at the model's dtype."""
    layer = model.layers[0]
    return (4 * _out_dim(layer.mlp.w1) + 4 * model.tok_embeddings.embedding_dim) * model.tok_embeddings.weight.element_size()


def sampling_kv_positions(model: nn.Module, micro: int, step: int, micro_batch_tokens: int,
                          device: torch.device, gathered: int = 0, shards: int = 1) -> tuple[int, str]:
    """How many KV positions one of on-policy KD's sampling groups may span (each group is one decode loop), and
    why in words: `step` (all of a step's on-policy prompts in one loop, however long) when those KV caches fit in
    the usable free memory of `device` beside the larger of what training still needs at once (a micro-batch's
    activations, estimated without checkpointing as `needs_checkpointing` counts them) and the prompts' forward over
    `step` tokens (`prefill_bytes_per_token`), plus the training state, `gathered` (bytes a sharded student's layers
    take while gathered for a whole step) and the reserve; else `micro` (one
    micro-batch's prompts per loop at most). On CPU: `micro` (host memory is not measured here). One H200, the
    shipped 8B -> 1B KD with LoRA on the chat transfer set: 4x the positions ran the step 1.20-1.24x faster for 3.0 GiB
    more peak memory (docs/benchmarks.md, sessions 53-54). `shards`: the processes FSDP2 shards the student over (a
    rank's gradients and optimizer state are 1/shards of the model's; `numel` of a sharded parameter is its whole)."""
    if device.type != "cuda" or step <= micro:
        return micro, (f"{micro} positions, a micro-batch's prompts per decode loop "
                       f"({'one on-policy micro-batch per step' if step <= micro else 'on ' + device.type})")
    kv = step * kv_bytes_per_position(model)
    busiest = max(activation_bytes(model, micro_batch_tokens, model.tok_embeddings.weight.dtype),
                  step * prefill_bytes_per_token(model))  # sampling and training hold these at different times
    need = kv + busiest + training_state_bytes(model) // shards + gathered + RESERVE_BYTES
    free = torch.cuda.mem_get_info(device)[0] * USABLE_FRACTION
    gib = 2**30
    sizes = f"{kv / gib:.1f} GiB of KV caches + {(need - kv) / gib:.1f} GiB for the rest"
    if need <= free:
        return step, f"{step} positions, a step's prompts per decode loop: {sizes} <= {free / gib:.1f} GiB usable free"
    return micro, (f"{micro} positions, a micro-batch's prompts per decode loop: {step} would need {sizes} "
                   f"> {free / gib:.1f} GiB usable free")


def twin_fits(twin_bytes: int, kv_bytes: int, rest_bytes: int, device: torch.device) -> tuple[bool, str]:
    """Whether a sampling copy's weights (on-policy KD's sampling twin or merged copy), a sampling loop's KV caches
    and `rest_bytes` (what training holds at once beside them) fit in the usable free memory of `device` with the
    reserve, and the sizes in words."""
    gib = 2**30
    free = torch.cuda.mem_get_info(device)[0] * USABLE_FRACTION
    need = twin_bytes + kv_bytes + rest_bytes + RESERVE_BYTES
    return need <= free, (f"{twin_bytes / gib:.1f} GiB of weights + {kv_bytes / gib:.1f} GiB of KV caches + "
                          f"{(rest_bytes + RESERVE_BYTES) / gib:.1f} GiB for the rest "
                          f"{'<=' if need <= free else '>'} {free / gib:.1f} GiB usable free")
