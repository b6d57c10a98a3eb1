"""Quantization schemes by name: the torchao 0.18 config each maps to, where it runs, and which layers it touches.

One table shared by PTQ, QAT and the exports, so a scheme name means the same numerics everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RecipeError

# name -> (needs, qat): needs is "any" (CPU or GPU), "cuda" or "cuda_sm89" (float8 kernels: Ada/Hopper+).
_SCHEMES: dict[str, tuple[str, bool]] = {
    "8da4w": ("any", True),
    "int8_weight_only": ("any", False),
    "int4_weight_only": ("cuda", True),
    "float8_weight_only": ("any", False),
    "float8_dynamic": ("cuda_sm89", False),
}
SCHEMES: tuple[str, ...] = tuple(_SCHEMES)
QAT_SCHEMES: tuple[str, ...] = tuple(k for k, (_, qat) in _SCHEMES.items() if qat)
GROUPED_SCHEMES = ("8da4w", "int4_weight_only")  # schemes whose weights use `group_size` groups per row


@dataclass(frozen=True)
class SchemeInfo:
    """What a scheme needs: a device kind and whether `group_size` applies."""

    name: str
    needs: str
    qat: bool
    grouped: bool


def scheme_info(scheme: str, key: str = "scheme") -> SchemeInfo:
    """Look a scheme up; unknown names raise a RecipeError listing the valid ones."""
    if scheme not in _SCHEMES:
        raise RecipeError(f"{key}: unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")
    needs, qat = _SCHEMES[scheme]
    return SchemeInfo(scheme, needs, qat, scheme in GROUPED_SCHEMES)


def base_config(scheme: str, group_size: int = 32, for_qat_prepare: bool = False):
    """The torchao PTQ config for `scheme` (the base config QAT derives its fake quantizers from).

    int4 weight-only is stored in the tile-packed layout torch's own CUDA tinygemm kernel reads; QAT's
    prepare step only accepts the plain layout, whose fake-quant numerics are the same (asymmetric int4,
    scale (max-min)/15, mid-point zero), so prepare asks for the plain one (`for_qat_prepare=True`).
    """
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        PerGroup,
        PerRow,
    )
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    info = scheme_info(scheme)
    if info.grouped and (not isinstance(group_size, int) or group_size <= 0):
        raise RecipeError(f"group_size must be a positive integer, got {group_size!r}")
    # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning for every later
    # torch.compile in the process (student included). Measured on an H200 (issue 19): 34 s of tuning for one
    # fp8 teacher forward and 187-269 s to the first KD step; the process's compile settings stay ours.
    keep_inductor = {"set_inductor_config": False}
    if scheme == "8da4w":  # (this config has no such switch and changes no Inductor setting)
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "int8_weight_only":
        return Int8WeightOnlyConfig(**keep_inductor)
    if scheme == "int4_weight_only":
        fmt = Int4PackingFormat.PLAIN if for_qat_prepare else Int4PackingFormat.TILE_PACKED_TO_4D
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=fmt, **keep_inductor)
    if scheme == "float8_weight_only":
        return Float8WeightOnlyConfig(**keep_inductor)
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), **keep_inductor)


# Schemes whose torchao path takes bfloat16 weights only, and why.
BF16_ONLY = {"int4_weight_only": "its CUDA kernel is bf16 only",
             "float8_dynamic": "torchao quantizes float8 rows from bf16 weights only"}


def cpu_only(device: str) -> str | None:
    """How a config's `device` key makes its run CPU-only ("device: cpu", "device: auto found no GPU"), or None: for
    the config-load checks of choices that need a GPU later in the run (an fp8 teacher, a QAT conversion)."""
    if device == "cpu":
        return "device: cpu"
    if device == "auto" and not torch.cuda.is_available():
        return "device: auto found no GPU"
    return None


def has_fp8_matmuls(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU with fp8 tensor cores (compute capability >= 8.9: Ada, Hopper and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_device(scheme: str, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Raise a RecipeError when `scheme` cannot run on `device` (and dtype, for the `BF16_ONLY` schemes)."""
    info = scheme_info(scheme)
    device = torch.device(device)
    if info.needs == "any":
        return
    if device.type != "cuda":
        need = "a CUDA GPU" if info.needs == "cuda" else "a CUDA GPU with compute capability >= 8.9 (Ada/Hopper)"
        alt = "8da4w or int8_weight_only" if info.needs == "cuda" else "float8_weight_only, 8da4w or int8_weight_only"
        raise RecipeError(f"scheme {scheme!r} needs {need}, but the model is on {device.type}; "
                          f"run on a GPU or use {alt} on CPU")
    if info.needs == "cuda_sm89" and not has_fp8_matmuls(device):
        cc = torch.cuda.get_device_capability(device)
        raise RecipeError(f"scheme {scheme!r} needs compute capability >= 8.9, this GPU has {cc[0]}.{cc[1]}; "
                          "use float8_weight_only, 8da4w or int8_weight_only")
    if scheme in BF16_ONLY and dtype is not None and dtype != torch.bfloat16:
        raise RecipeError(f"scheme {scheme!r} needs a bfloat16 model ({BF16_ONLY[scheme]}), got {dtype}; set dtype: "
                          "bf16")


