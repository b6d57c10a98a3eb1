"""Building blocks the training recipes (full, kd, qat) call from their own loops.

Each recipe reads top to bottom: setup, then `for window in windows(...)`: loss, backward, clip, optimizer step,
log, checkpoint. These are the parts that are the same everywhere (reading the typed `TrainConfig` of
components/train_config.py): the data loader,
optimizer and schedule, the accumulation window and its target count, gradient clipping, the step's logged
values, throughput, the final model. Checkpoints and resume: components/train_state.py. There is deliberately no
trainer: a recipe copied with `recipe cp` holds its whole loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint.manifest import MANIFEST
from .checkpoint.stream_save import made
from .data.dataset import build_dataset, build_loader
from .data.loader import StatefulLoader
from .losses import kd_and_ce
from .losses.rows import loss_rows
from .models import LoRASettings, ModelArgs, save_model, save_peft_adapter
from .models.attention import batch_to_device
from .models.hf_io import clone_hf_folder
from .models.host_embedding import input_tokens
from .models.loader import lazily_merged_state_dict
from .models.peft_adapter import is_adapter_key
from .models.tokenizer import Tokenizer
from .oom import is_out_of_memory, note_step
from .optim import build_optimizer, build_scheduler, warn_if_bf16_updates_round_away
from .runtime import Runtime

if TYPE_CHECKING:
    from .train_config import TrainConfig

IGNORE_INDEX = -100
LOSS_ROWS = "loss_rows"  # to_device's key for the batch's components.losses.rows.LossRows


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of an HF model folder (tokenizer.json + tokenizer_config.json)."""
    return Tokenizer.from_dir(model_dir)


def build_train_loader(cfg: TrainConfig, tokenizer: Tokenizer, rt: Runtime,
                       wrap_dataset: Callable | None = None) -> StatefulLoader:
    """The tokenized `dataset:` and its resumable loader, sharded over ranks; `wrap_dataset(dataset)` may replace
    the dataset first (KD from a logits cache adds the cached teacher rows).

    Packed and compiled: every batch has the same shape (the last partial batch of an epoch is dropped when
    there is a full one), so torch.compile never recompiles for a smaller batch."""
    dataset = build_dataset(tokenizer, cfg.dataset)
    if wrap_dataset is not None:
        dataset = wrap_dataset(dataset)
    static = cfg.compile and dataset.packed and len(dataset) >= cfg.batch_size * rt.world_size
    return build_loader(dataset, cfg.batch_size, seed=cfg.seed, rank=rt.rank, world_size=rt.world_size,
                        drop_last=static)


def micro_batch_tokens(cfg: TrainConfig) -> int:
    """Tokens in one micro-batch at most (`batch_size` rows of `dataset.max_seq_len`): what activations scale with."""
    return cfg.batch_size * cfg.dataset.max_seq_len


def total_steps(cfg: TrainConfig, loader: StatefulLoader) -> int:
    """Optimizer steps of the run: `max_steps`, or `epochs` passes over the data."""
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(1, cfg.epochs * len(loader) // cfg.gradient_accumulation_steps)


def freeze_all_but_adapters(model: nn.Module) -> None:
    """LoRA/DoRA: only adapter matrices (and DoRA magnitudes) train."""
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_a." in name or ".lora_b." in name or name.endswith(".magnitude"))


def setup_optimizer(cfg: TrainConfig, model: nn.Module, rt: Runtime,
                    steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The `optimizer:` component over the model's parameters and its `lr_scheduler:` over `steps` steps."""
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), rt)
    warn_if_bf16_updates_round_away(optimizer)
    s = cfg.lr_scheduler
    if s.warmup_steps >= steps and s.warmup_steps > 0 and rt.is_main:  # e.g. a smoke run of a shipped config
        print(f"note: lr_scheduler.warmup_steps={s.warmup_steps} >= the run's {steps} optimizer steps: the learning "
              "rate never reaches optimizer.lr", flush=True)
    scheduler = build_scheduler(optimizer, name=s.name, warmup_steps=s.warmup_steps, total_steps=steps,
                                min_lr_ratio=s.min_lr_ratio)
    return optimizer, scheduler


def windows(loader: StatefulLoader, accum: int, count: int) -> Iterator[list[dict]]:
    """`count` accumulation windows (lists of `accum` micro-batches), epoch after epoch. It stops without taking
    another micro-batch from the loader, so a finished run's checkpoint resumes exactly after its last step."""
    window: list[dict] = []
    while count > 0:
        for batch in loader:
            window.append(batch)
            if len(window) == accum:
                yield window
                window = []
                count -= 1
                if count == 0:
                    return


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch's tensors on `device`; packed rows get their attention mask there: a flex-attention BlockMask on
    a GPU, else dense (components/models/attention.py says why). Labels still on the host also give `loss_rows`:
    which positions carry a label, so that the loss projects only those (components/losses/rows.py)."""
    out = batch_to_device({k: v for k, v in batch.items() if k != LOSS_ROWS}, device)
    labels = batch.get("labels")
    if LOSS_ROWS in batch:
        out[LOSS_ROWS] = batch[LOSS_ROWS]
    elif isinstance(labels, torch.Tensor) and labels.device.type == "cpu":
        rows = loss_rows(labels, out["labels"].device)
        if rows is not None:
            out[LOSS_ROWS] = rows
    return out


def count_targets(window: list[dict], rt: Runtime) -> torch.Tensor:
    """Tokens that carry a loss in this window, summed over ranks: the loss normaliser."""
    n = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in window)  # labels are still on the host
    # A device tensor: dividing the loss by it and reducing it over ranks never waits for the GPU.
    return rt.all_reduce_sum(torch.tensor(float(n), device=rt.device)).clamp_min(1.0)


def hidden_states(model: nn.Module, batch: dict) -> torch.Tensor:
    """Final normed hidden states (the output projection is applied chunk by chunk by the loss); the model
    returns logits again afterwards."""
    model.skip_output = True
    try:  # a teacher whose embedding stays on the host takes the batch's host tokens (models/host_embedding.py)
        return model(input_tokens(model, batch), mask=batch.get("mask"), input_pos=batch.get("input_pos"))
    finally:
        model.skip_output = False


def lm_loss_sum(model: nn.Module, batch: dict, num_chunks: int) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch, never materialising full logits."""
    return kd_and_ce(hidden_states(model, batch), model.output, batch["labels"], num_chunks=num_chunks,
                     rows_with_labels=batch.get(LOSS_ROWS))["loss"]


