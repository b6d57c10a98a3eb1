"""`lora.quantize_base: fp8`: the frozen base weight of each LoRA linear stored in fp8 (e4m3, one scale per output
row), as the fp8 teacher's linears are (torchao's `Float8Tensor` from `Float8DynamicActivationFloat8WeightConfig`
with `PerRow`, the same config: schemes.base_config("float8_dynamic")). It saves 1 byte per base parameter.

Forward: torchao's linear for that tensor (the activation quantized per row, the fp8 rowwise scaled matmul).
Backward: the base is frozen, so only the input's gradient is needed: `grad_out @ W`, with W dequantized to the
gradient's dtype (bf16). torchao's Float8Tensor has no backward of its own (its linear is an inference op: the
activation quantization and the scaled matmul have no derivative), hence the small autograd.Function here. An fp8
backward matmul would need W's scales along the reduction dim (they are per output row), so it is not offered
cleanly. The adapters (lora_a, lora_b) are untouched: their gradients are autograd's as before.

The base is built and loaded in the run dtype and quantized by `Runtime.prepare_model` on the GPU (builder.py
marks the layers with `fp8_base_pending`). One GPU only: FSDP2 sharding of these weights is not supported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RecipeError
from .swap import swapped_class

KEY = "lora.quantize_base=fp8"


class Fp8BaseLinear(torch.autograd.Function):
    """`F.linear(x, weight)` for a frozen torchao Float8Tensor weight; backward gives the input's gradient only,
    computed against the dequantized weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad_out @ weight.dequantize(grad_out.dtype), None


def fp8_base_forward(self, x: torch.Tensor) -> torch.Tensor:
    """LoRALinear.forward with the fp8 base: base (fp8 matmul) + bias + scaled lora_b(lora_a(dropout(x)))."""
    out = Fp8BaseLinear.apply(x, self.weight)
    if self.bias is not None:
        out = out + self.bias
    if self.disabled:
        return out
    return out + (self.alpha / self.rank) * self.lora_b(self.lora_a(self.dropout(x)))


_FP8_CLASSES: dict[type, type] = {}  # LoRA class -> its fp8-base subclass (merge, adapter export keep working)


def pending_fp8_bases(model: nn.Module) -> dict[str, nn.Module]:
    """The LoRA linears built for an fp8 base and not yet quantized, by module name."""
    return {n: m for n, m in model.named_modules() if getattr(m, "fp8_base_pending", False)}


def check_fp8_base_config(lora: Any, device: str, dtype: str) -> None:
    """At config load (`recipe validate` says it too): an fp8 base with `device: cpu` or a dtype other than bf16.
    A GPU's capability and the process count are checked when the model is placed (`check_fp8_base`)."""
    if lora is None or lora.quantize_base != "fp8":
        return
    from .schemes import cpu_only

    cpu = cpu_only(device)  # `device: auto` on a machine with no GPU too, not after the weights load
    if cpu is not None:
        raise RecipeError(f"{KEY} needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper) for fp8 matmuls, "
                          f"but {cpu}; use lora.quantize_base: nf4 or false")
    if dtype != "bf16":
        raise RecipeError(f"{KEY} needs dtype: bf16, got dtype: {dtype}")


def check_fp8_base(device: torch.device, sharded: bool) -> None:
    """One-line RecipeErrors for where the fp8 base cannot run: several processes (FSDP2), CPU, GPUs below sm89."""
    from .schemes import check_device

    if sharded:
        raise RecipeError(f"{KEY} runs on one GPU (FSDP2 does not shard its fp8 base weights); "
                          "with several processes use lora.quantize_base: nf4 or false")
    try:
        check_device("float8_dynamic", device)
    except RecipeError:
        where = device.type
        if device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(device)
            where = f"this GPU (compute capability {major}.{minor})"
        raise _needs_sm89(where) from None


def _needs_sm89(where: str) -> RecipeError:
    return RecipeError(f"{KEY} needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper) for fp8 matmuls, "
                       f"but the model is on {where}; use lora.quantize_base: nf4 or false")


def quantize_fp8_bases(model: nn.Module, device: torch.device, sharded: bool = False) -> int:
    """Store the base weight of every pending LoRA linear as a torchao Float8Tensor (frozen) and give the layer the
    fp8 forward; returns how many."""
    pending = pending_fp8_bases(model)
    if not pending:
        return 0
    check_fp8_base(device, sharded)
    for fqn, m in pending.items():  # every check before any layer changes
        out_features, in_features = m.weight.shape
        if in_features % 16 or out_features % 16:  # torch._scaled_mm's constraint (torchao would silently skip)
            raise RecipeError(f"{KEY}: {fqn} is {out_features}x{in_features}; fp8 matmuls need both dims divisible "
                              "by 16 (use lora.quantize_base: nf4 or false)")
        if m.weight.dtype != torch.bfloat16:  # torchao's per-row fp8 quantization takes bf16 weights only
            raise RecipeError(f"{KEY} needs dtype: bf16 (the base is {m.weight.dtype})")
    for m in pending.values():
        m.weight = nn.Parameter(_to_float8(m.weight.detach()), requires_grad=False)
        m.__class__ = swapped_class(_FP8_CLASSES, type(m), "Fp8Base", {"forward": fp8_base_forward, "fp8_base": True},
                                    __name__)
        del m.fp8_base_pending
    return len(pending)


def _to_float8(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import quantize_

    from .schemes import base_config

    # The teacher's config through torchao's own quantize_ (on a throwaway nn.Linear holding this weight), so the
    # stored tensor, its activation quantization and its matmul are exactly the fp8 teacher's.
    holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    holder.weight = nn.Parameter(weight, requires_grad=False)
    quantize_(holder, base_config("float8_dynamic"))
    return holder.weight.detach()
