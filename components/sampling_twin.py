"""An unsharded twin of an FSDP2-sharded student, so on-policy KD on several processes samples with the compiled,
CUDA-graphed decode step one process uses.

Why: under FSDP2 each layer's weights are gathered in hooks around every forward, and a CUDA graph reads weights at
fixed addresses with no hooks, so a sharded student could only sample eagerly, every decode step running those hooks
and an all-reduce of "every row stopped" (two H200s, the shipped 8B -> 1B KD with LoRA: 2,482 sampled tokens/s over
both GPUs against one GPU's 12,061 with the compiled step; docs/benchmarks.md, session 55). The twin holds the
student's full weights on each GPU at addresses that never change: its structure is copied before sharding
(`twin_structure`: placeholders on the meta device, no weights), its weights are gathered into it once, and before
each sampling only the trained ones are gathered again, into the same tensors (`SamplingTwin.refresh`). Each rank
then samples its own prompts with no collective inside the decode loop. The cost is one full copy of the student's
weights per GPU (an NF4 base at its 4-bit size), which `twin_fits` weighs against free memory.

A LoRA student's twin holds its adapted linears merged, W + (alpha / r) B A, as one process's merged copy does
(components/merged_sampler.py: the adapters' small matmuls were 210 of a decode step's 570 kernels): each refresh
gathers W, A and B and merges them into the twin's weight, with the same rounding noise on every rank and as on one
process, so N processes sample what one does where both merge (one process merges only on a GPU with the room; N
processes wherever the twin is made, CPU included: the two then differ by the merge's rounding). It costs no memory
beyond the twin (W's copy becomes the merged one) but gathers every adapted W again per refresh (1.8 GiB for the
rank-64 section of a 1B student: milliseconds over NVLink, more over PCIe), where the unmerged twin gathered only
the adapters.
"""

from __future__ import annotations

import copy
import itertools
from typing import NamedTuple

import torch
from torch import nn

from .memory import gathered_bytes, twin_fits, weight_bytes
from .merged_sampler import merge_adapters_, mergeable, plain_linear

MERGED_WORDS = ", its LoRA adapters merged into the weights they adapt"


class TwinPlan(NamedTuple):
    """What `twin_structure` takes from the loaded student before it is sharded."""

    structure: nn.Module  # its modules, with meta placeholders for weights
    weight_bytes: int  # the twin's weights once gathered (as stored: NF4 at its real size)
    gathered_bytes: int  # what FSDP2 holds while the layers stay gathered for a whole step: weights + full gradients


def twin_structure(model: nn.Module) -> TwinPlan:
    """A deep copy of `model` (loaded, not yet compiled, checkpointed or sharded) whose parameters and buffers are
    meta placeholders (tied weights stay one placeholder), and the sizes `make_twin` weighs."""
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    return TwinPlan(copy.deepcopy(model, memo), weight_bytes(model), gathered_bytes(model))


