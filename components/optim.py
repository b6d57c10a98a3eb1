"""Optimizer and LR scheduler builders.

Optimizers come from a config node `{_component_: torch.optim.AdamW | torchao.optim.AdamW8bit | AdamW4bit |
AdamWFp8 | CPUOffloadOptimizer, ...kwargs}`. Their state (torchao's low-bit state tensor subclasses included)
is saved and restored by `llm_recipe.components.checkpoint.state`.
"""

from __future__ import annotations

import importlib
import logging
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.optim.adam import adam

from .errors import RecipeError

log = logging.getLogger(__name__)

# Optimizers this project documents and tests (bit-exact resume); other classes under torch.optim / torchao.optim
# are accepted too, as they follow the same Optimizer API.
SUPPORTED_OPTIMIZERS = (
    "torch.optim.AdamW",
    "torchao.optim.AdamW8bit",
    "torchao.optim.AdamW4bit",
    "torchao.optim.AdamWFp8",
    "torchao.optim.CPUOffloadOptimizer",
    "torchao.optim._AdamW",  # plain AdamW whose `bf16_stochastic_round: true` keeps small updates of bf16 weights
    "llm_recipe.components.optim.MasterWeightAdamW",  # fp32 master weights + moments, one fused update (GPU default)
)
_ALLOWED_PREFIXES = ("torch.optim.", "torchao.optim.", "llm_recipe.components.optim.")
SCHEDULERS = ("cosine", "linear", "constant")


def _resolve_optimizer_class(path: Any, key: str) -> type:
    # A tiny resolver rather than llm_recipe.components.config.instantiate: it restricts targets to optimizer namespaces,
    # so a typo or an arbitrary import path in a config fails with a message naming the key.
    if isinstance(path, type):
        return path
    if not isinstance(path, str) or not path.startswith(_ALLOWED_PREFIXES):
        raise RecipeError(f"{key}={path!r} is not an optimizer: use one of {', '.join(SUPPORTED_OPTIMIZERS)}")
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise RecipeError(
            f"{key}={path!r} does not exist: use one of {', '.join(SUPPORTED_OPTIMIZERS)}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise RecipeError(f"{key}={path!r} is not a torch.optim.Optimizer subclass")
    return cls


_LOW_BIT = ("AdamW8bit", "AdamW4bit", "AdamWFp8")


def _low_bit_fallback(target: str, kwargs: dict, world_size: int, is_main: bool) -> tuple[type, dict]:
    """torchao 0.18's low-bit AdamWs do not run on FSDP2 shards here (tried with torch 2.13, 2 processes):
    with bf16 weights their compiled step fails on `aten.view.dtype`, which the low-bit state subclasses do not
    implement (upstream: pytorch/ao PR #4216, open); with fp32 weights AdamW4bit fails a shape assertion and
    AdamWFp8 loses its `qmap`, and AdamW8bit's state precision depends on the shard size (pytorch/ao #4912).
    Train with torchao's full-precision `_AdamW` instead, keeping lr/betas/eps/weight decay and
    `bf16_stochastic_round` (which matters for pure-bf16 weights), and say so loudly."""
    from torchao.optim import _AdamW

    kept = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                      "bf16_stochastic_round")}
    if is_main:
        log.warning(
            "optimizer: %s does not run under FSDP2 (world_size=%d) with torchao 0.18 (pytorch/ao PR #4216, "
            "issue #4912): using torchao.optim._AdamW with full-precision moments instead (%s; dropped: %s). "
            "Optimizer memory per GPU is 2 x 4 bytes per sharded parameter instead of ~2 x %s.",
            target, world_size, ", ".join(f"{k}={v}" for k, v in kept.items()) or "defaults",
            ", ".join(sorted(set(kwargs) - set(kept))) or "nothing", "0.5 byte" if "4bit" in target else "1 byte")
    return _AdamW, kept


def build_optimizer(
    node: Mapping[str, Any], params: Iterable[Any], runtime: Any, key: str = "optimizer"
) -> torch.optim.Optimizer:
    """Build the optimizer a config node names, with device-aware defaults (fused AdamW on CUDA).

    `params`: parameters or param-group dicts; frozen parameters (requires_grad=False) are dropped.
    `runtime`: a `llm_recipe.components.runtime.Runtime` (only `.device` is read). `key` names the node in errors.
    """
    kwargs = {str(k): _plain(v) for k, v in dict(node).items()}
    target = kwargs.pop("_component_", None)
    if target is None:
        raise RecipeError(f"{key} needs a `_component_` (e.g. torch.optim.AdamW)")
    cls = _resolve_optimizer_class(target, f"{key}._component_")
    device = torch.device(getattr(runtime, "device", "cpu"))

    plist = list(params)
    if plist and isinstance(plist[0], dict):
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in plist]
        groups = [g for g in groups if g["params"]]
        plist = groups
    else:
        plist = [p for p in plist if p.requires_grad]
    if not plist:
        raise RecipeError(f"{key}: the model has no trainable parameters (all have requires_grad=False)")

    if cls.__name__ == "CPUOffloadOptimizer":
        if device.type != "cuda":
            raise RecipeError(
                f"{key}._component_=torchao.optim.CPUOffloadOptimizer needs a CUDA device (got {device.type}): "
                "use torch.optim.AdamW or a torchao low-bit AdamW on CPU"
            )
        if "optimizer_class" in kwargs:
            kwargs["optimizer_class"] = _resolve_optimizer_class(
                kwargs["optimizer_class"], f"{key}.optimizer_class"
            )
    elif cls.__name__ in _LOW_BIT and getattr(runtime, "world_size", 1) > 1:
        cls, kwargs = _low_bit_fallback(target, kwargs, runtime.world_size, getattr(runtime, "is_main", True))
    elif (
        cls is torch.optim.AdamW
        and device.type == "cuda"
        and "fused" not in kwargs
        and "foreach" not in kwargs
    ):
        kwargs["fused"] = True
    if "betas" in kwargs and isinstance(kwargs["betas"], list):
        kwargs["betas"] = tuple(kwargs["betas"])
    if cls.__name__ in _LOW_BIT:
        # torch's AOT autograd cache warns, once per run and into the progress bar, that torchao's low-bit state
        # subclasses lack `_stable_hash_for_caching`: advice for the subclass's authors, nothing a user can act on.
        warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching",
                                category=UserWarning)
    try:
        return cls(plist, **kwargs)
    except TypeError as e:
        raise RecipeError(f"{key}: bad arguments for {target}: {e}") from e
    except ValueError as e:
        raise RecipeError(f"{key}: {e}") from e


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW that updates fp32 master copies of bf16/fp16 parameters, then copies them back: small updates
    accumulate in the master instead of rounding away, as in mixed-precision training.

    Why our own: torch's fused AdamW on bf16 weights rounds every update to nearest (most vanish at lr 1e-5..1e-4),
    and torchao's `_AdamW(bf16_stochastic_round=True)` runs one compiled call per parameter (measured: 36% of a
    LoRA KD step on an H200, issue 19). Here every parameter goes through torch's fused multi-tensor AdamW kernel
    (`torch.optim.adam.adam`, fused on CUDA, foreach on CPU) and one `_foreach_copy_` back. State per parameter:
    `master` (fp32; absent for fp32 parameters, which are their own master), fp32 `exp_avg` and `exp_avg_sq`,
    `step`: 12 bytes per bf16 parameter, plus a transient fp32 copy of the gradients of one bucket.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool | None = None, bucket_numel: int = 1 << 28) -> None:
        if lr <= 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"bad AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.fused = fused
        self.bucket_numel = int(bucket_numel)

    def _state(self, p: torch.Tensor, fused: bool) -> dict:
        st = self.state[p]
        if not st:
            master = p.detach() if p.dtype == torch.float32 else p.detach().float()
            if p.dtype != torch.float32:
                st["master"] = master
            st["exp_avg"] = torch.zeros_like(master)
            st["exp_avg_sq"] = torch.zeros_like(master)
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu")
        return st

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            fused = self.fused if self.fused is not None else params[0].device.type == "cuda"
            bucket: list[torch.Tensor] = []
            size = 0
            for p in params:  # buckets bound the transient fp32 gradient copies
                bucket.append(p)
                size += p.numel()
                if size >= self.bucket_numel:
                    self._update(bucket, group, fused)
                    bucket, size = [], 0
            if bucket:
                self._update(bucket, group, fused)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict, fused: bool) -> None:
        states = [self._state(p, fused) for p in params]
        # AdamW is elementwise: under FSDP2 each rank updates its local shards, and the kernel gets plain tensors
        # (a list of DTensors costs sharding propagation on the host every step: 6 ms for 224 LoRA tensors on 2
        # processes of the dev VM, where the update itself takes 2). The state stays DTensor for checkpoints.
        masters = [_local(st.get("master", p)) for p, st in zip(params, states)]
        beta1, beta2 = group["betas"]
        adam(masters, [_local(p.grad).float() for p in params], [_local(st["exp_avg"]) for st in states],
             [_local(st["exp_avg_sq"]) for st in states], [], [st["step"] for st in states],
             foreach=None if fused else True,
             fused=fused or None, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        low = [(_local(p), _local(st["master"])) for p, st in zip(params, states) if "master" in st]
        if low:  # an FSDP2 shard and its master share one placement: copy the local parts
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like `Optimizer.load_state_dict`, which casts state to each parameter's dtype (bf16): the fp32 masters
        and moments are put back in fp32, and the step counters on the device the update reads them on, so a resumed
        run continues bit-exactly."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            fused = self.fused if self.fused is not None else p.device.type == "cuda"
            for key, value in saved.get(pid, {}).items():
                if isinstance(value, torch.Tensor):
                    # the step counter where `_state` keeps it: on the parameter's GPU for the fused kernel (a
                    # checkpoint read from safetensors has it on the host, which torch's loader moves only for
                    # param groups that say fused; ours are fused by the optimizer, not the group)
                    device = (p.device if fused else "cpu") if key == "step" else p.device
                    self.state[p][key] = value.to(device=device, dtype=torch.float32, copy=True)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def bf16_rounded_away_fraction(params: Iterable[torch.Tensor], lr: float, sample: int = 1 << 20) -> float:
    """Fraction of the bf16 elements of `params` that an update of size `lr` cannot change: w + lr and w - lr both
    round back to w. Pure-bf16 training silently drops those updates. Large tensors are sampled (`sample` each)."""
    lost = total = 0
    with torch.no_grad():
        for p in params:
            w = p.detach()
            w = w.to_local() if hasattr(w, "to_local") else w  # an FSDP2 shard: this rank's part is representative
            if w.dtype != torch.bfloat16 or w.numel() == 0:
                continue
            w = w.reshape(-1)[:: max(1, w.numel() // sample)]
            lost += int(((w + lr) == w).logical_and_((w - lr) == w).sum())
            total += w.numel()
    return lost / total if total else 0.0


def warn_if_bf16_updates_round_away(optimizer: torch.optim.Optimizer, threshold: float = 0.5) -> float:
    """Warn when most trainable bf16 weights cannot absorb an update of the configured lr (no stochastic rounding).

    Measured in docs/kd_study.md: a bf16 full fine-tune of SmolLM2-135M at lr 2e-5 could move only 4% of its
    weights per step; with torchao's stochastic rounding LAMBADA accuracy rose 0.306 -> 0.348 and QAT recovered
    61% instead of 3% of the PTQ loss. Returns the worst group's fraction (0.0 when nothing is bf16).
    """
    if getattr(optimizer, "bf16_stochastic_round", False) or isinstance(optimizer, MasterWeightAdamW):
        return 0.0
    worst, worst_lr = 0.0, 0.0
    for group in optimizer.param_groups:
        lr = float(group.get("lr", 0.0))
        frac = bf16_rounded_away_fraction(group["params"], lr) if lr > 0 else 0.0
        if frac > worst:
            worst, worst_lr = frac, lr
    if worst >= threshold:
        log.warning(
            "bf16 weights: an update of lr=%.1e rounds away for %.0f%% of the trainable weights, so most optimizer "
            "steps leave them unchanged; use optimizer._component_=llm_recipe.components.optim.MasterWeightAdamW "
            "(fp32 master weights, 12 bytes per weight: the GPU configs' choice), or dtype=fp32, or for less memory "
            "torchao.optim.AdamW8bit with optimizer.bf16_stochastic_round=true", worst_lr, 100 * worst,
        )
    return worst


def sync_offloaded_params(optimizer: torch.optim.Optimizer) -> None:
    """Re-sync CPUOffloadOptimizer after weights or state were loaded (no-op for other optimizers).

    CPUOffloadOptimizer snapshots the weights when it is built and steps on that CPU copy, so weights loaded
    into the model afterwards (e.g. on resume) must be pushed to it, or the next step reverts them.
    """
    d2h = getattr(optimizer, "param_d2h_map", None)
    if d2h is None:
        return
    with torch.no_grad():
        for p_device, p_host in d2h.items():
            p_host.copy_(p_device.detach())
    # torchao 0.18's CPUOffloadOptimizer.param_groups (what LR schedulers update) lists `d_param_groups`,
    # but `d_opt.load_state_dict` replaced the on-device optimizer's group dicts: re-point them, or the
    # scheduler would stop changing the lr of the small on-device parameters after a resume.
    if getattr(optimizer, "d_opt", None) is not None:
        optimizer.d_param_groups = optimizer.d_opt.param_groups


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, plus the CPU weight sync CPUOffloadOptimizer needs after a resume."""
    optimizer.load_state_dict(state)
    sync_offloaded_params(optimizer)


def _plain(v: Any) -> Any:
    # omegaconf ListConfig/DictConfig -> python containers, without importing omegaconf here.
    if hasattr(v, "items") and not isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) or type(v).__name__ == "ListConfig":
        return [_plain(x) for x in v]
    return v


class _Schedule:
    """LR multiplier: linear warmup to 1, then cosine/linear decay to `min_lr_ratio` (or constant).

    A class (not a closure) so LambdaLR.state_dict can save its settings.
    """

    def __init__(self, name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> None:
        self.name = name
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        # The first optimizer step uses lr * 1/warmup (not 0), and the warmup ends at exactly `warmup_steps`.
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "constant":
            return 1.0
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, progress))
        if self.name == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    name: str = "cosine",
    warmup_steps: int = 0,
    total_steps: int = 1,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with linear warmup over `warmup_steps` then `name` decay to `min_lr_ratio * lr` at `total_steps`.

    Call `scheduler.step()` once after each `optimizer.step()`.
    """
    if name not in SCHEDULERS:
        raise RecipeError(f"lr_scheduler.name={name!r} is unknown: use one of {', '.join(SCHEDULERS)}")
    if int(total_steps) < 1:
        raise RecipeError(f"lr_scheduler total_steps={total_steps} must be >= 1")
    if not 0 <= int(warmup_steps):
        raise RecipeError(f"lr_scheduler.warmup_steps={warmup_steps} must be >= 0")
    if not 0.0 <= float(min_lr_ratio) <= 1.0:
        raise RecipeError(f"lr_scheduler.min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    schedule = _Schedule(name, int(warmup_steps), int(total_steps), float(min_lr_ratio))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
