"""Quantization-aware training with torchao 0.18's `QATConfig` (prepare -> train -> convert).

Plain linears become torchao `FakeQuantizedLinear`s. LoRA linears (torchtune `LoRALinear`, base frozen) keep
their class, parameters and state-dict keys, and fake-quantize their *effective* weight `W + s * B @ A`:
convert merges the adapters and quantizes exactly that merged weight, so what trains is what ships (fake-
quantizing only the frozen base, as torchtune did, trains against `q(W) + s*B@A`, which no deployed int4
kernel computes). The cost is one transient full-size weight (and its gradient) per LoRA layer in each step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RecipeError
from ..schema import Choice, Range
from ..settings import setting
from .schemes import (
    BF16_ONLY,
    QAT_SCHEMES,
    _is_lora,
    base_config,
    check_device,
    check_group_size,
    cpu_only,
    linear_filter,
    model_device_dtype,
    scheme_info,
)
from .swap import swapped_class

QAT_METADATA_FILE = "quantization.json"
KD_QAT_KEYS = ("scheme", "group_size", "include_output", "convert")  # the keys of `qat:` a KD run reads
_FQ_ATTRS = ("activation_fake_quantizer", "weight_fake_quantizer")

@dataclass(frozen=True, kw_only=True)
class QATSettings:
    """The `qat:` section (null: no QAT): how the model is fake-quantized while it trains, and what converts it at
    the end. KD reads `KD_QAT_KEYS` (all but `fake_quant_after_n_steps`)."""

    scheme: str = setting("8da4w", Choice(*QAT_SCHEMES), "the quantization trained for (components/quantization)")
    group_size: int = setting(32, Range(int, ge=1), "int4 weight group size along the input dim")
    include_output: bool = setting(False, bool, "also the (untied) output projection")
    fake_quant_after_n_steps: int | None = setting(None, Range(int, ge=0, optional=True),
                                                   "fake quantization off for optimizer steps 1..N (null: from 1)")
    convert: bool = setting(True, bool, "write output_dir/quantized (a torchao HF folder) at the end")

    def metadata_files(self) -> dict[str, str]:
        """The final folder's quantization.json: what `convert_qat` (and `recipe run quantize`) need."""
        meta = qat_metadata(self.scheme, self.group_size, self.include_output)
        return {QAT_METADATA_FILE: json.dumps(meta, indent=2) + "\n"}


def check_qat_convert_config(qat: QATSettings | None, device: str, dtype: str) -> None:
    """At config load (`recipe validate` says it too): a run that ends by converting to a GPU-only scheme
    (`qat.convert: true`) on a CPU, or to a bf16-only scheme in another run dtype, fails now, not after training."""
    if qat is None or not qat.convert:
        return
    if cpu_only(device) is not None:
        try:
            check_device(qat.scheme, torch.device("cpu"))
        except RecipeError as e:
            raise RecipeError(f"qat.convert=true converts at the end of training: {e} (or qat.convert: false, then "
                              "`recipe run quantize` on a GPU)") from None
    if qat.scheme in BF16_ONLY and dtype != "bf16":
        raise RecipeError(f"qat.convert=true converts at the end of training to {qat.scheme}, which needs dtype: bf16 "
                          f"({BF16_ONLY[qat.scheme]}), but dtype is {dtype}; set dtype: bf16 (or qat.convert: false, "
                          "then `recipe run quantize`)")


def _check_qat_scheme(scheme: str) -> None:
    scheme_info(scheme, key="qat.scheme")
    if scheme not in QAT_SCHEMES:
        raise RecipeError(f"qat.scheme: {scheme!r} has no QAT support; choose one of {list(QAT_SCHEMES)}")


def prepare_qat(model: nn.Module, scheme: str = "8da4w", group_size: int = 32,
                include_output: bool = False) -> nn.Module:
    """Insert fake quantizers (in place) into the transformer blocks' linears (and the untied output
    projection when `include_output`); embeddings stay full precision. Returns `model`."""
    _check_qat_scheme(scheme)
    check_group_size(model, scheme, group_size, include_output)
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    base = base_config(scheme, group_size, for_qat_prepare=True)
    # LoRA layers first (their adapters are nn.Linear too and must not be fake-quantized themselves).
    lora_fqns = []
    for fqn, module in list(model.named_modules()):
        if _is_lora(module) and (fqn.startswith("layers.") or (include_output and fqn == "output")):
            _prepare_lora(module, fqn, base)
            lora_fqns.append(fqn)
    keep = linear_filter(include_output)
    under_lora = tuple(f + "." for f in lora_fqns)
    quantize_(model, QATConfig(base, step="prepare"),
              filter_fn=lambda m, fqn: keep(m, fqn) and not fqn.startswith(under_lora))
    use_traceable_activation_quantizers(model)
    return model


def _per_token_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Per-token asymmetric fake quantization through torchao's own primitives (`choose_qparams_affine`,
    `_fake_quantize_affine`), with the arguments torchao's `IntxFakeQuantizer` passes them, minus two things that
    cost a compiled step its speed: torchao's path calls torch.ao's `_per_token_quant_qparam_dim_check` (a shape
    assert that torch 2.11's Dynamo cannot trace: a graph break inside every linear, which made the host, not the
    GPU, the bottleneck of a QAT step) and keeps the scales on the module (a side effect of every call)."""
    from torchao.quantization.quant_primitives import (
        _DTYPE_TO_QVALUE_BOUNDS,
        MappingType,
        _fake_quantize_affine,
        choose_qparams_affine,
    )

    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[self.config.dtype]
    block = (1,) * (x.dim() - 1) + (x.shape[-1],)  # one scale and zero point per token
    scale, zero_point = choose_qparams_affine(
        x, MappingType.ASYMMETRIC, block, self.config.dtype, quant_min=qmin, quant_max=qmax, eps=self.config.eps,
        scale_dtype=self.config.scale_precision, zero_point_dtype=self.config.zero_point_precision)
    fq = _fake_quantize_affine(x, block, scale, zero_point, quant_dtype=torch.int32, quant_min=qmin, quant_max=qmax)
    return fq.to(x.dtype)


_PER_TOKEN_CLASSES: dict[type, type] = {}


def use_traceable_activation_quantizers(model: nn.Module) -> int:
    """Give every per-token activation fake quantizer (8da4w's int8 activations) `_per_token_forward`: the same
    numbers as torchao's, in one compiled graph per layer on every torch (on torch 2.11 torchao's own broke each
    linear's graph in two: a QAT step spent its time launching kernels, 1.4-1.6x a plain step and swinging from
    step to step). Returns how many were changed."""
    from torchao.quantization.granularity import PerToken
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    n = 0
    for m in model.modules():
        fq = getattr(m, "activation_fake_quantizer", None)
        if (isinstance(fq, IntxFakeQuantizer) and type(fq) not in _PER_TOKEN_CLASSES.values()
                and isinstance(fq.config.granularity, PerToken) and fq.config.is_dynamic and not fq.config.range_learning
                and not fq.config.is_symmetric):
            fq.__class__ = swapped_class(_PER_TOKEN_CLASSES, type(fq), "Traceable",
                                         {"_per_token_forward": _per_token_forward}, __name__)
            n += 1
    return n


def _fake_quantizers(base, in_features: int, out_features: int) -> tuple[nn.Module | None, nn.Module | None]:
    """The fake quantizers torchao's QATConfig would put on a linear of this shape (built on the meta device
    through the public API, so the mapping base config -> fake-quant config stays torchao's)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    probe = nn.Sequential(nn.Linear(in_features, out_features, bias=False, device="meta"))
    quantize_(probe, QATConfig(base, step="prepare"))
    return probe[0].activation_fake_quantizer, probe[0].weight_fake_quantizer


def _qat_lora_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LoRA forward on the fake-quantized merged weight (see module docstring)."""
    w = self.weight
    if not getattr(self, "disabled", False):
        w = _merged_weight(self, w, self.lora_a.weight, self.lora_b.weight)
    if self.activation_fake_quantizer is not None:
        x = self.activation_fake_quantizer(x)
    if self.weight_fake_quantizer is not None:
        w = self.weight_fake_quantizer(w)
    return F.linear(x, w, getattr(self, "bias", None))


def _lora_scale(module: nn.Module) -> float:
    return module.alpha / module.rank  # torchtune LoRALinear scales the adapter output by alpha / rank


def _merged_weight(module: nn.Module, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`w + ((alpha / rank) * B) @ A` in w's dtype: the weight QAT trains against, and the one `model/` holds for
    a QAT module (models/loader.py merges these in the weights' dtype, in this order, where plain LoRA merges in
    fp32 and rounds once). Merging in fp32 here costs 27-42% more in the merge's forward and backward: 84-86 vs
    61-66 ms per micro-batch over a 1B model's linears at rank 64 on an H200 (bench/qat_lora_merge_cost.py)."""
    return w + (_lora_scale(module) * b) @ a


_QAT_LORA_CLASSES: dict[type, type] = {}


def _prepare_lora(module: nn.Module, fqn: str, base) -> None:
    if hasattr(module, "magnitude"):
        raise RecipeError(f"{fqn}: QAT does not support DoRA adapters; set lora.use_dora: false")
    if (getattr(module, "_quantize_base", False) or getattr(module, "fp8_base_pending", False)
            or type(module.weight.data) is not torch.Tensor):
        raise RecipeError(f"{fqn}: QAT needs a plain base weight, not a quantized one (nf4 or fp8); "
                          "set lora.quantize_base: false")
    if isinstance(module.dropout, nn.Dropout) and module.dropout.p > 0:
        raise RecipeError(f"{fqn}: QAT with LoRA fake-quantizes the merged weight, which has no place for "
                          f"adapter dropout; set lora.dropout: 0.0 (got {module.dropout.p})")
    out_features, in_features = module.weight.shape
    act_fq, weight_fq = _fake_quantizers(base, in_features, out_features)
    module.__class__ = swapped_class(_QAT_LORA_CLASSES, type(module), "FakeQuantized", {"forward": _qat_lora_forward},
                                     __name__)
    module.activation_fake_quantizer = act_fq
    module.weight_fake_quantizer = weight_fq


def _fake_quantizer_modules(model: nn.Module) -> list[nn.Module]:
    out = []
    for m in model.modules():
        for attr in _FQ_ATTRS:
            fq = getattr(m, attr, None)
            if fq is not None and hasattr(fq, "enabled"):
                out.append(fq)
    return out


def set_fake_quant_enabled(model: nn.Module, enabled: bool) -> int:
    """Turn every fake quantizer on or off; returns how many were set (0 means the model is not prepared).

    A local flag flip with no communication or randomness: every rank calling it with the same `enabled` at
    the same step stays in lockstep under torchrun/FSDP2 (the flag lives on the module, not on the sharded
    parameters). Use `fake_quant_enabled_at(step, after_n_steps)` to decide the flag for a step.
    """
    quantizers = _fake_quantizer_modules(model)
    for fq in quantizers:
        fq.enabled = bool(enabled)
    return len(quantizers)


def compile_fake_quantizers(model: nn.Module) -> int:
    """torch.compile each fake quantizer (GPU): eager torchao fake quantization is ~15 small kernels per tensor
    (min/max, scale, round, clamp, ...) and made a QAT step 4.2x slower; compiled they fuse into one or two.
    The `enabled` flag is guarded, so switching it recompiles once. Returns how many were compiled."""
    quantizers = _fake_quantizer_modules(model)
    for fq in quantizers:
        fq.compile()
    return len(quantizers)


def fake_quant_enabled_at(step: int, after_n_steps: int | None) -> bool:
    """The `fake_quant_after_n_steps` schedule: off for optimizer steps 0..N-1, on from step N (None/0: always)."""
    return after_n_steps is None or step >= after_n_steps


def _merge_lora_into_linear(module: nn.Module) -> nn.Linear:
    w = module.weight.detach()
    if not getattr(module, "disabled", False):
        w = _merged_weight(module, w, module.lora_a.weight.detach(), module.lora_b.weight.detach())
    bias = getattr(module, "bias", None)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias.detach())
    lin.weight.requires_grad_(False)
    return lin


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def convert_qat(model: nn.Module, scheme: str = "8da4w", group_size: int = 32) -> nn.Module:
    """Replace fake quantizers by real torchao quantized weights (in place; LoRA adapters are merged first).

    The result equals PTQ (`quantize_model`) of the trained, merged weights: same configs, same layers.
    """
    _check_qat_scheme(scheme)
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    device, dtype = model_device_dtype(model)
    check_device(scheme, device, dtype)
    base = base_config(scheme, group_size)
    merged = []
    for fqn, module in list(model.named_modules()):
        if type(module) in _QAT_LORA_CLASSES.values():
            _set_submodule(model, fqn, _merge_lora_into_linear(module))
            merged.append(fqn)
    fq_linears = {fqn for fqn, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}
    if not merged and not fq_linears:
        raise RecipeError("convert_qat: the model has no fake-quantized layers; call prepare_qat first "
                          "(or use quantize_model for post-training quantization)")
    with torch.no_grad():
        if fq_linears:
            quantize_(model, QATConfig(base, step="convert"), filter_fn=lambda m, fqn: fqn in fq_linears)
        if merged:
            quantize_(model, base, filter_fn=lambda m, fqn: fqn in merged)
    return model


