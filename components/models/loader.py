"""Load a HF folder into our torchtune-module decoder (optionally LoRA-wrapped or layer-pruned) and save back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..checkpoint.stream_save import Deferred, made
from ..errors import RecipeError
from .args import ModelArgs, check_weight_shapes, read_model_args
from .builder import LoRASettings, build_model
from .convert import hf_to_tune_names, tune_to_hf_names
from .hf_io import load_hf_state_dict, write_hf_folder
from .stream_load import read_into, stored_tensors
from .tune import import_torchtune

if TYPE_CHECKING:
    from torchtune.modules import TransformerDecoder

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: torch.dtype) -> str:
    """The `torch_dtype` string a HF config.json records for `dtype` (float32 for anything else)."""
    return _DTYPE_NAMES.get(dtype, "float32")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise RecipeError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def check_keep_layers(keep: Sequence[int], num_layers: int) -> None:
    bad = [i for i in keep if not 0 <= i < num_layers]
    if bad or len(set(keep)) != len(keep) or not keep:
        raise RecipeError(f"keep_layers {list(keep)}: need distinct layer indices in [0, {num_layers})")


def prune_layers(sd: dict[str, torch.Tensor], keep: Sequence[int], num_layers: int) -> dict[str, torch.Tensor]:
    """Keep only layers `keep` (in order), renumbered 0..len(keep)-1: the student init of pruning-then-KD."""
    check_keep_layers(keep, num_layers)
    new_index = {old: new for new, old in enumerate(keep)}
    out = {}
    for k, v in sd.items():
        if k.startswith("layers."):
            _, idx, rest = k.split(".", 2)
            if int(idx) in new_index:
                out[f"layers.{new_index[int(idx)]}.{rest}"] = v
        else:
            out[k] = v
    return out


def keep_every(num_layers: int, every: int) -> list[int]:
    """Layer indices 0, every, 2*every, ... (the last layer is kept too, it shapes the output distribution)."""
    keep = list(range(0, num_layers, every))
    if keep[-1] != num_layers - 1:
        keep.append(num_layers - 1)
    return keep


def load_model(
    ckpt_dir: str | Path,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    lora: LoRASettings | None = None,
    keep_layers: Sequence[int] | None = None,
    max_seq_len: int | None = None,
) -> tuple[TransformerDecoder, ModelArgs]:
    """Build the decoder for a HF folder and load its weights; LoRA params are freshly initialised."""
    args = read_model_args(ckpt_dir)
    quantized = args.hf_config.get("quantization_config")
    if quantized:  # was 'weights do not match config.json (missing ..., unexpected ..._weight_qdata)', 15 s in
        method = quantized.get("quant_method", "a quantization") if isinstance(quantized, dict) else "a quantization"
        raise RecipeError(f"{ckpt_dir} is already quantized ({method}: quantization_config in config.json): train or "
                          "quantize from the float model it was made from (e.g. a run's model/)")
    check_weight_shapes(ckpt_dir, args)  # from the headers, before GBs are read and the model is built
    if keep_layers is not None:
        check_keep_layers(keep_layers, args.num_layers)
    model_args = args.with_layers(keep_layers) if keep_layers is not None else args
    torch_dtype = resolve_dtype(dtype)
    with _default_dtype(torch_dtype), torch.device(device):
        model = build_model(model_args, lora=lora, max_seq_len=max_seq_len)
    targets = model.state_dict()
    # A model built on a GPU reads its safetensors straight into its tensors (stream_load: several times the speed
    # of a memory map copied tensor by tensor); on the host, and for tensors of other kinds (QLoRA's NF4 base),
    # the memory map and load_state_dict.
    stream = all(type(t) is torch.Tensor and t.is_cuda and t.is_contiguous() for t in targets.values())
    stored = stored_tensors(ckpt_dir) if stream else None
    sd = hf_to_tune_names(stored if stored is not None else load_hf_state_dict(ckpt_dir), tied=args.tie_word_embeddings)
    if keep_layers is not None:
        sd = prune_layers(sd, keep_layers, args.num_layers)
    if stored is not None:  # the keys are checked before GBs are read
        missing, unexpected = [k for k in targets if k not in sd], [k for k in sd if k not in targets]
    else:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not _is_adapter_key(k)]
    if missing or unexpected:
        raise RecipeError(f"{ckpt_dir}: weights do not match config.json (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    if stored is not None:
        read_into({k: targets[k] for k in sd}, sd)
    import_torchtune()
    from torchtune.modules.peft import DoRALinear

    for m in model.modules():
        if isinstance(m, DoRALinear):
            m.initialize_dora_magnitude()
    return model, model_args


def _is_adapter_key(key: str) -> bool:
    return ".lora_a." in key or ".lora_b." in key or key.endswith(".magnitude")


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's LoRA/DoRA linears by module name."""
    import_torchtune()
    from torchtune.modules.peft import DoRALinear, LoRALinear

    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))}


def lora_rank_alpha(model: nn.Module) -> tuple[int, float] | None:
    """(rank, alpha) of the model's LoRA/DoRA layers, or None without adapters."""
    loras = lora_modules(model)
    if not loras:
        return None
    first = next(iter(loras.values()))
    rank = first.lora_a.out_features  # DoRALinear keeps only `scaling` = alpha / rank
    return rank, float(getattr(first, "alpha", None) or first.scaling * rank)


def merge_lora_state_dict(sd: dict[str, torch.Tensor], rank: int, alpha: float,
                          as_trained: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """A tune-named state dict with its LoRA/DoRA adapter tensors merged into the base weights (and removed), in
    place (`merged_weight`, one module at a time). Modules named in `as_trained` merge as QAT trained them."""
    for key in [k for k in sd if k.endswith(".lora_a.weight")]:
        module = key.removesuffix(".lora_a.weight")
        sd[f"{module}.weight"] = merged_weight(module, sd, sd[f"{module}.weight"], rank, alpha, module in as_trained)
        for k in _adapter_parts(module):
            sd.pop(k, None)
    return sd


def _adapter_parts(module: str) -> tuple[str, str, str]:
    return f"{module}.lora_a.weight", f"{module}.lora_b.weight", f"{module}.magnitude"


def merged_weight(module: str, sd: Mapping[str, torch.Tensor], base: torch.Tensor, rank: int, alpha: float,
                  as_trained: bool = False) -> torch.Tensor:
    """`module`'s weight with its adapter (`sd`'s tensors, on any device) merged into `base`, a new tensor of
    base's dtype.

    Merged in fp32 and rounded to the weights' dtype once: torchtune's merge in bf16 rounds `scale * B @ A` to bf16
    before adding it, which moved 0.3% of a 1B model's bf16 weights by a step (up to 255 steps where base and update
    cancel) away from PEFT's merge of the same adapter. `as_trained` (QAT + LoRA: training fake-quantizes the merge
    computed in the weights' dtype, quantization/qat.py): merged that way, so quantizing `model/` gives what was
    trained."""
    import_torchtune()
    from torchtune.modules.peft import get_merged_lora_ckpt

    one = {k: sd[k] if as_trained else sd[k].float() for k in _adapter_parts(module) if k in sd}
    # a copy: torchtune adds the update into the weight in place, and `base` may be the live model's own
    one[f"{module}.weight"] = base.clone() if as_trained else base.to(torch.float32, copy=True)
    return get_merged_lora_ckpt(one, rank=rank, alpha=alpha)[f"{module}.weight"].to(base.dtype)


def _is_nf4(v: torch.Tensor) -> bool:
    return hasattr(v, "get_original_weight")  # NF4 base weight (QLoRA)


def _is_fp8(v: torch.Tensor) -> bool:
    return hasattr(v, "qdata") and hasattr(v, "dequantize")  # fp8 base weight (torchao Float8Tensor)


def _plain(v: torch.Tensor) -> torch.Tensor:
    """A frozen base weight as a plain tensor: NF4 (QLoRA) and torchao fp8 bases dequantized, others as they are."""
    if _is_nf4(v):
        return v.get_original_weight()
    if _is_fp8(v):
        return v.dequantize()
    return v


def _plain_made(v: Deferred) -> torch.Tensor:
    return _plain(v.make())


def lazily_merged_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor | Deferred] | None = None
) -> dict[str, torch.Tensor | Deferred]:
    """`merged_state_dict`'s weights without a copy of the model: each merged or dequantized weight is a `Deferred`
    made on its device when it is written, every other tensor is the state dict's own (read, never changed). What
    `save_model` streams from a model on its GPU (stream_save: no host copy of the whole model).

    `state_dict`'s values may be Deferred themselves (an FSDP model's shards, each gathered when its turn comes:
    `Runtime.gathered_state_dict`); a merged weight then gathers its adapter's parts and its base, in that order."""
    sd = dict(state_dict if state_dict is not None else model.state_dict())
    ra = lora_rank_alpha(model)
    merged = {k.removesuffix(".lora_a.weight") for k in sd if k.endswith(".lora_a.weight")} if ra else set()
    qat = {n for n, m in lora_modules(model).items() if getattr(m, "weight_fake_quantizer", None) is not None}
    adapters = {k for m in merged for k in _adapter_parts(m)}

    def merge(module: str, base: torch.Tensor | Deferred) -> torch.Tensor:
        parts = {k: made(sd[k]) for k in _adapter_parts(module) if k in sd}
        base = made(base)
        try:  # on the weights' device: the base dequantized (NF4, fp8) and a few fp32 copies of one weight (an 8B
            # model's largest: ~0.7 GB)
            return merged_weight(module, parts, _plain(base), *ra, as_trained=module in qat)
        except torch.OutOfMemoryError:  # a GPU full at checkpoint time: this module on the host, as before streaming
            host = {k: v.cpu() for k, v in parts.items()}
            return merged_weight(module, host, _plain(base.cpu()), *ra, as_trained=module in qat)

    out: dict[str, torch.Tensor | Deferred] = {}
    for k, v in sd.items():
        module = k.removesuffix(".weight")
        if k in adapters:
            continue
        if module in merged and ra is not None:
            out[k] = Deferred(v.shape, v.dtype, partial(merge, module, v))
        elif isinstance(v, Deferred):  # gathered when written, then dequantized if it is a quantized base
            out[k] = Deferred(v.shape, v.dtype, partial(_plain_made, v))
        elif _is_nf4(v) or _is_fp8(v):  # a quantized weight without an adapter: dequantized when written
            out[k] = Deferred(v.shape, v.dtype, partial(_plain, v))
        else:
            out[k] = v.detach()
    return out