def linear_filter(include_output: bool = False) -> Callable[[nn.Module, str], bool]:
    """torchao `filter_fn`: the transformer blocks' nn.Linear layers (q/k/v/o, w1/w2/w3), plus the untied
    output projection when `include_output`. Embeddings (and tied output, which reuses them) never match."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            return False
        if _is_torchao_tensor(module.weight):  # already quantized
            return False
        return fqn.startswith("layers.") or (include_output and fqn == "output")

    return keep


def check_group_size_config(scheme: str, group_size: int, folder: str | None, key: str,
                            where: Callable[[str], str]) -> None:
    """At config load (`recipe validate` too): `group_size` (the config's `key`) against the widths a local model's
    config.json gives, so that a wrong one fails in a second, not after the weights load and a perplexity pass."""
    from ..models.args import local_model_args

    args = local_model_args(folder) if scheme_info(scheme).grouped else None
    if args is None:
        return  # not grouped, or no model here: `check_group_size` checks the loaded model
    for width in sorted({args.hidden_size, args.intermediate_size, args.num_heads * args.head_dim}):
        if width % group_size:
            raise RecipeError(f"{where(key)}: key '{key}': {group_size} does not divide the input width {width} of "
                              f"{folder}'s linear layers (config.json); choose a divisor of {width} (e.g. 32)")


def check_group_size(model: nn.Module, scheme: str, group_size: int, include_output: bool = False) -> None:
    """Grouped schemes need every quantized layer's input width divisible by `group_size`; name the first
    layer that is not (torchao would otherwise skip or assert deep inside)."""
    if not scheme_info(scheme).grouped:
        return
    keep = linear_filter(include_output)
    for fqn, module in model.named_modules():
        in_features = _in_features(module)
        if in_features is None or not (keep(module, fqn) or _is_lora(module) and fqn.startswith("layers.")):
            continue
        if in_features % group_size:
            raise RecipeError(f"group_size {group_size} does not divide the input width {in_features} of {fqn}; "
                              f"choose a divisor of {in_features} (e.g. 32)")


def _is_torchao_tensor(t: torch.Tensor) -> bool:
    from torchao.utils import TorchAOBaseTensor

    return isinstance(t, TorchAOBaseTensor)


def _in_features(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.in_features
    if _is_lora(module):
        return module.weight.shape[1]
    return None


def _is_lora(module: nn.Module) -> bool:
    """torchtune LoRALinear/DoRALinear, recognised by shape (torchtune is only imported in llm_recipe.components.models)."""
    return hasattr(module, "lora_a") and hasattr(module, "lora_b") and isinstance(
        getattr(module, "weight", None), torch.Tensor)


def model_device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype
