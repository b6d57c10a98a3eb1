"""A cheaper frozen KD teacher: its transformer linears quantized with torchao (the output head stays as is).

`fp8` is torchao's float8 dynamic-activation / float8 weight with per-row scales (sm89+ GPUs): the teacher's
matmuls run on the fp8 tensor cores. With a drift bound (`teacher.max_drift`) the fp8 error is measured first
(fp8_drift.py) and the projections that would push it past the bound stay in the run dtype. `int8_weight_only`
halves the teacher's weight memory (CPU and GPU). `auto` is fp8 where fp8 can run (a GPU with fp8 matmuls, an
unsharded teacher) and the run dtype elsewhere, so one shipped config runs on an H100 and on an A100 alike. The head
is left in the run dtype because the KD target is read from its logits (an fp8 head alone drifts as much as every
decoder linear together: docs/benchmarks.md, session 41, which also reports the KL on real weights).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import RecipeError
from ..schema import Choice, Range
from ..settings import setting
from .schemes import base_config, cpu_only, has_fp8_matmuls, linear_filter

# config value -> scheme name in llm_recipe.components.quantization.schemes
TEACHER_QUANT = {"fp8": "float8_dynamic", "int8_weight_only": "int8_weight_only"}
AUTO = "auto"  # fp8 where it can run, else the run dtype (resolve_teacher_quant)
DEFAULT_MAX_DRIFT = 0.01  # nats/token: issue 19's bound for the fp8 teacher


def quantize_setting():
    """The `teacher.quantize` key (kd and kd_logits each have a teacher section; one definition)."""
    return setting(None, Choice(AUTO, *TEACHER_QUANT, optional=True),
                   "null (the run dtype) | fp8 (sm89+ GPU: fp8 matmuls) | int8_weight_only | auto (fp8 where it can "
                   "run: a GPU with fp8 matmuls, dtype bf16 and an unsharded teacher; else null; the log says which)")


def max_drift_setting():
    """The `teacher.max_drift` key (kd and kd_logits each have a teacher section; one definition)."""
    return setting(DEFAULT_MAX_DRIFT, Range(float, gt=0, optional=True),
                   "fp8 only: the most KL(teacher || fp8 teacher) per token accepted, measured at setup on ~32k "
                   "tokens; above it the down projections, the MLP, then the whole teacher stay in the run dtype "
                   "(null: no check)")


def check_teacher_quant_config(mode: str | None, device: str, dtype: str) -> None:
    """At config load (`recipe validate` says it too): an fp8 teacher on a CPU run, or in a run dtype other than
    bf16, before minutes of setup."""
    where = cpu_only(device) if mode == "fp8" else None
    if where is not None:
        raise RecipeError(_NEEDS_FP8_GPU.format(where=where))
    if mode == "fp8" and dtype != "bf16":
        raise RecipeError(f"teacher.quantize=fp8 needs dtype: bf16 (torchao's fp8 with a scale per row takes bf16 "
                          f"weights), but dtype is {dtype}; set dtype: bf16, or teacher.quantize: auto or null")


def check_teacher_quant_device(mode: str | None, device: torch.device) -> None:
    """Before the teacher's weights load: an explicit fp8 teacher on a device without fp8 matmuls is refused now,
    not after seconds to minutes of loading."""
    if mode == "fp8" and not has_fp8_matmuls(device):
        raise RecipeError(_NEEDS_FP8_GPU.format(where=_no_fp8_here(device)))


def resolve_teacher_quant(mode: str | None, device: torch.device, dtype: torch.dtype, *, sharded: bool = False,
                          say: bool = True) -> str | None:
    """`teacher.quantize` as this run applies it: `auto` becomes fp8 on a GPU with fp8 matmuls when the run dtype is
    bf16 and the teacher is not sharded (FSDP2 does not shard fp8 weights), else None (the run dtype), said in one
    line when `say`; an explicit fp8 this device cannot run is a RecipeError; any other value is returned as it
    is."""
    if mode != AUTO:
        check_teacher_quant_device(mode, device)
        return mode
    if not has_fp8_matmuls(device):
        chosen, why = None, f"{_no_fp8_here(device)} (fp8 matmuls need compute capability >= 8.9)"
    elif dtype != torch.bfloat16:
        chosen, why = None, f"the run dtype is {str(dtype).removeprefix('torch.')} (fp8 with a scale per row needs bf16)"
    elif sharded:
        chosen, why = None, "the teacher is sharded (teacher.placement), and fp8 needs one full copy per GPU"
    else:
        chosen, why = "fp8", f"{torch.cuda.get_device_name(device)} has fp8 matmuls"
    if say:
        what = "fp8" if chosen else "null, the teacher runs in the run dtype"
        print(f"teacher.quantize=auto: {what}: {why}", flush=True)
    return chosen


def _no_fp8_here(device: torch.device) -> str:
    # where fp8 matmuls are missing, for the one-line messages
    if device.type != "cuda":
        return f"the teacher is on the {device.type.upper()}"
    major, minor = torch.cuda.get_device_capability(device)
    return f"this GPU ({torch.cuda.get_device_name(device)}) is sm{major}{minor}"


_NEEDS_FP8_GPU = ("teacher.quantize=fp8 needs a CUDA GPU with compute capability >= 8.9 (fp8 matmuls), but "
                  "{where}; use teacher.quantize: int8_weight_only or null")


def quantize_teacher(teacher: nn.Module, mode: str | None, device: torch.device, *, max_drift: float | None = None,
                     model_dir: str | None = None, max_seq_len: int = 1024, rt=None) -> nn.Module:
    """Quantize the (already placed, frozen) teacher in place per `teacher.quantize`; None leaves it alone.

    fp8 with `max_drift`: the drift of each choice of fp8 projections is emulated on calibration text tokenized
    from `model_dir` and packed into rows of the run's `max_seq_len` (components/quantization/fp8_drift.py), and
    the fastest one under the bound is applied, or none; the decision is printed. With a Runtime `rt` of several
    processes, rank 0's decision is every rank's."""
    if mode is None:
        return teacher
    if mode not in TEACHER_QUANT:
        raise RecipeError(f"teacher.quantize: {mode!r} is not one of null, {', '.join(TEACHER_QUANT)}")
    scheme = TEACHER_QUANT[mode]
    from ..models.builder import is_sharded

    if is_sharded(teacher):
        raise RecipeError(f"teacher.quantize={mode} needs an unsharded teacher (one full copy per GPU); "
                          "set teacher.placement: replicate, or teacher.quantize: null to shard it")
    check_teacher_quant_device(mode, device)  # int8_weight_only runs anywhere
    from torchao.quantization import quantize_

    use = linear_filter(include_output=False)
    if mode == "fp8":
        _check_fp8_shapes(teacher)
        if max_drift is not None:
            keep = _keep_for_drift(teacher, device, max_drift, model_dir, max_seq_len, rt)
            if keep is None:
                return teacher
            from .fp8_drift import fp8_filter

            use = fp8_filter(keep)
        elif rt is None or rt.is_main:
            print("teacher.quantize=fp8 with teacher.max_drift=null: every linear in fp8, its drift not measured "
                  "(SmolLM2-135M: 0.027 nats/token; teacher.max_drift: 0.01 measures it at setup and keeps in bf16 "
                  "what would pass the bound)", flush=True)
    quantize_(teacher, base_config(scheme), filter_fn=use)
    return teacher


def _keep_for_drift(teacher: nn.Module, device: torch.device, max_drift: float, model_dir: str | None,
                    max_seq_len: int, rt) -> tuple[str, ...] | None:
    # The projections that stay in the run dtype (None: all of them): an earlier run's decision for this teacher,
    # dtype, bound and row length, else measured now and kept. Rank 0's is broadcast so every rank quantizes the same layers.
    from .fp8_drift import (
        calibration_batches,
        choose_fp8_projections,
        decision_file,
        load_decision,
        save_decision,
    )

    if model_dir is None:
        raise ValueError("quantize_teacher: max_drift needs model_dir (its tokenizer writes the calibration text)")
    dtype = next(teacher.parameters()).dtype
    path = decision_file(model_dir, dtype, max_drift, max_seq_len)
    choice = load_decision(path)
    if choice is None:
        choice = choose_fp8_projections(teacher, calibration_batches(model_dir, device, max_seq_len), max_drift)
        if rt is None or rt.is_main:
            save_decision(path, choice)
    if rt is not None:
        choice = rt.broadcast_object(choice)
    if rt is None or rt.is_main:
        print(choice.message(), flush=True)
    return choice.keep


def _check_fp8_shapes(model: nn.Module) -> None:
    # torch._scaled_mm needs both matrix dims divisible by 16; name the first layer that is not.
    keep = linear_filter(include_output=False)
    for fqn, m in model.named_modules():
        if keep(m, fqn) and (m.in_features % 16 or m.out_features % 16):
            raise RecipeError(f"teacher.quantize=fp8: {fqn} is {m.out_features}x{m.in_features}; fp8 matmuls need "
                              "both dims divisible by 16 (use int8_weight_only or null)")
