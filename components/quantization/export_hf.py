"""Export a torchao-quantized model as a Hugging Face folder that `transformers` loads pre-quantized.

`config.json` carries `quantization_config` in the form transformers' `TorchAoConfig.to_dict()` writes
(`{"quant_method": "torchao", "quant_type": {"default": <torchao config_to_dict>}, ...}`), and the weights are
safetensors flattened with torchao's own `flatten_tensor_state_dict` (`<module>._weight_qdata`,
`_weight_scale`, ... plus per-tensor JSON in the safetensors metadata) - the format transformers'
`TorchAoHfQuantizer` reads back with `unflatten_tensor_state_dict`. torchao 0.18 allows this for
`IntxUnpackedToInt8Tensor` (8da4w), `Int8Tensor` (int8 weight-only), `Float8Tensor` and the int4 tensors,
i.e. every scheme we offer, so no pickled `pytorch_model.bin` is ever needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..checkpoint import atomic_directory
from ..errors import RecipeError
from ..models import ModelArgs, tune_to_hf_names
from ..models.hf_io import copy_tokenizer_files
from ..models.loader import dtype_name
from .ptq import quantize_model
from .schemes import _is_torchao_tensor, base_config


def torchao_quantization_config(scheme: str, group_size: int = 32, include_output: bool = False) -> dict:
    """The `quantization_config` entry of config.json, as transformers' TorchAoConfig serializes it."""
    from torchao.core.config import config_to_dict

    return {
        "quant_method": "torchao",
        "quant_type": {"default": config_to_dict(base_config(scheme, group_size))},
        "modules_to_not_convert": None if include_output else ["lm_head"],
        "include_input_output_embeddings": False,
        "untie_embedding_weights": False,
    }


def _quantized_fqns(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if _is_torchao_tensor(p)]


def export_hf_torchao(
    model: nn.Module,
    args: ModelArgs,
    tokenizer_dir: str | Path | None,
    out_dir: str | Path,
    scheme: str,
    group_size: int = 32,
    include_output: bool = False,
) -> Path:
    """Write `out_dir` (atomically): config.json with the torchao quantization_config, model.safetensors with
    torchao tensors, tokenizer files. A model not yet quantized is quantized here (in place) with `scheme`."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    if not _quantized_fqns(model):
        quantize_model(model, scheme, group_size, include_output)
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:
        sd.pop("output.weight", None)
    plain = {k: v for k, v in sd.items() if not _is_torchao_tensor(v)}
    dtype = next(iter(plain.values())).dtype
    tensors, metadata = flatten_tensor_state_dict(tune_to_hf_names(sd))
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    config = args.to_hf_config(dtype=dtype_name(dtype))
    config["quantization_config"] = torchao_quantization_config(scheme, group_size, include_output)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata=metadata)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(tokenizer_dir, tmp)
    return out_dir


def load_hf_torchao(model_dir: str | Path, device: str | torch.device = "cpu",
                    max_seq_len: int | None = None) -> tuple[nn.Module, ModelArgs]:
    """Load a folder written by `export_hf_torchao` back into our decoder with its torchao tensors."""
    from safetensors import safe_open
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    from ..models import build_model, hf_to_tune_names, read_model_args

    model_dir = Path(model_dir)
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise RecipeError(f"{path}: not found (expected a folder written by the quantize recipe)")
    args = read_model_args(model_dir)
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        metadata = f.metadata() or {}
        flat = {k: f.get_tensor(k) for k in f.keys()}
    sd, leftover = unflatten_tensor_state_dict(flat, metadata)
    if leftover:
        raise RecipeError(f"{path}: tensors {sorted(leftover)[:3]} are not torchao-flattened")
    sd = hf_to_tune_names(sd, tied=args.tie_word_embeddings)
    dtype = next(v.dtype for v in sd.values() if not _is_torchao_tensor(v))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model(args, max_seq_len=max_seq_len)
    finally:
        torch.set_default_dtype(old)
    model.load_state_dict(sd, assign=True, strict=True)  # assign: keep the torchao tensor subclasses
    return model.to(device).eval(), args
