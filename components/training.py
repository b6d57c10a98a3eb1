"""Building blocks shared by the training recipes (full, lora, kd, qat).

Each recipe reads top to bottom — setup, loop, checkpoint — and calls these helpers for the parts that are the
same everywhere: config schema, data, optimizer, the accumulation window, resume and checkpoint writing.
There is deliberately no trainer class.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from llm_recipe.components.checkpoint.manifest import verify_manifest
from llm_recipe.components.checkpoint.sharded import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from llm_recipe.components.checkpoint.state import (
    latest_checkpoint,
    load_recipe_state,
    restore_rng,
    save_checkpoint,
)
from llm_recipe.components.config import COMPONENT
from llm_recipe.components.data.dataset import build_dataset, build_loader
from llm_recipe.components.data.formats import FORMATS
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.interrupt import StopRequest, note_training
from llm_recipe.components.losses import kd_and_ce
from llm_recipe.components.metrics import MetricLogger, check_finite
from llm_recipe.components.models import LORA_TARGETS, LoRASettings, ModelArgs, save_model, save_peft_adapter
from llm_recipe.components.models.hf_io import copy_tokenizer_files
from llm_recipe.components.models.loader import dtype_name, lora_rank_alpha, merged_state_dict
from llm_recipe.components.models.tokenizer import Tokenizer
from llm_recipe.components.oom import is_out_of_memory, note_step
from llm_recipe.components.optim import (
    SCHEDULERS,
    build_optimizer,
    build_scheduler,
    warn_if_bf16_updates_round_away,
)
from llm_recipe.components.runs import RUN_ID_KEY, check_resume, current_run_id, previous_run, start_run
from llm_recipe.components.runtime import DTYPES, Runtime
from llm_recipe.components.schema import DEVICE, Choice, ListOf, OutputDir, Range
from llm_recipe.components.setup_log import SetupLog

IGNORE_INDEX = -100
OPT_INT = (int, type(None))
OPT_FLOAT = (float, type(None))
OPT_STR = (str, type(None))

DATASET_SCHEMA = {
    "source": str,
    "format": Choice(*FORMATS),
    "split": str,
    "name": OPT_STR,
    "data_files": (str, list, dict, type(None)),
    "column_map": (dict, type(None)),
    "max_seq_len": Range(int, ge=2),
    "train_on_input": bool,
    "use_chat_template": bool,
    "packed": bool,
    "limit": Range(int, ge=1, optional=True),
    "shuffle": bool,
    "bucket": bool,
}
LORA_SCHEMA = {
    "rank": Range(int, ge=1),
    "alpha": Range(float, gt=0),
    "dropout": Range(float, ge=0, lt=1),
    "targets": ListOf(Choice(*LORA_TARGETS), min_len=1, unique=True),
    "use_dora": bool,
    "quantize_base": bool,
}
# A torch/torchao optimizer class (nothing else is imported for a config); the arguments of AdamW-style
# optimizers whose range is known are checked, others bind to the signature only.
OPTIMIZER = COMPONENT(allow=("torch.optim.", "torchao.optim.", "llm_recipe.components.optim."), lr=Range(float, gt=0),
                      weight_decay=Range(float, ge=0), eps=Range(float, gt=0),
                      betas=ListOf(Range(float, ge=0, lt=1), min_len=2, max_len=2))
# Keys every training recipe reads; recipes add their model/loss sections.
TRAIN_SCHEMA: dict[str, Any] = {
    "output_dir": OutputDir(),
    "seed": Range(int, ge=0),
    "device": DEVICE,
    "dtype": Choice(*DTYPES),
    "max_steps": Range(int, ge=1, optional=True),
    "epochs": Range(int, ge=1),
    "batch_size": Range(int, ge=1),
    "gradient_accumulation_steps": Range(int, ge=1),
    "max_grad_norm": Range(float, gt=0, optional=True),
    "optimizer": OPTIMIZER,
    "lr_scheduler": {"name": Choice(*SCHEDULERS), "warmup_steps": Range(int, ge=0),
                     "min_lr_ratio": Range(float, ge=0, le=1)},
    "dataset": DATASET_SCHEMA,
    "num_output_chunks": Range(int, ge=1),
    "activation_checkpointing": Choice(True, False, "auto"),
    "compile": bool,
    "save_every_n_steps": Range(int, ge=1, optional=True),
    "keep_last_n": Range(int, ge=1, optional=True),
    "resume": bool,
    "overwrite": bool,
    "tensorboard": bool,
    "wandb": (dict, type(None)),
}


def lora_settings(node: DictConfig | None) -> LoRASettings | None:
    """`lora:` section -> LoRASettings (None when the section is absent or null)."""
    if node is None:
        return None
    kw = OmegaConf.to_container(node, resolve=True)
    if "targets" in kw:
        kw["targets"] = tuple(kw["targets"])
    return LoRASettings(**kw)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def build_train_loader(cfg: DictConfig, tokenizer: Tokenizer, rt: Runtime, wrap_dataset: Callable | None = None):
    """The tokenized dataset and its resumable loader, sharded over ranks; `wrap_dataset(dataset)` may replace
    the dataset first (KD from a logits cache adds the cached teacher rows).

    Packed and compiled: every batch has the same shape (the last partial batch of an epoch is dropped when
    there is a full one), so torch.compile never recompiles for a smaller batch."""
    kw = OmegaConf.to_container(cfg.dataset, resolve=True)
    dataset = build_dataset(tokenizer, **kw)
    if wrap_dataset is not None:
        dataset = wrap_dataset(dataset)
    batch_size = cfg.get("batch_size", 4)
    static = bool(cfg.get("compile")) and dataset.packed and len(dataset) >= batch_size * rt.world_size
    return build_loader(dataset, batch_size, seed=cfg.get("seed", 0), rank=rt.rank, world_size=rt.world_size,
                        drop_last=static)


def micro_batch_tokens(cfg: DictConfig) -> int:
    """Tokens in one micro-batch at most (`batch_size` rows of `dataset.max_seq_len`): what activations scale with."""
    return int(cfg.get("batch_size", 4)) * int(cfg.dataset.max_seq_len)


def total_steps(cfg: DictConfig, loader) -> int:
    """Optimizer steps of the run: `max_steps`, or `epochs` passes over the data."""
    if cfg.get("max_steps") is not None:
        if cfg.max_steps < 1:
            raise RecipeError(f"max_steps={cfg.max_steps} must be >= 1")
        return int(cfg.max_steps)
    accum = cfg.get("gradient_accumulation_steps", 1)
    return max(1, cfg.get("epochs", 1) * len(loader) // accum)


def freeze_all_but_adapters(model: nn.Module) -> None:
    """LoRA/DoRA: only adapter matrices (and DoRA magnitudes) train."""
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_a." in name or ".lora_b." in name or name.endswith(".magnitude"))


def setup_optimizer(cfg: DictConfig, model: nn.Module, rt: Runtime, steps: int):
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), rt)
    warn_if_bf16_updates_round_away(optimizer)
    sched_cfg = cfg.get("lr_scheduler") or {}
    scheduler = build_scheduler(optimizer, name=sched_cfg.get("name", "cosine"),
                                warmup_steps=sched_cfg.get("warmup_steps", 0), total_steps=steps,
                                min_lr_ratio=sched_cfg.get("min_lr_ratio", 0.0))
    return optimizer, scheduler


def setup_training(cfg: DictConfig, rt: Runtime, model: nn.Module, tokenizer: Tokenizer, resume_from: Path | None,
                   adapters: bool, wrap_dataset: Callable | None = None):
    """Data loader, step count, optimizer and schedule; restored from `resume_from` when resuming.

    Returns `(loader, steps, optimizer, scheduler, start_step)`.
    """
    loader = build_train_loader(cfg, tokenizer, rt, wrap_dataset)
    steps = total_steps(cfg, loader)
    optimizer, scheduler = setup_optimizer(cfg, model, rt, steps)
    start = 0
    if resume_from is not None:
        start = restore_training_state(resume_from, model, optimizer, scheduler, loader, rt, adapters)
    return loader, steps, optimizer, scheduler, start


def windows(loader, accum: int) -> Iterator[list[dict]]:
    """Endless stream of accumulation windows (lists of `accum` micro-batches), epoch after epoch."""
    window: list[dict] = []
    while True:
        for batch in loader:
            window.append(batch)
            if len(window) == accum:
                yield window
                window = []


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def count_targets(window: list[dict], rt: Runtime) -> torch.Tensor:
    """Tokens that carry a loss in this window, summed over ranks: the loss normaliser."""
    n = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in window)  # labels are still on the host
    # A device tensor: dividing the loss by it and reducing it over ranks never waits for the GPU.
    return rt.all_reduce_sum(torch.tensor(float(n), device=rt.device)).clamp_min(1.0)


def hidden_states(model: nn.Module, batch: dict) -> torch.Tensor:
    """Final normed hidden states (the output projection is applied chunk by chunk by the loss); the model
    returns logits again afterwards."""
    model.skip_output = True
    try:
        return model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"))
    finally:
        model.skip_output = False


def lm_loss_sum(model: nn.Module, batch: dict, num_chunks: int) -> torch.Tensor:
    """Summed next-token cross-entropy of one micro-batch, never materialising full logits."""
    return kd_and_ce(hidden_states(model, batch), model.output, batch["labels"], num_chunks=num_chunks)["loss"]


def clip_gradients(model: nn.Module, max_grad_norm: float | None) -> torch.Tensor | None:
    """Clip to `max_grad_norm` (if set); returns the pre-clip norm as a device tensor (no host sync)."""
    if max_grad_norm is None:
        return None
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP2


def optimizer_step(optimizer, scheduler) -> None:
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
        self.start = time.perf_counter()

    def rate(self, window: list[dict], rt: Runtime) -> float:
        tokens = sum(b["tokens"].numel() for b in window) * rt.world_size
        return tokens / max(time.perf_counter() - self.start, 1e-9)


def resume_weights(ckpt: Path | None) -> Path | None:
    """The checkpoint when its folder holds HF weights to build the model from (one-process checkpoints),
    else None: a sharded checkpoint's weights are restored after sharding, by `restore_training_state`."""
    return ckpt if ckpt is not None and not is_sharded_checkpoint(ckpt) else None