def clip_gradients(model: nn.Module, max_grad_norm: float | None) -> torch.Tensor | None:
    """Clip to `max_grad_norm` (if set); returns the pre-clip norm as a device tensor (no host sync)."""
    if max_grad_norm is None:
        return None
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if grads and all(_row_sharded(g, grads[0]) for g in grads):
        return _clip_local_shards(grads, max_grad_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor (other placements)


def _row_sharded(grad: torch.Tensor, first: torch.Tensor) -> bool:
    """An FSDP2 gradient: a DTensor sharded along one mesh dimension (the mesh of `first`)."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(grad, DTensor) and grad.device_mesh is first.device_mesh and grad.device_mesh.ndim == 1
            and all(isinstance(pl, Shard) for pl in grad.placements))


@torch.no_grad()
def _clip_local_shards(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ on FSDP2 gradients, computed on each rank's shards: the squared norms of the local
    parts summed over ranks (one all-reduce), then the same scaling (max_norm / (norm + 1e-6), at most 1).
    Why not torch's on the DTensors: its sharding propagation over hundreds of DTensors costs the host every step
    (224 LoRA gradients on 2 processes of the dev VM: 12.9 ms against 1.4 ms for plain tensors), time the GPU
    waits for at the step boundary."""
    local = [g.to_local() for g in grads]  # the shards themselves (no copy): scaling them scales the DTensors
    squares = torch.stack([n.float() for n in torch._foreach_norm(local)]).square().sum()
    dist.all_reduce(squares, group=grads[0].device_mesh.get_group())
    total = squares.sqrt()
    torch._foreach_mul_(local, (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Step, advance the schedule, zero grads."""
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def step_values(totals: dict[str, torch.Tensor], grad_norm: torch.Tensor | None, rt: Runtime) -> dict[str, float]:
    """The step's logged numbers, summed over ranks, read back to the host in one copy (the step's one sync)."""
    keys = list(totals)
    packed = rt.all_reduce_sum(torch.stack([totals[k].float() for k in keys]))
    if grad_norm is not None:  # the same on every rank: read in the same copy, not reduced
        packed = torch.cat([packed, grad_norm.detach().float().reshape(1).to(packed.device)])
    read = packed.tolist()
    values = dict(zip(keys, read))
    values["grad_norm"] = read[-1] if grad_norm is not None else None
    return values


@dataclass
class Throughput:
    """Tokens per second over the last optimizer step."""

    start: float = 0.0

    def begin(self) -> None:
        """The step starts now."""
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since `begin`."""
        return time.perf_counter() - self.start

    def rate(self, window: list[dict], rt: Runtime) -> float:
        """Tokens of the step's window on all ranks per second since `begin`: the positions of every row that trains
        something (a packed row's padding included; the empty rows that fill an on-policy pass to the loader's
        shape not)."""
        tokens = sum(int((b["labels"] != IGNORE_INDEX).any(-1).sum()) * b["tokens"].shape[-1] for b in window)
        tokens *= rt.world_size
        return tokens / max(time.perf_counter() - self.start, 1e-9)


def write_final_model(output_dir: str | Path, rt: Runtime, model: nn.Module, args: ModelArgs,
                      tokenizer_dir: str | Path, lora: LoRASettings | None = None, base_model: str | None = None,
                      extra_files: dict[str, str] | None = None, checkpoint: Path | None = None) -> Path:
    """output_dir/model (merged HF folder) and, for LoRA, output_dir/adapter (PEFT format). `checkpoint`: the
    checkpoint this process wrote at its last step (`TrainState.final_checkpoint`): a one-process one holds the same
    HF folder, which model/ clones where the filesystem can (no second write); elsewhere the weights are streamed
    from the model again, which beat a copy of the checkpoint's files (`clone_hf_folder`). Several processes: rank 0
    streams each tensor as the ranks gather it on their GPUs (one at a time, merged there), the others join."""
    out = Path(output_dir)
    reuse = checkpoint is not None and rt.world_size == 1 and (checkpoint / "config.json").is_file()
    began = time.perf_counter()
    try:
        full = rt.gathered_state_dict(model)  # one process: its own tensors; several: each gathered when written
        # the adapters first, on every rank (small; every rank gathers them in the same order)
        adapters = {k: made(v) for k, v in full.items() if is_adapter_key(k)} if lora is not None else None
        cloned = rt.is_main and reuse and clone_hf_folder(checkpoint, out / "model", skip=(MANIFEST,),
                                                          extra_files=extra_files)
        if not cloned:  # off rank 0 nothing is written: those ranks make the tensors rank 0 writes, in its order
            save_model(model, args, out / "model" if rt.is_main else None, tokenizer_dir,
                       state_dict=lazily_merged_state_dict(model, full), extra_files=extra_files)
        if rt.is_main and adapters is not None:
            save_peft_adapter(adapters, lora, out / "adapter", base_model=base_model)
    except (RuntimeError, MemoryError) as e:
        if is_out_of_memory(e):
            note_step(e, f"writing {out / 'model'}", None, rt.device)
        raise
    rt.barrier()
    if rt.is_main:  # a 7B model's takes seconds after the bar has ended: said, as each checkpoint is
        size = sum(f.stat().st_size for f in (out / "model").glob("*.safetensors"))
        how = f"cloned from {checkpoint.name}" if cloned else "written"
        print(f"model/: {size / 1e9:.2f} GB {how} in {time.perf_counter() - began:.1f} s", flush=True)
    return out / "model"