class SamplingTwin:
    """`structure` (from `twin_structure`) filled with the full weights of `sharded` (the same model after
    `Runtime.prepare_model` sharded it) on its device. Every rank must build it and call `refresh` at the same
    points, in the same order (each gathers the sharded weights with collectives). `merge`: LoRA linears that
    can be merged (`mergeable`) become plain linears holding W + (alpha / r) B A (`merged` says whether any did)."""

    @torch.no_grad()
    def __init__(self, structure: nn.Module, sharded: nn.Module, merge: bool = True) -> None:
        params, buffers = self._sources(sharded)
        adapters = mergeable(sharded) if merge else {}
        for name, lora in adapters.items():  # filled below with W's copy (W's dtype: the adapters'), merged in each
            parent, _, child = name.rpartition(".")  # refresh
            structure.get_submodule(parent).register_module(child, plain_linear(lora))
        made: dict[int, nn.Parameter] = {}  # id of the sharded parameter -> the twin's (tied weights stay one)
        self._trained: list[tuple[str, nn.Parameter]] = []  # refreshed before each sampling
        for prefix, module in structure.named_modules(remove_duplicate=False):
            for attr, p in list(module._parameters.items()):
                if p is None:
                    continue
                name = f"{prefix}.{attr}" if prefix else attr
                source = params[name]
                if id(source) not in made:
                    made[id(source)] = nn.Parameter(_full(source, copy=True), requires_grad=False)
                    if source.requires_grad:
                        self._trained.append((name, made[id(source)]))
                module._parameters[attr] = made[id(source)]
            for attr, b in list(module._buffers.items()):
                if b is not None:  # read-only (the rope cache): the student's own tensor, on its device
                    module._buffers[attr] = buffers[f"{prefix}.{attr}" if prefix else attr]
        self.model = structure.eval()
        self._merged = [(lora, self.model.get_submodule(name).weight) for name, lora in adapters.items()]

    @property
    def merged(self) -> bool:
        """Whether the twin holds LoRA linears merged."""
        return bool(self._merged)

    @staticmethod
    def _sources(sharded: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The sharded model's parameters (every name of a tied one) and buffers, each layer sharded again first:
        a parameter read while its layer is gathered would be FSDP2's unsharded copy, whose memory it frees."""
        from .fsdp import reshard_all

        reshard_all(sharded)
        return (dict(sharded.named_parameters(remove_duplicate=False)),
                dict(sharded.named_buffers(remove_duplicate=False)))

    @torch.no_grad()
    def refresh(self, sharded: nn.Module, seed: int = 0) -> nn.Module:
        """The twin with the trained weights of `sharded` as they are now (gathered into its tensors in place: the
        addresses a recorded CUDA graph reads stay the same); frozen ones never change; merged LoRA linears merged
        again from W, A and B, with `seed`'s rounding noise (components/merged_sampler.py)."""
        params, _ = self._sources(sharded)  # every layer sharded again: the linears hold their shards
        for name, p in self._trained:
            p.copy_(_full(params[name], copy=False))
        merge_adapters_(self._merged, seed, lambda t: _full(t, copy=False))  # one process's order and noise
        return self.model


def _full(value: torch.Tensor, copy: bool) -> torch.Tensor:
    """A sharded parameter's full tensor, gathered on its device (every rank must call it); a plain one detached,
    cloned when `copy` (one not sharded by FSDP2 stays the student's own tensor otherwise)."""
    from torch.distributed.tensor import DTensor

    from .fsdp import gather

    if isinstance(value, DTensor):
        return gather(value.detach())
    return _clone(value.detach()) if copy else value.detach()


def _clone(t: torch.Tensor) -> torch.Tensor:
    """An exact copy; a tensor subclass through its inner tensors (torchao 0.18's NF4 `clone` quantizes the
    dequantized weight again, which moves its scales)."""
    if hasattr(t, "__tensor_flatten__"):
        names, ctx = t.__tensor_flatten__()
        return type(t).__tensor_unflatten__({n: _clone(getattr(t, n)) for n in names}, ctx, t.size(), t.stride())
    return t.clone()


def step_gathered_bytes(plan: TwinPlan, sharded: nn.Module) -> int:
    """Bytes a step holds beside the twin while `sharded`'s layers stay gathered for the whole step (fsdp.shard's
    per-step schedule: weights and full gradients), else 0."""
    return plan.gathered_bytes if getattr(sharded, "_recipe_gather_per_step", False) else 0


def make_twin(plan: TwinPlan, sharded: nn.Module, kv_positions: int, train_tokens: int, rt,
              required: bool) -> tuple[SamplingTwin | None, str]:
    """The twin of `sharded` when its weights and a micro-batch's `kv_positions` of KV caches fit beside what a
    training step holds (activations of `train_tokens`, this rank's optimizer state, the layers gathered for a
    whole step where they are), else None (eager sampling, through the sharded student), and why in words. Every
    rank weighs its own free memory and the twin is made only where it fits on all (the twin's gathers are
    collectives: a rank that ran out of memory in them would leave the others waiting in the next one until the
    NCCL timeout); the words are rank 0's sizes. `required` (`decode: compiled`): a one-line error instead of None.
    `rt`: the run's Runtime."""
    from .errors import RecipeError
    from .memory import activation_bytes, kv_bytes_per_position, training_state_bytes

    if rt.device.type != "cuda":
        twin = SamplingTwin(plan.structure, sharded)
        return twin, f"an unsharded copy of the student per process{MERGED_WORDS if twin.merged else ''}"
    rest = (activation_bytes(sharded, train_tokens, sharded.tok_embeddings.weight.dtype)
            + step_gathered_bytes(plan, sharded) + training_state_bytes(sharded) // rt.world_size)
    fits, sizes = twin_fits(plan.weight_bytes, kv_positions * kv_bytes_per_position(sharded), rest, rt.device)
    short = int(rt.all_reduce_sum(0.0 if fits else 1.0))  # the GPUs it would not fit on
    if short and (fits or short > 1):  # this GPU's sizes, and how many lack the room
        sizes += f" here; it would not fit on {short} of {rt.world_size} GPUs"
    if not short:
        twin = SamplingTwin(plan.structure, sharded)
        return twin, f"an unsharded copy of the student per GPU{MERGED_WORDS if twin.merged else ''}: {sizes}"
    if required:
        raise RecipeError("kd.on_policy.decode=compiled on several GPUs samples with an unsharded copy of the "
                          f"student on each, which does not fit: {sizes}; use decode: auto (eager sampling "
                          "through the sharded student) or free memory (a smaller batch_size or prompts_per_row)")
    return None, f"eager decode steps through the sharded student: an unsharded copy per GPU would not fit ({sizes})"
