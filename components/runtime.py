"""One place for device, dtype, rank, seeding and sharding decisions.

Recipes call `setup_runtime(...)` once, then `rt.prepare_model(model)`; everything that depends on whether
we run on CPU, one GPU or many (torchrun) lives here so recipes stay free of `if distributed:` branches.

dtype policy: "fp32" works everywhere. "bf16" on a CUDA device without bf16 support is a RecipeError.
"bf16" on CPU falls back to fp32 with a warning (PyTorch emulates bf16 matmuls on most CPUs, which is
slower than fp32 and gains nothing for the small models one trains on CPU). "fp16" needs CUDA.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import RecipeError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_SPELLING = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # eval's dtype (config.json's torch_dtype)


@dataclass
class Runtime:
    """Where and how this process trains: device, compute dtype and its place in the process group."""

    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    distributed: bool = False
    seed: int = 0

    @property
    def is_main(self) -> bool:
        """True on rank 0: the one process that logs and writes files."""
        return self.rank == 0

    def build_device(self, ckpt_dir: str | Path | None = None) -> torch.device:
        """Where to build a model before its weights load. One process on a GPU: that GPU (random init of an 8B
        model on the host took most of a minute of setup; on the GPU it is instant). Several processes on GPUs:
        this GPU too when the weights of `ckpt_dir` in the run dtype take at most half of its free memory (rank
        0 decides for all): FSDP then shards from there. On the host, each of N ranks built and NF4-quantized a
        full 8B model with 1/N of the cores (11+ minutes for QLoRA 8B on two H200s). Otherwise, and on CPU runs,
        the host."""
        cpu = torch.device("cpu")
        if self.device.type != "cuda":
            return cpu
        if self.world_size == 1:
            return self.device
        need = _weight_bytes(ckpt_dir, self.dtype) if ckpt_dir is not None else None
        fits = need is not None and need <= torch.cuda.mem_get_info(self.device)[0] / 2
        return self.device if self.broadcast_object(fits) else cpu

    # ------------------------------------------------------------------ model
    def prepare_model(
        self,
        model: nn.Module,
        activation_checkpointing: bool | str = False,
        compile: bool = False,
        fsdp: bool | None = None,
        cast: bool = True,
        micro_batch_tokens: int | None = None,
    ) -> nn.Module:
        """Cast to the run dtype, move to the device, checkpoint/compile each of `model.layers`, shard with FSDP2.

        `activation_checkpointing="auto"` checkpoints only when the estimated activations of `micro_batch_tokens`
        tokens and the training state would not fit in free GPU memory (llm_recipe.components.memory), and says
        which it chose. `fsdp=None` shards exactly when world_size > 1. Returns the same module object.
        """
        use_fsdp = self.world_size > 1 if fsdp is None else fsdp
        if use_fsdp and not self.distributed:
            raise RecipeError("fsdp=true needs a distributed run: launch with torchrun --nproc_per_node=N")
        layers = getattr(model, "layers", None)
        if (activation_checkpointing or compile or use_fsdp) and not isinstance(layers, nn.ModuleList):
            raise RecipeError(
                f"{type(model).__name__} has no `layers` ModuleList: activation_checkpointing, compile and "
                "fsdp work per transformer layer"
            )
        if cast:
            _cast_floating(model, self.dtype)
        if not use_fsdp:
            # FSDP2 moves (sharded) parameters to the mesh device itself; moving the full model first would
            # cost a full copy per GPU.
            model.to(self.device)
        _quantize_fp8_bases(model, self.device, use_fsdp)
        built_here = use_fsdp and _on_gpu(model, self.device)  # and about to be sharded: that frees most of it
        per_step = use_fsdp and self._gather_per_step(model, built_here)
        if activation_checkpointing == "auto":
            from .memory import needs_checkpointing

            shard = self.world_size if use_fsdp else 1  # an FSDP rank holds 1/N of the weights and state
            activation_checkpointing, why = needs_checkpointing(model, micro_batch_tokens or 0, self.dtype,
                                                                self.device, shard, built_here, per_step)
            # every rank takes rank 0's choice: under FSDP a checkpointed layer all-gathers again in backward, so
            # ranks that chose differently would run different collectives
            activation_checkpointing = self.broadcast_object(activation_checkpointing)
            if self.is_main:
                print(f"activation_checkpointing=auto: {why}", flush=True)
        if activation_checkpointing:
            for layer in layers:
                _checkpoint_forward(layer)
        if compile:
            if self.device.type == "cuda":
                from .inductor_choices import use_one_pass_row_reductions

                use_one_pass_row_reductions()  # the fp8 quantization's wide rows in one pass (inductor_choices.py)
            for layer in layers:
                # nn.Module.compile keeps parameter names and the module type (unlike torch.compile(module)).
                layer.compile()
        if use_fsdp:
            from .fsdp import shard

            shard(model, layers, self.device.type, self.world_size, per_step)
            if built_here:  # the full copy's memory back to the GPU, so later free-memory checks see it
                torch.cuda.empty_cache()
        return model

    def _gather_per_step(self, model: nn.Module, built_here: bool) -> bool:
        """Whether the FSDP2 layers of `model` gather once per optimizer step instead of per micro-batch
        (components/fsdp.py); rank 0's view of its free memory decides for every rank, and it says so."""
        from .fsdp import gather_per_step
        from .memory import weight_bytes

        free, where = _free_memory(self)
        if built_here:  # the full copy on this GPU now is what the gathered layers will take again
            free += weight_bytes(model)
        keep, why = gather_per_step(model, free)
        keep = self.broadcast_object(keep)  # ranks that chose differently would run different collectives
        if self.is_main and why != "frozen":
            print(f"fsdp: layers gathered {why} {where}", flush=True)
        return keep

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict as plain CPU tensors on rank 0; an empty dict on other ranks.

        Every rank must call it (it gathers shards when the model is FSDP-sharded).
        """
        if _is_sharded(model):
            from . import fsdp

            fsdp.reshard(model)  # gathered by a forward without backward (sampling, a held-out score): shards again
            return fsdp.full_state_dict(model, keep=self.is_main)
        return {k: v.detach().to("cpu") for k, v in model.state_dict().items()}

    def gathered_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full state dict on every rank, for streaming to a file (stream_save): a sharded model's tensors are
        `Deferred` gathers (fsdp.gathered_state_dict; every rank must make the same ones in the same order), any
        other model's are its own tensors on their device."""
        if _is_sharded(model):
            from . import fsdp

            fsdp.reshard(model)  # gathered by a forward without backward (sampling, a held-out score): shards again
            return fsdp.gathered_state_dict(model)
        return {k: v.detach() for k, v in model.state_dict().items()}

    def load_full_state_dict(
        self, model: nn.Module, sd: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load a full state dict (needed on rank 0 only when sharded: it is broadcast) into `model`."""
        if _is_sharded(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(
                model,
                sd,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict),
            )
            return
        model.load_state_dict(sd, strict=strict)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state to checkpoint: full (gathered, CPU) on rank 0 when sharded, else `state_dict()`."""
        if _is_sharded(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            from .fsdp import reshard

            reshard(model)

            sd = get_optimizer_state_dict(
                model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            return sd if self.is_main else {}
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
    ) -> None:
        """Inverse of `optimizer_state_dict` (rank 0's copy is broadcast when sharded)."""
        if _is_sharded(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(
                model,
                optimizer,
                sd,
                options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
            )
            return
        from .optim import load_optimizer_state

        load_optimizer_state(optimizer, sd)

    # ------------------------------------------------------------ collectives
    def barrier(self) -> None:
        """Wait for every rank (no-op when not distributed)."""
        if self.distributed:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.local_rank])
            else:
                dist.barrier()

    def all_reduce_mean(self, x: torch.Tensor | float) -> torch.Tensor | float:
        """Mean of `x` over ranks; returns the same kind (tensor or float) it was given."""
        return self._all_reduce(x, "mean")

    def all_reduce_sum(self, x: torch.Tensor | float) -> torch.Tensor | float:
        """Sum of `x` over ranks (e.g. token counts for a token-weighted mean)."""
        return self._all_reduce(x, "sum")

    def all_reduce_max(self, x: torch.Tensor | float) -> torch.Tensor | float:
        """Elementwise largest of `x` over ranks (e.g. batch shapes every rank must agree on)."""
        return self._all_reduce(x, "max")

    def _all_reduce(self, x: torch.Tensor | float, how: str) -> torch.Tensor | float:
        if not self.distributed:
            return x
        is_tensor = isinstance(x, torch.Tensor)
        t = x.detach().clone() if is_tensor else torch.tensor(float(x), dtype=torch.float64)
        orig_device = t.device
        t = t.to(self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.SUM)
        if how == "mean":
            t = t / self.world_size
        return t.to(orig_device) if is_tensor else float(t.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (e.g. a resume path decided on rank 0)."""
        if not self.distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (a list of one when not distributed)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    # ---------------------------------------------------------------- memory
    def peak_memory_gib(self) -> float:
        """Peak memory so far in GiB: CUDA max allocated on GPU, the process's peak RSS on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is in KiB on Linux and in bytes on macOS.
        return peak / 2**30 if sys.platform == "darwin" else peak / 2**20

    def teardown(self) -> None:
        """Destroy the process group if this runtime created one."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        self.distributed = False


def check_device(device: str, dtype: str, processes: int = 1) -> torch.device:
    """The device `device` names (auto: cuda when available) after checking that it exists here, that `dtype`
    runs on it and, for `processes` ranks of one node on CUDA, that each has a GPU. A RecipeError names the value.
    `recipe run` calls it before torchrun starts the ranks (one line, not one per rank); `setup_runtime` in each."""
    torch_dtype = DTYPES.get(HF_SPELLING.get(dtype, dtype))
    if torch_dtype is None:
        raise RecipeError(f"dtype={dtype!r} is not supported: use one of {', '.join(DTYPES)}")
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise RecipeError(f"device={device!r} is not a device: use auto, cpu or cuda") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RecipeError(f"device={device!r} but CUDA is not available here: use device=cpu or auto")
        if dev.type not in ("cpu", "cuda"):
            raise RecipeError(f"device={device!r} is not supported: use auto, cpu or cuda")
    if dev.type == "cuda" and processes > torch.cuda.device_count():
        raise RecipeError(f"{processes} processes on device={device!r}, but only {torch.cuda.device_count()} GPU(s) "
                          "are visible: one GPU per process (--nproc-per-node)")
    if dev.type == "cuda" and torch_dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise RecipeError(
            f"dtype={dtype} but {torch.cuda.get_device_name(dev)} has no bf16 support: use dtype=fp32 (or fp16)"
        )
    if dev.type == "cpu" and torch_dtype is torch.float16:
        raise RecipeError(f"dtype={dtype} needs a CUDA GPU: use dtype=fp32 (or bf16) on CPU")
    return dev


def setup_runtime(
    device: str = "auto", dtype: str = "bf16", seed: int = 0, deterministic: bool | None = None
) -> Runtime:
    """Pick device and dtype, join the torchrun process group if launched by torchrun, seed every RNG.

    `device`: "auto" (cuda when available), "cpu", "cuda" or "cuda:N". `deterministic` (default: on for CPU)
    turns on `torch.use_deterministic_algorithms(True, warn_only=True)`.
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    dev = check_device(device, dtype)
    if dev.type == "cuda":
        index = local_rank if world_size > 1 or dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise RecipeError(
                f"LOCAL_RANK/device index {index} but only {torch.cuda.device_count()} GPU(s) are visible"
            )
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)

    torch_dtype = DTYPES[HF_SPELLING.get(dtype, dtype)]
    if dev.type == "cpu" and torch_dtype is torch.bfloat16:
        if rank == 0:
            log.warning("dtype=bf16 on CPU: running in fp32 instead (bf16 is emulated and slower on CPU)")
        torch_dtype = torch.float32

    distributed = False
    if world_size > 1:
        if not dist.is_available():
            raise RecipeError("WORLD_SIZE>1 but this PyTorch build has no torch.distributed")
        if not dist.is_initialized():
            backend = "nccl" if dev.type == "cuda" else "gloo"
            kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world_size}
            if dev.type == "cuda":
                kwargs["device_id"] = dev
            dist.init_process_group(**kwargs)
        distributed = True

    if deterministic is None:
        deterministic = dev.type == "cpu"
    if deterministic:
        if dev.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    seed_everything(seed)
    return Runtime(
        device=dev,
        dtype=torch_dtype,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        distributed=distributed,
        seed=seed,
    )


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all CUDA devices too) with the same seed; same on every rank."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    # Cast plain floating parameters/buffers only: quantized tensor subclasses (NF4, QAT) keep their own
    # storage, and `module.to(dtype)` would dequantize or reject them.
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if type(p) is nn.Parameter and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in list(module.named_buffers(recurse=False)):
            if type(b) is torch.Tensor and b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = b.to(dtype)