def merged_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Plain (tune-named) weights with any LoRA/DoRA adapters merged and NF4/fp8 bases dequantized: new tensors,
    on the state dict's devices (the live model is never touched).

    `state_dict`: a full state dict gathered elsewhere (e.g. from FSDP shards); default `model.state_dict()`.
    """
    sd = {k: v.make() if isinstance(v, Deferred) else v.clone()
          for k, v in lazily_merged_state_dict(model, state_dict).items()}
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return sd


def save_model(
    model: nn.Module,
    args: ModelArgs,
    out_dir: str | Path | None,
    tokenizer_dir: str | Path | None,
    dtype: str | torch.dtype | None = None,
    state_dict: Mapping[str, torch.Tensor | Deferred] | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path | None:
    """Write a HF folder (adapters merged) that transformers, lm-eval and llama.cpp converters load. Without
    `state_dict`, the model's own weights are streamed from its device (`lazily_merged_state_dict`).
    `out_dir=None` writes nothing but makes every Deferred in the writer's order: what the other ranks of an FSDP
    model run while rank 0 writes, so that each joins the gathers rank 0's tensors need."""
    sd = dict(state_dict) if state_dict is not None else lazily_merged_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(resolve_dtype(dtype)) for k, v in sd.items()}
    if args.tie_word_embeddings:
        sd.pop("output.weight", None)
    out_dtype = next(iter(sd.values())).dtype
    config = args.to_hf_config(dtype=dtype_name(out_dtype))
    return write_hf_folder(out_dir, tune_to_hf_names(sd), config, tokenizer_dir, extra_files=extra_files)
