"""Loading a model folder that our tools wrote, as it deploys: float weights (a full or LoRA-merged run), a QAT
run's trained weights (converted with the scheme it trained for) or a torchao-quantized export.

What evaluation (`RecipeLM`), `generate` and `transfer` load a model with; it needs neither lm-eval nor a recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import RecipeError
from .ptq import quantize_model
from .qat import read_qat_metadata

__all__ = ["load_checkpoint", "saved_quantization"]


def saved_quantization(ckpt_dir: str | Path) -> dict | None:
    """The quantization recipe a checkpoint folder records (our quantization.json, or a torchao
    `quantization_config` in config.json), or None for a plain float checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    qfile = ckpt_dir / "quantization.json"
    if qfile.is_file():
        try:
            return json.loads(qfile.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RecipeError(f"{qfile}: not valid JSON ({e}); re-run the quantize recipe") from e
    cfg_file = ckpt_dir / "config.json"
    if cfg_file.is_file():
        qcfg = json.loads(cfg_file.read_text(encoding="utf-8")).get("quantization_config")
        if qcfg:
            return qcfg
    return None


def check_checkpoint_dir(ckpt_dir: str | Path) -> None:
    """A one-line error unless `ckpt_dir` is a model folder whose config.json matches its safetensors headers:
    from the files' headers alone, so a caller (`recipe lm_eval`) can refuse a wrong path before any other work."""
    from ..models.args import check_weight_shapes

    if not (Path(ckpt_dir) / "config.json").is_file():
        raise RecipeError(f"checkpoint={ckpt_dir}: no config.json there; pass a Hugging Face model folder")
    check_weight_shapes(ckpt_dir)


def load_checkpoint(ckpt_dir: str | Path, dtype: str | torch.dtype = "float32",
                    device: str | torch.device = "cpu", max_seq_len: int | None = None) -> tuple[torch.nn.Module, Any]:
    """Load model + tokenizer of a HF folder written by our tools. A torchao export (config.json
    `quantization_config`, quant_method torchao) loads with its quantized tensors; a QAT output
    (`quantization.json` beside float weights) is converted with the recorded scheme, as deployment would.
    `max_seq_len`: the longest sequence the model is built for (its RoPE table; None: up to 8192)."""
    from ..models import load_model  # lazy: importing this module stays light
    from ..models.tokenizer import Tokenizer, check_tokenizer_fits

    ckpt_dir = Path(ckpt_dir)
    check_checkpoint_dir(ckpt_dir)  # config.json against the safetensors headers, then against the tokenizer
    tokenizer = Tokenizer.from_dir(ckpt_dir)
    check_tokenizer_fits(ckpt_dir, tokenizer)  # before the weights load
    qcfg = saved_quantization(ckpt_dir)
    if qcfg is not None and qcfg.get("quant_method") == "torchao":
        from .export_hf import load_hf_torchao

        model, _ = load_hf_torchao(ckpt_dir, device=device, max_seq_len=max_seq_len)
    else:
        model, _ = load_model(ckpt_dir, dtype=dtype, device=device, max_seq_len=max_seq_len)
        if qcfg is not None:
            if qcfg.get("method") != "qat" or "scheme" not in qcfg:
                raise RecipeError(f"{ckpt_dir}: unknown quantization record {qcfg}; expected a torchao "
                                  "quantization_config in config.json or a QAT quantization.json")
            # Converting a QAT run is PTQ of its trained weights with the scheme it trained for.
            meta = read_qat_metadata(ckpt_dir)
            model = quantize_model(model, meta["scheme"], meta.get("group_size") or 32,
                                   bool(meta.get("include_output", False)))
    model.eval()
    return model, tokenizer