def start_or_resume_run(cfg: DictConfig) -> Path | None:
    """Start the run in `output_dir` (llm_recipe.components.runs): a new run (`resume: false`) is refused when the
    folder holds an earlier run's outputs, unless `overwrite: true` deletes them, and writes run.json; returns None.
    With `resume: true`, the latest complete checkpoint (an error when there is none), its file checksums verified
    (an error naming the first corrupt file) and its run id the one of output_dir/run.json."""
    if not cfg.get("resume", False):
        start_run(cfg)
        return None
    ckpt = latest_checkpoint(cfg.output_dir)
    if ckpt is None:
        fresh = "overwrite=true" if previous_run(cfg.output_dir) else "without resume"
        raise RecipeError(f"resume=true but {cfg.output_dir}/checkpoints has no complete checkpoint; "
                          f"run {fresh} to start fresh")
    verify_manifest(ckpt)
    check_resume(cfg, ckpt)
    if os.environ.get("RANK", "0") == "0":
        print(f"resuming from {ckpt} (file checksums verified)", flush=True)
    return ckpt


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters that train (LoRA: the adapter matrices and DoRA magnitudes)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_tensors(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Trainable adapter tensors by name, taken from `full` (`Runtime.full_state_dict`: gathered on rank 0 when
    the model is FSDP-sharded, where a parameter itself holds only this rank's shard). Saved for LoRA resume."""
    return {n: full[n] for n in trainable_names(model) if n in full}


def restore_training_state(ckpt: Path, model: nn.Module, optimizer, scheduler, loader, rt: Runtime,
                           adapters: bool) -> int:
    """Load optimizer, scheduler, data position, RNG (and adapter weights for LoRA); return the step."""
    state = load_recipe_state(ckpt)
    if is_sharded_checkpoint(ckpt):  # written by a run over several processes: weights + optimizer in DCP shards
        load_sharded_checkpoint(ckpt, model, optimizer, state)
    else:
        restore_weights_and_optimizer(ckpt, state, model, optimizer, rt, adapters)
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    restore_rng(state["rng"])
    return int(state["step"])


def restore_weights_and_optimizer(ckpt: Path, state: dict, model: nn.Module, optimizer, rt: Runtime,
                                  adapters: bool) -> None:
    """A one-process checkpoint: adapters (LoRA) and the full optimizer state from `recipe_state`; full weights
    were already loaded from the checkpoint's HF folder by the recipe (`resume_weights`)."""
    if adapters:
        names = trainable_names(model)
        missing = set(names) - set(state["adapters"])
        if missing:
            raise RecipeError(f"{ckpt}: the checkpoint has no adapter weights for {sorted(missing)[:3]} "
                              "(was it written with different lora settings?)")
        # Through the runtime: under FSDP each rank keeps its own shard of the saved full tensors.
        rt.load_full_state_dict(model, {n: state["adapters"][n] for n in names}, strict=False)
    rt.load_optimizer_state_dict(model, optimizer, state["optimizer"])


def save_training_checkpoint(cfg: DictConfig, rt: Runtime, step: int, model: nn.Module, args: ModelArgs,
                             tokenizer_dir: str | Path, optimizer, scheduler, loader, adapters: bool) -> Path:
    """HF weights + recipe state under output_dir/checkpoints/step_N, atomically, keeping `keep_last_n`.

    On several processes every rank writes its own shards instead (llm_recipe.components.checkpoint.sharded): no
    full gather per save; the final model is still one HF folder (`write_final_model`).
    """
    from llm_recipe.components.checkpoint.state import capture_rng

    state = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(), "rng": capture_rng(),
             RUN_ID_KEY: current_run_id(cfg.output_dir)}  # resume continues only checkpoints of this run
    if rt.world_size > 1:
        def write_meta(d: Path) -> None:
            (d / "config.json").write_text(json.dumps(args.to_hf_config(dtype=dtype_name(rt.dtype)), indent=2))
            copy_tokenizer_files(tokenizer_dir, d)

        return save_sharded_checkpoint(cfg.output_dir, step, model, optimizer, state, rt, write_meta,
                                       lora=lora_rank_alpha(model), keep_last_n=cfg.get("keep_last_n"))
    full = rt.full_state_dict(model)
    state["optimizer"] = rt.optimizer_state_dict(model, optimizer)
    if adapters:
        state["adapters"] = adapter_tensors(model, full)
    return save_checkpoint(
        cfg.output_dir, step,
        write_model=lambda d: save_model(model, args, d, tokenizer_dir, state_dict=merged_state_dict(model, full)),
        recipe_state=state, keep_last_n=cfg.get("keep_last_n"), runtime=rt,
    )


def write_final_model(cfg: DictConfig, rt: Runtime, model: nn.Module, args: ModelArgs, tokenizer_dir: str | Path,
                      lora: LoRASettings | None = None, base_model: str | None = None,
                      extra_files: dict[str, str] | None = None) -> Path:
    """output_dir/model (merged HF folder) and, for LoRA, output_dir/adapter (PEFT format)."""
    out = Path(cfg.output_dir)
    try:
        full = rt.full_state_dict(model)
        if rt.is_main:
            save_model(model, args, out / "model", tokenizer_dir, state_dict=merged_state_dict(model, full),
                       extra_files=extra_files)
            if lora is not None:
                save_peft_adapter(full, lora, out / "adapter", base_model=base_model)
    except (RuntimeError, MemoryError) as e:
        if is_out_of_memory(e):
            note_step(e, f"writing {out / 'model'}", None, rt.device)
        raise
    rt.barrier()
    return out / "model"


LossFn = Callable[[dict], dict[str, torch.Tensor]]


def train(cfg: DictConfig, rt: Runtime, model: nn.Module, args: ModelArgs, tokenizer_dir: str | Path, loader,
          optimizer, scheduler, steps: int, loss_fn: LossFn, start_step: int = 0, last_checkpoint: Path | None = None,
          adapters: bool = False, before_step: Callable[[int], None] | None = None,
          setup_log: SetupLog | None = None) -> int:
    """The optimizer loop every training recipe shares: accumulate, clip, step, log, checkpoint.

    `loss_fn(batch)` returns summed (not averaged) losses over the batch's target tokens: key "loss" is
    back-propagated, the others are logged as `<key>_loss`. Sums are divided by the target count of the whole
    accumulation window on all ranks, so the result does not depend on how tokens fall into micro-batches.
    `before_step(step)` runs before each optimizer step's forward passes (e.g. QAT's fake-quant switch).
    `setup_log` reports when the first optimizer step of this process is done, and what came before it.
    """
    accum = cfg.get("gradient_accumulation_steps", 1)
    save_every = cfg.get("save_every_n_steps")
    logger = MetricLogger(cfg.output_dir, steps, rt.is_main, cfg.get("tensorboard", False), cfg.get("wandb"),
                          start_step=start_step)
    clock = Throughput()
    step = start_step
    model.train()
    stop = StopRequest.install(enabled=rt.world_size == 1)  # Ctrl-C: checkpoint at the next step boundary
    note_training()
    # The bar and files close on errors too, so a NaN error starts on its own line and loss.png is drawn.
    # Where the loop is, for an out-of-memory message (components/oom.py): the step and micro-batch shape.
    where, shape = f"at step {step + 1}", None
    try:
        for window in windows(loader, accum):
            if step >= steps:
                break
            where = f"at step {step + 1}"
            if before_step is not None:
                before_step(step)
            clock.begin()
            n = count_targets(window, rt)
            totals: dict[str, torch.Tensor] = {}
            for batch in window:
                shape = list(batch["tokens"].shape)
                sums = loss_fn(to_device(batch, rt.device))
                (sums["loss"] / n * rt.world_size).backward()
                for k, v in sums.items():
                    totals[k] = totals.get(k, 0.0) + v.detach() / n
            values = step_values(totals, clip_gradients(model, cfg.get("max_grad_norm")), rt)
            check_finite(values["loss"], step + 1, last_checkpoint)
            optimizer_step(optimizer, scheduler)
            step += 1
            if setup_log is not None and step == start_step + 1:
                setup_log.first_step(time.perf_counter() - clock.start, compiled=bool(cfg.get("compile")))
            grad_norm = values.pop("grad_norm")
            logger.log(step, **{("loss" if k == "loss" else f"{k}_loss"): v for k, v in values.items()},
                       lr=scheduler.get_last_lr()[0], grad_norm=grad_norm, tokens_per_s=clock.rate(window, rt),
                       peak_memory_gib=rt.peak_memory_gib())
            where, shape = f"writing the checkpoint of step {step}", None
            if save_every and step % save_every == 0 and step < steps:
                last_checkpoint = save_training_checkpoint(cfg, rt, step, model, args, tokenizer_dir, optimizer,
                                                           scheduler, loader, adapters)
            if stop.requested:
                raise stop.interrupted(step, save_training_checkpoint(cfg, rt, step, model, args, tokenizer_dir,
                                                                      optimizer, scheduler, loader, adapters))
        where, shape = f"writing the checkpoint of step {step}", None
        save_training_checkpoint(cfg, rt, step, model, args, tokenizer_dir, optimizer, scheduler, loader, adapters)
    except (RuntimeError, MemoryError) as e:
        if is_out_of_memory(e):
            note_step(e, where, shape, rt.device)
        raise
    finally:
        stop.restore()
        logger.close()
    return step