def _quantize_fp8_bases(model: nn.Module, device: torch.device, sharded: bool) -> None:
    # lora.quantize_base=fp8: the LoRA bases were loaded in the run dtype; now on the GPU, before compile, they are
    # stored in fp8 (components/quantization/fp8_base.py). Nothing to do (and nothing imported) otherwise.
    if any(getattr(m, "fp8_base_pending", False) for m in model.modules()):
        from .quantization.fp8_base import quantize_fp8_bases

        quantize_fp8_bases(model, device, sharded)


def _checkpoint_forward(layer: nn.Module) -> None:
    # Recompute the layer's activations in backward. Wrapping `forward` (rather than the module, as
    # checkpoint_wrapper does) keeps parameter names and the layer type, so state dicts, LoRA/PEFT names and
    # optimizer FQNs are the same with or without checkpointing.
    if getattr(layer, "_recipe_checkpointed", False):
        return
    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward
    layer._recipe_checkpointed = True


TEACHER_PLACEMENTS = ("auto", "shard", "replicate")


def prepare_teacher(rt: Runtime, teacher: nn.Module, placement: str = "auto", compile: bool = False) -> nn.Module:
    """Place a frozen KD teacher: cast, move, optionally compile per layer, and on several processes either
    `replicate` it (one full copy per process: no all-gather per layer, the fastest when it fits) or `shard` it
    with FSDP2 (1/N of it per process, an all-gather per layer and step). `auto` replicates when the teacher
    takes at most half of the free memory (the other half is left to the student's weights, gradients,
    optimizer state and activations) and says what it chose. An unsharded teacher on a GPU keeps its input
    embedding table on the host when it is not tied to its head (components/models/host_embedding.py: ~1 GiB less
    GPU memory for an 8B teacher, exact). Returns the teacher in eval mode."""
    if placement not in TEACHER_PLACEMENTS:
        raise RecipeError(f"teacher.placement={placement!r}: use one of {', '.join(TEACHER_PLACEMENTS)}")
    teacher.requires_grad_(False)
    if rt.world_size == 1:
        return _embedding_to_host(rt, rt.prepare_model(teacher, compile=compile).eval())
    if placement == "auto":
        need = sum(t.numel() for t in [*teacher.parameters(), *teacher.buffers()]) * rt.dtype.itemsize
        free, where = _free_memory(rt)
        if _on_gpu(teacher, rt.device):
            free += need  # its own copy is not taken from the free memory
        free = float(rt.broadcast_object(free))  # rank 0's view, so every rank places the teacher the same way
        placement = "replicate" if need <= free / 2 else "shard"
        if rt.is_main:
            verdict = "<=" if placement == "replicate" else ">"
            print(f"teacher.placement=auto: {placement} (teacher {need / 2**30:.2f} GiB {verdict} half of the "
                  f"{free / 2**30:.2f} GiB free {where})", flush=True)
    return _embedding_to_host(rt, rt.prepare_model(teacher, compile=compile, fsdp=placement == "shard").eval())


