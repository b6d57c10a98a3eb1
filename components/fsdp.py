"""FSDP2 for a trained model on several processes: how it is sharded, and how often it talks per optimizer step.

By default FSDP2 all-gathers every layer in forward and again in backward, and reduce-scatters its gradients, for
each micro-batch. With 8 micro-batches per step and a 16-layer student that is about 400 collectives a step: on
4 H200s the shipped 8B -> 1B LoRA KD step took 1.25 s where one GPU takes 0.95 s for the same per-GPU work (docs/
distributed.md, session 33). When the gathered weights and their gradients are small next to the free memory (a
1B student, a LoRA or QLoRA base), the layers are gathered once per optimizer step instead: they stay gathered
from their first forward to the step's last backward, and gradients accumulate locally and are reduce-scattered
once, after the last micro-batch. The update is the same; only the communication moves.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint.stream_save import Deferred, made
from .errors import RecipeError

# Gather once per step when the full weights plus the gradients of the trainable ones take at most this share of
# the free memory: what stays free is left to activations, the optimizer and the allocator (a frozen 8B bf16
# teacher shards on every GPU size; a 1B student or an NF4 8B base gathers on an 80 GiB GPU).
GATHER_SHARE = 0.25


def gather_per_step(model: nn.Module, free_bytes: float) -> tuple[bool, str]:
    """Whether to keep `model` gathered for a whole optimizer step (see the module docstring), and why in words.
    Only a trained model: a frozen, sharded teacher is sharded to save memory and never runs backward."""
    from .memory import gathered_bytes

    if not any(p.requires_grad for p in model.parameters()):
        return False, "frozen"
    need, gib = gathered_bytes(model), 2**30
    keep = need <= free_bytes * GATHER_SHARE
    return keep, (f"{'once' if keep else 'per micro-batch'}: the gathered weights and gradients ({need / gib:.2f} "
                  f"GiB) {'<=' if keep else '>'} {GATHER_SHARE:.0%} of {free_bytes / gib:.1f} GiB free")


def shard(model: nn.Module, layers: nn.ModuleList, device_type: str, world_size: int, per_step: bool) -> None:
    """FSDP2 per transformer layer, then the root (embeddings, final norm, output projection).

    Overlap: each layer prefetches the next layer's all-gather in forward (FSDP2 already prefetches the
    previous one in backward), so the gather of layer i+1 runs while layer i computes even when the CPU is not
    far ahead of the GPU; it costs one more gathered layer alive. `per_step`: layers stay gathered after forward
    (backward needs no second gather) and `accumulate` keeps them gathered across the step's micro-batches;
    otherwise they reshard after forward (memory) and backward re-gathers them. The root keeps FSDP2's default
    of staying gathered after forward: chunked losses call `model.output` (the output projection, or the tied
    embedding) outside the model's forward, which needs its full weight, and backward would re-gather it at once.
    """
    from torch.distributed.fsdp import fully_shard

    check_nf4_shardable(model, world_size)
    mesh = dist.device_mesh.init_device_mesh(device_type, (world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=not per_step)
    fully_shard(model, mesh=mesh)
    for this, nxt in zip(layers[:-1], layers[1:], strict=True):
        this.set_modules_to_forward_prefetch([nxt])
    model._recipe_gather_per_step = per_step


def accumulate(model: nn.Module, last: bool) -> None:
    """Call before each micro-batch's backward: under a once-per-step schedule (`shard(per_step=True)`) only the
    step's last micro-batch reduce-scatters the accumulated gradients and reshards the layers; the others keep
    both local. A no-op for any other model (one process, or per-micro-batch sharding)."""
    if getattr(model, "_recipe_gather_per_step", False):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def reshard(model: nn.Module) -> None:
    """Free the gathered copies of a once-per-step model (after a forward without backward, such as sampling or
    a held-out score), so state dicts and memory see the shards again. A no-op otherwise."""
    if getattr(model, "_recipe_gather_per_step", False):
        reshard_all(model)


def reshard_all(model: nn.Module) -> None:
    """Free every gathered copy of an FSDP2 model's weights, whatever its schedule (its registered parameters are
    the sharded DTensors again); a no-op for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def gather(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor, on its device, on every rank (every rank must call it), each of its collectives
    waited.

    Why not rely on torch's waiting (`get_model_state_dict(full_state_dict=True)` and DTensor's own): torch waits
    for a gathered tensor only when it is itself an AsyncCollectiveTensor. A gathered NF4 weight (QLoRA) is an
    NF4Tensor whose three inner tensors are; on the ranks that drop them they were never waited, so every QLoRA run
    on several GPUs ended with torch's "672 unwaited collective calls" warning (8B: 224 NF4 weights x 3) and held
    the gathered copies until exit. Here the tensor, and each of its inner tensors, is waited."""
    return _waited(value.full_tensor())


def _waited(t: torch.Tensor) -> torch.Tensor:
    """`t` with each AsyncCollectiveTensor, itself or an inner tensor of a subclass (NF4's gathered parts), waited
    and replaced by its result: a plain tensor, which a compiled graph that reads it (on-policy KD's sampling twin)
    does not wait on again at every replay."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        return t.trigger_wait()
    if hasattr(t, "__tensor_flatten__"):
        names, ctx = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__({n: _waited(getattr(t, n)) for n in names}, ctx, t.size(), t.stride())
    return t


def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor | Deferred]:
    """The full state dict of an FSDP2 model with each sharded tensor a `Deferred` that gathers it on the device
    when made (`gather`): written one tensor at a time, a full copy of the model never exists, on the GPU or the
    host. Every rank must make the same Deferreds in the same order (`save_model(out_dir=None)` on the ranks that
    do not write)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    # torch's keys (FSDP-wrapper prefixes removed); the values are the local shards: no communication
    sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
    return {k: Deferred(v.shape, v.dtype, partial(gather, v)) if isinstance(v, DTensor) else v.detach()
            for k, v in sharded.items()}


def full_state_dict(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2 model as CPU tensors, gathered one tensor at a time; kept where `keep`
    (rank 0), gathered and dropped elsewhere. Every rank must call it."""
    out = {}
    for key, value in gathered_state_dict(model).items():
        value = made(value)
        if keep:
            out[key] = value.detach().to("cpu")
    return out


def check_nf4_shardable(model: nn.Module, world_size: int) -> None:
    """FSDP2 shards a torchao NF4 weight (QLoRA) by splitting each of its inner tensors (4-bit data, per-block
    scalers, and the per-`scaler_block_size`-blocks quantization factors) into `world_size` equal parts
    (torchao nf4_tensor.nf4_split). A weight with fewer than `world_size` quantization factors, or a count
    not divisible by it, would fail deep inside fully_shard with an AssertionError: say which one instead."""
    for name, p in model.named_parameters():
        factors = getattr(p, "quantization_factor", None)
        if factors is None or not hasattr(p, "scaler_block_size"):
            continue
        per_factor = p.block_size * p.scaler_block_size
        if factors.numel() % world_size or p.numel() % (per_factor * world_size):
            raise RecipeError(
                f"lora.quantize_base: the NF4 weight {name} {tuple(p.shape)} cannot be sharded over {world_size} "
                f"processes: FSDP2 splits NF4's scales evenly, which needs its size to be a multiple of "
                f"block_size*scaler_block_size*world_size = {per_factor * world_size}; use fewer processes "
                "or lora.quantize_base=false"
            )

