"""Write LoRA/DoRA adapters in PEFT's format (adapter_model.safetensors + adapter_config.json).

Our module names map to HF names by renaming only, so PEFT keys are `base_model.model.<hf name>.lora_A.weight`.
Both functions take a full, plain state dict (`Runtime.full_state_dict`, gathered from FSDP shards under
torchrun), never the live model: a sharded model's parameters are DTensors whose local storage is not the weight.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..checkpoint import atomic_directory
from .builder import LoRASettings
from .convert import tune_to_hf_key

_SUFFIX = {"lora_a.weight": "lora_A.weight", "lora_b.weight": "lora_B.weight", "magnitude": "lora_magnitude_vector"}


def is_adapter_key(key: str) -> bool:
    """Whether a (tune-named) state dict key is a LoRA/DoRA adapter tensor."""
    return any(key.endswith("." + ours) for ours in _SUFFIX)


def adapter_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a full (tune-named) state dict, under PEFT key names."""
    out = {}
    for key, value in state_dict.items():
        for ours, theirs in _SUFFIX.items():
            if key.endswith("." + ours):
                module = key[: -len(ours) - 1]
                hf_module = tune_to_hf_key(module + ".weight")[: -len(".weight")]
                out[f"base_model.model.{hf_module}.{theirs}"] = value.detach().cpu().contiguous()
    return out


def save_peft_adapter(state_dict: Mapping[str, torch.Tensor], lora: LoRASettings, out_dir: str | Path,
                      base_model: str | None = None) -> Path:
    """Write a folder that `peft.PeftModel.from_pretrained(base, out_dir)` loads, from a full state dict."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets),
        "use_dora": lora.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model,
    }
    with atomic_directory(out_dir) as tmp:
        save_file(adapter_state_dict(state_dict), tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)
