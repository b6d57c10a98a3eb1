"""On-policy KD's sampling copy of a LoRA student on one GPU: its adapted linears as plain linears holding
W + (alpha / r) B A, refreshed before each sampling, so the compiled decode step runs no adapter.

Why: a decode step is bound by its number of kernels (one H200, Llama-3.2-1B with 16 prompts: 570 kernels in its
CUDA graph, ~1.6 us apart), and the shipped KD LoRA section's adapters are 210 of them (two small matmuls per
adapted projection); without them the same sampler drew 8,203 tokens/s against ~5,300 (docs/benchmarks.md,
session 61). The cost is one copy of the adapted weights in the run dtype (1.9 GB for rank 64 on q, v, o and the
MLP of a 1B student), which `make_merged` weighs against free memory; everything else (embeddings, norms,
unadapted projections, the head) is the student's own tensor.

Rounding: the merge is computed in fp32 and, for a bf16 copy, rounded stochastically with noise seeded per
refresh. Each merged weight's expected value is then W + (alpha / r) B A exactly: the first steps' updates (B
starts at zero, its first updates below half a bf16 step of most base weights) move the sampler as they move the
student, where round-to-nearest would drop them into the base model. The same seed merges alike, so a resumed run
samples what the uninterrupted one did.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from .memory import activation_bytes, kv_bytes_per_position, training_state_bytes, twin_fits
from .models.tune import import_torchtune

BLOCK_ELEMENTS = 2**24  # a refresh merges this many weights at a time (64 MiB of fp32 temporaries each)


def mergeable(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA linears of `model` by module name when every one can be merged (torchtune's LoRALinear over a plain
    base weight), else {}. These keep their adapters in the decode step: DoRA (its magnitude), a quantized base
    (NF4: a merged copy would be the bf16 weights QLoRA exists not to hold; fp8: the student's forward also
    quantizes its input, which a merged bf16 matmul would not, so the copy would sample another function), and
    QAT's fake quantizers on the merged weight (the copy would sample unquantized)."""
    import_torchtune()
    from torchtune.modules.peft import DoRALinear, LoRALinear

    adapters = {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))}
    if any(isinstance(m, DoRALinear) or getattr(m, "_quantize_base", False) or getattr(m, "fp8_base_pending", False)
           or getattr(m, "fp8_base", False) or not _plain(m.weight)
           or getattr(m, "weight_fake_quantizer", None) is not None for m in adapters.values()):
        return {}
    return adapters


def _plain(weight: torch.Tensor) -> bool:
    """Whether `weight` is a plain tensor, or FSDP2's shard of one (a DTensor over a plain local tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):
        weight = weight.to_local()
    return type(weight) in (torch.Tensor, nn.Parameter)


class MergedSampler:
    """`model`: a module tree like `student`'s sharing every tensor with it, with each LoRA linear replaced by an
    `nn.Linear` whose weight is this object's own (`refresh` fills it); no compiled entry of the student's layers
    (the decode step compiles its own graph). Build it after the student is on its device and quantized."""

    def __init__(self, student: nn.Module) -> None:
        adapters = mergeable(student)
        if not adapters:
            raise ValueError("MergedSampler: the student has no LoRA linears that can be merged")
        self.model = _tree(student, adapters)
        self._pairs = [(lora, self.model.get_submodule(name).weight) for name, lora in adapters.items()]
        self.model.eval()

    @torch.no_grad()
    def refresh(self, student: nn.Module, seed: int = 0) -> nn.Module:
        """The copy with the student's adapters as they are now, merged into its weights in place (the addresses
        a recorded CUDA graph reads stay the same); `seed`: the stochastic rounding's noise."""
        merge_adapters_(self._pairs, seed)
        return self.model


