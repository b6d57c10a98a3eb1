"""Post-training quantization with torchao 0.18 `quantize_`, plus size reporting for before/after."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..errors import RecipeError
from .schemes import (
    _is_lora,
    base_config,
    check_device,
    check_group_size,
    linear_filter,
    model_device_dtype,
)


def quantize_model(model: nn.Module, scheme: str, group_size: int = 32, include_output: bool = False) -> nn.Module:
    """Quantize (in place) the transformer blocks' linears, plus the untied output projection when
    `include_output`; embeddings stay as they are. Returns `model`.

    Schemes: 8da4w, int8_weight_only, float8_weight_only (CPU or GPU); int4_weight_only (CUDA, bf16);
    float8_dynamic (CUDA, compute capability >= 8.9). A scheme that cannot run here raises a RecipeError.
    """
    from torchao.quantization import quantize_

    config = base_config(scheme, group_size)
    device, dtype = model_device_dtype(model)
    check_device(scheme, device, dtype)
    adapters = [fqn for fqn, m in model.named_modules() if _is_lora(m)]
    if adapters:
        raise RecipeError(f"quantize_model: {adapters[0]} still has LoRA adapters; quantize the merged model "
                          "(load the saved model/ folder) or use QAT's convert_qat, which merges them")
    check_group_size(model, scheme, group_size, include_output)
    keep = linear_filter(include_output)
    if not any(keep(m, fqn) for fqn, m in model.named_modules()):
        raise RecipeError("quantize_model: no linear layer to quantize (is the model already quantized?)")
    with torch.no_grad():
        quantize_(model, config, filter_fn=keep)
    return model


def size_on_disk(path: str | os.PathLike) -> int:
    """Bytes of a file, or of the files of a model folder (a HF folder, a .gguf, a .pte). A folder's subfolders are
    not the model: a training checkpoint keeps its optimizer state in recipe_state/ (counted, a checkpoint read as
    544.7 MiB against its model's 516.5)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    raise RecipeError(f"{p}: no such file or folder")


def _weights_bytes(path: Path) -> int:
    """Weight files only when `path` is a model folder (tokenizer and config are noise for a ratio)."""
    if path.is_dir():
        files = [f for f in path.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin", ".gguf", ".pte")]
        if files:
            return sum(f.stat().st_size for f in files)
    return size_on_disk(path)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def summarize_sizes(before_dir: str | os.PathLike, after_path: str | os.PathLike) -> dict:
    """Compare weight bytes of the source HF folder and of an export (folder or single file).

    Returns {"before_bytes", "after_bytes", "ratio" (before/after), "text"}; `text` is one line for logs.
    """
    before, after = _weights_bytes(Path(before_dir)), _weights_bytes(Path(after_path))
    ratio = before / after if after else float("inf")
    text = f"{_human(before)} -> {_human(after)} ({ratio:.2f}x smaller)"
    return {"before_bytes": before, "after_bytes": after, "ratio": ratio, "text": text}