def load_for_convert(model_dir: str | Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[nn.Module, object]:
    """A QAT run's saved `model/` folder (merged float weights + quantization.json) as a plain, fake-quantized
    model ready for `convert_qat`: what a run sharded over many processes converts on rank 0, since its live
    model holds only each rank's shards. Returns `(model, ModelArgs)`."""
    from ..models import load_model

    meta = read_qat_metadata(model_dir)
    model, args = load_model(model_dir, dtype=dtype, device=device)
    prepare_qat(model, meta["scheme"], meta["group_size"] or 32, bool(meta.get("include_output", False)))
    return model, args


def finish_qat(model: nn.Module, args: object, qat: QATSettings, final: str | Path, source_dir: str | Path,
               output_dir: str | Path, rt: object) -> None:
    """The end of a QAT run, `recipe run qat` and KD-QAT alike: with `qat.convert` the fake quantizers become real
    quantized weights in `output_dir/quantized`; without, the command that converts the saved `final` folder later
    is printed. `rt`: the run's Runtime (on several processes the live model holds shards: `final` is converted)."""
    if qat.convert:
        from .export_hf import export_hf_torchao

        if rt.world_size > 1:
            model, args = load_for_convert(final, rt.device, rt.dtype)
        set_fake_quant_enabled(model, True)
        convert_qat(model, qat.scheme, qat.group_size)
        out = export_hf_torchao(model, args, source_dir, f"{output_dir}/quantized", qat.scheme, qat.group_size,
                                qat.include_output)
        print(f"quantized ({qat.scheme}): {out}")
        return
    gpu = " device=cuda" if qat.scheme == "int4_weight_only" else ""  # int4's kernel runs on a GPU only
    print(f"qat.convert=false: convert it with `recipe run quantize --config quantize/smollm2_8da4w "
          f"model.checkpoint_dir={final} output_dir={output_dir}/quantize scheme={qat.scheme} "
          f"group_size={qat.group_size}{gpu}`")


def qat_metadata(scheme: str, group_size: int, include_output: bool = False) -> dict:
    """What `convert_qat` needs to turn a QAT-trained HF folder into the quantized model (quantization.json)."""
    _check_qat_scheme(scheme)
    import torchao
    from torchao.core.config import config_to_dict

    return {
        "method": "qat",
        "scheme": scheme,
        "group_size": group_size if scheme_info(scheme).grouped else None,
        "include_output": include_output,
        "modules": "transformer block linears (q/k/v/o, gate/up/down)" + (" + lm_head" if include_output else ""),
        "torchao_version": torchao.__version__,
        "torchao_config": config_to_dict(base_config(scheme, group_size)),
    }


def write_qat_metadata(out_dir: str | Path, scheme: str, group_size: int, include_output: bool = False) -> Path:
    """Write `quantization.json` into `out_dir` (beside the HF weights)."""
    path = Path(out_dir) / QAT_METADATA_FILE
    path.write_text(json.dumps(qat_metadata(scheme, group_size, include_output), indent=2) + "\n")
    return path


def read_qat_metadata(model_dir: str | Path) -> dict:
    """Read and check `quantization.json`; a RecipeError names the file when it is missing or malformed."""
    path = Path(model_dir) / QAT_METADATA_FILE
    if not path.is_file():
        raise RecipeError(f"{path}: not found; this folder was not written by a QAT run "
                          "(pass scheme/group_size explicitly)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    for key in ("scheme", "group_size"):
        if key not in meta:
            raise RecipeError(f"{path}: missing key {key!r}")
    _check_qat_scheme(meta["scheme"])
    return meta


def prepare_qat_training(model: nn.Module, qat: QATSettings, device: torch.device,
                         compiled_model: bool = False) -> dict[str, str]:
    """Put `qat`'s fake quantizers into `model`, so it learns through the quantization it will be converted with.
    On a GPU they are compiled (eager fake quantization made a step 4.2x slower): each on its own, unless
    `compiled_model` (the run's `compile: true` compiles every layer, and with it the quantizers inside).
    Returns the extra files of its final folder (quantization.json)."""
    prepare_qat(model, qat.scheme, qat.group_size, qat.include_output)
    if device.type == "cuda" and not compiled_model:
        compile_fake_quantizers(model)
    return qat.metadata_files()


def prepare_qat_student(model: nn.Module, qat: QATSettings | None, device: torch.device) -> dict[str, str] | None:
    """KD-QAT: `prepare_qat_training` for a KD student's `qat:` section; None (nothing done) without one."""
    return None if qat is None else prepare_qat_training(model, qat, device)
