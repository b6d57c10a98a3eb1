"""The keys every training recipe reads (`TrainConfig`: output folder, runtime, data, optimizer, schedule, loop,
checkpoints, logging) and the keys other recipes share with it (`output_dir_key`, `seed_key`, ..., `ModelSection`).

Recipes extend `TrainConfig` with their model and loss sections (recipes/full.py: `FullConfig`, recipes/kd.py:
`KDConfig`); components read the typed values (components/training.py, train_state.py, runs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .component import COMPONENT
from .data.dataset import DatasetConfig
from .optim import SCHEDULERS
from .runtime import DTYPES
from .schema import DEVICE, Choice, ListOf, ModelDir, OutputDir, Range
from .settings import REQUIRED, section, setting

# A torch/torchao optimizer class (nothing else is imported for a config); the arguments of AdamW-style
# optimizers whose range is known are checked, others bind to the signature only.
OPTIMIZER = COMPONENT(allow=("torch.optim.", "torchao.optim.", "llm_recipe.components.optim."), lr=Range(float, gt=0),
                      weight_decay=Range(float, ge=0), eps=Range(float, gt=0),
                      betas=ListOf(Range(float, ge=0, lt=1), min_len=2, max_len=2),
                      block_size=Range(int, ge=1), bucket_numel=Range(int, ge=1), minimal_size=Range(int, ge=0))


# The run keys several recipes read, each declared once here.
def output_dir_key(doc: str = "checkpoints/, model/, metrics.jsonl, loss.png go here") -> Any:
    """`output_dir:` (required): where the run writes (`doc`: what goes there); `recipe run` checks and locks it."""
    return setting(REQUIRED, OutputDir(), doc)


SEED = Range(int, ge=0, le=2**32 - 1)  # every recipe's seed: numpy's seeds stop at 2^32 - 1


def seed_key() -> Any:
    """`seed:` (0): seeds python, numpy and torch on every rank."""
    return setting(0, SEED, "seeds python, numpy and torch on every rank (numpy takes 0 .. 2^32 - 1)")


def device_key() -> Any:
    """`device:` (auto)."""
    return setting("auto", DEVICE, "auto (cuda if available) | cpu | cuda | cuda:N")


def dtype_key() -> Any:
    """`dtype:` (bf16): the training / inference dtype of components/runtime.py."""
    return setting("bf16", Choice(*DTYPES), "bf16 | fp32 | fp16 (bf16 falls back to fp32 on CPU)")


def compile_key(doc: str = "torch.compile each transformer layer") -> Any:
    """`compile:` (false)."""
    return setting(False, bool, doc)


def batch_size_key() -> Any:
    """`batch_size:` (4) of a training-shaped recipe."""
    return setting(4, Range(int, ge=1), "micro-batch size per device")


def num_output_chunks_key(doc: str = "output projection + losses computed in this many sequence chunks") -> Any:
    """`num_output_chunks:` (8); `doc` for a recipe whose chunks hold something else (kd_logits: no loss)."""
    return setting(8, Range(int, ge=1), doc)


@dataclass(frozen=True, kw_only=True)
class ModelSection:
    """The `model:` section of the recipes that read one model folder (full, eval, generate, quantize)."""

    checkpoint_dir: str = setting(REQUIRED, ModelDir(), "a Hugging Face folder (config.json + safetensors + "
                                  "tokenizer) of any model we wrote")


@dataclass(frozen=True, kw_only=True)
class LRScheduler:
    """The `lr_scheduler:` section (null: these defaults)."""

    name: str = setting("cosine", Choice(*SCHEDULERS), "cosine | linear | constant")
    warmup_steps: int = setting(0, Range(int, ge=0), "linear warmup from 0 over this many optimizer steps")
    min_lr_ratio: float = setting(0.0, Range(float, ge=0, le=1), "final lr = min_lr_ratio * lr")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Keys every training recipe reads; recipes add their model/loss sections in a subclass."""

    output_dir: str = output_dir_key()
    seed: int = seed_key()
    device: str = device_key()
    dtype: str = dtype_key()
    max_steps: int | None = setting(None, Range(int, ge=1, optional=True), "optimizer steps (null: run `epochs`)")
    epochs: int = setting(1, Range(int, ge=1), "passes over the data when max_steps is null")
    batch_size: int = batch_size_key()
    gradient_accumulation_steps: int = setting(1, Range(int, ge=1), "micro-batches per optimizer step")
    max_grad_norm: float | None = setting(None, Range(float, gt=0, optional=True), "clip gradients to this norm "
                                          "(null: no clipping)")
    optimizer: dict = setting(REQUIRED, OPTIMIZER, "{_component_: torch.optim.AdamW, lr: ...} or a torchao optimizer")
    lr_scheduler: LRScheduler = section(LRScheduler, "the learning-rate schedule")
    dataset: DatasetConfig = section(DatasetConfig, "the training data")
    num_output_chunks: int = num_output_chunks_key()
    activation_checkpointing: bool | str = setting(False, Choice(True, False, "auto"), "recompute each layer in "
                                                   "backward: less memory, slower (auto: when memory needs it)")
    compile: bool = compile_key()
    save_every_n_steps: int | None = setting(None, Range(int, ge=1, optional=True), "checkpoint cadence (null: "
                                             "only at the end)")
    keep_last_n: int | None = setting(None, Range(int, ge=1, optional=True), "keep this many newest checkpoints "
                                      "(null: all)")
    resume: bool = setting(False, bool, "continue from the latest complete checkpoint in output_dir")
    overwrite: bool = setting(False, bool, "a new run deletes the outputs of an earlier run in output_dir first")
    resume_with_changes: bool = setting(False, bool, "resume=true may continue with values other than the run "
                                        "started with (they are printed and recorded in run.json)")
    tensorboard: bool = setting(False, bool, "also log to output_dir/tensorboard (needs the tensorboard package)")
    wandb: dict | None = setting(None, (dict, type(None)), "e.g. {project: my-project}: log to Weights & Biases "
                                 "(needs wandb)")