def _embedding_to_host(rt: Runtime, teacher: nn.Module) -> nn.Module:
    # Frozen, placed, unsharded and on a GPU: its (untied) input embedding table moves to the host; else a no-op.
    from .models.host_embedding import teacher_embedding_to_host

    teacher_embedding_to_host(teacher, rt.device, rt.is_main)
    return teacher


def _free_memory(rt: Runtime) -> tuple[float, str]:
    """Bytes free for one more full copy of a model on this process: free GPU memory, or on CPU the available
    RAM divided by the processes of this host (they all hold a copy)."""
    if rt.device.type == "cuda":
        return float(torch.cuda.mem_get_info(rt.device)[0]), f"on {rt.device}"
    procs = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))
    return float(available_ram()) / procs, f"RAM per process ({procs} on this host)"


def available_ram() -> int:
    """Bytes of RAM a new allocation can take: /proc/meminfo's MemAvailable (free pages plus the page cache the
    kernel can drop), else free pages alone. Free pages alone read 1.2 GiB on a machine with 18.7 GiB available."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _is_sharded(model: nn.Module) -> bool:
    from .models.builder import is_sharded

    return is_sharded(model)


def _on_gpu(model: nn.Module, device: torch.device) -> bool:
    """Whether `model` was built on `device`, a GPU (Runtime.build_device), so that its full copy already counts
    against that GPU's free memory."""
    return device.type == "cuda" and any(p.device == device for p in model.parameters())


def _weight_bytes(ckpt_dir: str | Path, dtype: torch.dtype) -> int | None:
    """Bytes of a HF folder's weights in `dtype`, from its safetensors headers (None without them)."""
    from .models.hf_io import safetensors_shapes

    shapes = safetensors_shapes(ckpt_dir)
    if not shapes:
        return None
    return sum(math.prod(shape) for _, shape in shapes.values()) * dtype.itemsize