def merge_adapters_(pairs: list[tuple[nn.Module, torch.Tensor]], seed: int,
                    fetch: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """Each (LoRA linear, merged weight) of `pairs`, in order, merged in place from the linear's W, A and B as
    `fetch` gives them (the sampling twin: gathered from FSDP2's shards), with one refresh's rounding noise from
    `seed`: the same order and noise give one process's copy and every rank's twin the same weights."""
    generator = rounding_generator(seed, pairs[0][1]) if pairs else None
    for lora, merged in pairs:
        b = None if lora.disabled else fetch(lora.lora_b.weight)
        merge_lora_(merged, fetch(lora.weight), fetch(lora.lora_a.weight), b, lora.alpha / lora.rank, generator)


def rounding_generator(seed: int, merged: torch.Tensor) -> torch.Generator | None:
    """The noise of one refresh's stochastic rounding, seeded with `seed`, where the merged weights are bf16."""
    if merged.dtype != torch.bfloat16:
        return None
    return torch.Generator(device=merged.device).manual_seed(seed)


@torch.no_grad()
def merge_lora_(merged: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None, scale: float,
                generator: torch.Generator | None) -> None:
    """`merged` (in place) = `base` + `scale` b a (b None: a disabled adapter, the base alone), computed in fp32
    (fp64 for an fp64 model) and rounded to bf16 with `generator`'s noise where `merged` is bf16. Row blocks of at
    most BLOCK_ELEMENTS at a time: a 128,256 x 2,048 head would otherwise want 2.5 GB of temporaries."""
    wide = torch.promote_types(merged.dtype, torch.float32)
    a = a.to(wide)
    rows = max(1, BLOCK_ELEMENTS // merged.shape[1])
    for start in range(0, merged.shape[0], rows):
        block = slice(start, start + rows)
        exact = base[block].detach().to(wide, copy=True)
        if b is not None:
            exact.addmm_(b[block].to(wide), a, alpha=scale)
        if generator is not None:
            exact = bf16_rounding_noise_(exact, generator)
        merged[block].copy_(exact)


def bf16_rounding_noise_(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 `x`, in place, rounded to a bf16 value (still fp32) up or down with probability by distance, so its
    expected value is `x`: uniform noise below bf16's last bit is added to the fp32 bit pattern (sign and magnitude:
    the same for negative values), then those 16 bits are cleared. Returns `x`, exactly convertible to bf16."""
    bits = x.view(torch.int32)
    bits.add_(torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator))
    bits.bitwise_and_(-65536)
    return x


def round_to_bf16_stochastically(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 `x` (overwritten) rounded to bf16 stochastically (`bf16_rounding_noise_`)."""
    return bf16_rounding_noise_(x, generator).to(torch.bfloat16)


def merged_bytes(adapters: dict[str, nn.Module]) -> int:
    """What a `MergedSampler` of these LoRA linears allocates: one weight each, in its adapters' dtype."""
    return sum(m.weight.shape.numel() * m.lora_a.weight.element_size() for m in adapters.values())


def plain_linear(lora: nn.Module) -> nn.Linear:
    """A frozen `nn.Linear` of the LoRA linear `lora`'s shape, with a bias where it has one, on the meta device: the
    merged copy and the sampling twin give it a weight (and the bias) of their own."""
    out_features, in_features = lora.weight.shape
    plain = nn.Linear(in_features, out_features, bias=getattr(lora, "bias", None) is not None, device="meta")
    return plain.requires_grad_(False)


def _tree(module: nn.Module, adapters: dict[str, nn.Module], prefix: str = "") -> nn.Module:
    """A copy of `module`'s tree that shares its tensors: each module a shallow copy with dicts of its own (so KV
    caches set on the copy's attention layers stay off the student's), LoRA linears replaced by plain ones with new
    weights, no `nn.Module.compile` entry and no `forward` set on the instance (Runtime's activation checkpointing
    wraps a layer's forward there, a closure over the student's layer: the copy, which runs without grad, takes its
    class's forward). Other dicts (state-dict hooks, non-persistent buffer names) stay shared: the copy is never
    saved, loaded or trained."""
    if prefix in adapters:
        lora, plain = module, plain_linear(module)
        plain.weight = nn.Parameter(torch.empty(lora.weight.shape, dtype=lora.lora_a.weight.dtype,
                                                device=lora.lora_a.weight.device), requires_grad=False)
        if plain.bias is not None:
            plain.bias = lora.bias
        return plain
    new = copy.copy(module)  # a new instance dict (nn.Module.__setstate__), its values the student's
    for attr in ("_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks"):
        new.__dict__[attr] = dict(module.__dict__[attr])
    new.__dict__["_compiled_call_impl"] = None
    new.__dict__.pop("forward", None)
    new.__dict__.pop("_recipe_checkpointed", None)
    new.__dict__["_modules"] = {name: None if child is None else _tree(child, adapters, f"{prefix}.{name}".lstrip("."))
                                for name, child in module._modules.items()}
    return new


def make_merged(student: nn.Module, kv_positions: int, train_tokens: int,
                device: torch.device) -> tuple[MergedSampler | None, str | None]:
    """A `MergedSampler` of `student` when it has adapters to merge and the copy fits beside a sampling loop's
    `kv_positions` of KV caches and what a training step holds (activations of `train_tokens`, the training
    state), else None; and what was chosen, in words (None: no adapters to merge)."""
    adapters = mergeable(student)
    if not adapters or device.type != "cuda":
        return None, None
    rest = activation_bytes(student, train_tokens, student.tok_embeddings.weight.dtype) + training_state_bytes(student)
    fits, sizes = twin_fits(merged_bytes(adapters), kv_positions * kv_bytes_per_position(student), rest, device)
    if not fits:
        return None, f"the LoRA adapters run in the decode step: a merged copy of their weights would not fit ({sizes})"
    return MergedSampler(student), f"the LoRA adapters merged into a copy of the weights they adapt ({sizes})"
