"""Models: HF config -> torchtune-module decoders, checkpoint I/O, tokenizer, GGUF import.

The only package that imports torchtune, and only when a function needs it: through `tune.import_torchtune()`,
which first aliases torchao's moved NF4 module. Importing this package imports neither (tune.py says why).
"""

from .args import ModelArgs, read_model_args
from .builder import (
    LORA_TARGETS,
    LoRASettings,
    build_model,
    output_weight,
)
from .convert import hf_to_tune_names, tune_to_hf_names
from .hf_io import load_hf_state_dict, write_hf_folder
from .loader import (
    keep_every,
    load_model,
    lora_modules,
    merged_state_dict,
    prune_layers,
    resolve_dtype,
    save_model,
)
from .peft_adapter import adapter_state_dict, save_peft_adapter

__all__ = [
    "LORA_TARGETS",
    "LoRASettings",
    "ModelArgs",
    "build_model",
    "hf_to_tune_names",
    "keep_every",
    "load_hf_state_dict",
    "load_model",
    "lora_modules",
    "merged_state_dict",
    "output_weight",
    "prune_layers",
    "read_model_args",
    "resolve_dtype",
    "adapter_state_dict",
    "save_peft_adapter",
    "save_model",
    "tune_to_hf_names",
    "write_hf_folder",
]
