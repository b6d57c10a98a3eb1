"""A cheaper frozen KD teacher: its transformer linears quantized with torchao (the output head stays as is).

`fp8` is torchao's float8 dynamic-activation / float8 weight with per-row scales (sm89+ GPUs): the teacher's
matmuls run on the fp8 tensor cores. `int8_weight_only` halves the teacher's weight memory (CPU and GPU). The
head is left in the run dtype because the KD target is read from its logits; docs/losses.md reports the KL
between the bf16 and quantized teacher on real weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RecipeError
from .schemes import base_config, check_device, linear_filter

# config value -> scheme name in llm_recipe.components.quantization.schemes
TEACHER_QUANT = {"fp8": "float8_dynamic", "int8_weight_only": "int8_weight_only"}


def quantize_teacher(teacher: nn.Module, mode: str | None, device: torch.device) -> nn.Module:
    """Quantize the (already placed, frozen) teacher in place per `teacher.quantize`; None leaves it alone."""
    if mode is None:
        return teacher
    if mode not in TEACHER_QUANT:
        raise RecipeError(f"teacher.quantize: {mode!r} is not one of null, {', '.join(TEACHER_QUANT)}")
    scheme = TEACHER_QUANT[mode]
    from ..models.builder import is_sharded

    if is_sharded(teacher):
        raise RecipeError(f"teacher.quantize={mode} needs an unsharded teacher (one full copy per GPU); "
                          "set teacher.placement: replicate, or teacher.quantize: null to shard it")
    try:
        check_device(scheme, device)
    except RecipeError as e:
        raise RecipeError(f"teacher.quantize={mode}: {e}") from None
    from torchao.quantization import quantize_

    if mode == "fp8":
        _check_fp8_shapes(teacher)
    quantize_(teacher, base_config(scheme), filter_fn=linear_filter(include_output=False))
    return teacher


def _check_fp8_shapes(model: nn.Module) -> None:
    # torch._scaled_mm needs both matrix dims divisible by 16; name the first layer that is not.
    keep = linear_filter(include_output=False)
    for fqn, m in model.named_modules():
        if keep(m, fqn) and (m.in_features % 16 or m.out_features % 16):
            raise RecipeError(f"teacher.quantize=fp8: {fqn} is {m.out_features}x{m.in_features}; fp8 matmuls need "
                              "both dims divisible by 16 (use int8_weight_only or null)")
