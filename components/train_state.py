"""What a training run checkpoints and resumes from: `TrainState`, and where a run starts (new or resumed).

A recipe builds its model, loader, optimizer and schedule, bundles them in a `TrainState`, calls `restore(ckpt)`
when resuming and `save(step)` in its loop. A checkpoint is `output_dir/checkpoints/step_N/`: an HF folder
(config, weights, tokenizer) and `recipe_state/` (optimizer, schedule, data position, RNG, run id; the adapters
of a LoRA run), written atomically with a manifest of checksums (components/checkpoint). A run over several
processes writes DCP shards instead (components/checkpoint/sharded.py): no full gather per save.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from .checkpoint.manifest import verify_manifest
from .checkpoint.sharded import (
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
)
from .checkpoint.state import (
    STATE_DIR,
    capture_rng,
    latest_checkpoint,
    load_recipe_state,
    restore_rng,
    save_checkpoint,
)
from .errors import RecipeError
from .launch import is_rank0
from .models import ModelArgs, save_model
from .models.hf_io import copy_tokenizer_files
from .models.loader import dtype_name, lora_rank_alpha
from .oom import is_out_of_memory, note_step
from .runs import (
    RUN_ID_KEY,
    check_resume,
    check_resume_or_overwrite,
    current_run_id,
    previous_run,
    record_resume_changes,
    recover_killed_overwrite,
    start_run,
)
from .runtime import Runtime

if TYPE_CHECKING:
    from .train_config import TrainConfig


def start_or_resume_run(cfg: TrainConfig) -> Path | None:
    """Start the run in `output_dir` (llm_recipe.components.runs): a new run (`resume: false`) is refused when the
    folder holds an earlier run's outputs, unless `overwrite: true` deletes them, and writes run.json; returns None.
    With `resume: true`, the latest complete checkpoint (an error when there is none), its file checksums verified
    (an error naming the first corrupt file) and its run id the one of output_dir/run.json."""
    check_resume_or_overwrite(cfg)
    recover_killed_overwrite(cfg.output_dir)  # a killed overwrite=true run's setup left the earlier run aside
    if not cfg.resume:
        start_run(cfg)
        return None
    ckpt = latest_checkpoint(cfg.output_dir)
    if ckpt is None:
        fresh = "overwrite=true" if previous_run(cfg.output_dir) else "without resume"
        raise RecipeError(f"resume=true but {cfg.output_dir}/checkpoints has no complete checkpoint; "
                          f"run {fresh} to start fresh")
    verify_manifest(ckpt)
    check_run_length(cfg, ckpt)  # before check_resume prints the changed values it accepts
    check_resume(cfg, ckpt)
    if is_rank0():
        print(f"resuming from {ckpt} (file checksums verified)", flush=True)
    return ckpt


def resume_weights(ckpt: Path | None) -> Path | None:
    """The checkpoint when its folder holds HF weights to build the model from (one-process checkpoints),
    else None: a sharded checkpoint's weights are restored after sharding, by `TrainState.restore`."""
    return ckpt if ckpt is not None and not is_sharded_checkpoint(ckpt) else None


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters that train (LoRA: the adapter matrices and DoRA magnitudes)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def check_process_count(ckpt: Path, state: dict, world_size: int) -> None:
    """A checkpoint resumes on the process count that wrote it (each rank's data position and shards are its own):
    another count is one line saying how to relaunch, before any shard loads."""
    saved = int(state.get("loader", {}).get("world_size", world_size))
    if saved == world_size:
        return
    how = ("without torchrun options" if saved == 1 else
           f"as `recipe run --nproc-per-node {saved} --standalone <recipe> ...` (one machine)")
    raise RecipeError(f"{ckpt} was written by a run on {saved} process{'es' if saved > 1 else ''} and this one has "
                      f"{world_size}: resume=true continues on the same count; relaunch {how}, or start a new run "
                      "in another output_dir")


def _saved_int(ckpt: Path, *keys: str) -> int | None:
    """An integer of a checkpoint's recipe state read from its state.json alone (no tensors: `recipe run` checks
    it before torchrun starts the ranks), or None when it does not say."""
    try:
        value = json.loads((ckpt / STATE_DIR / "state.json").read_text())["state"]
        for key in keys:
            value = value[key]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def saved_process_count(ckpt: Path) -> int | None:
    """The process count a checkpoint was written on (its state.json), or None when it does not say."""
    return _saved_int(ckpt, "loader", "world_size")


def check_run_length(cfg: TrainConfig, ckpt: Path, steps: int | None = None) -> None:
    """A resumed run may keep or extend its length, not end before its checkpoint: a `max_steps` (or, with
    `steps`, the steps `epochs` gives) below the checkpoint's step is one line, before anything loads (the run
    would have written its step-N model again as the final one of a shorter run, and run.json would say so)."""
    step = _saved_int(ckpt, "step")
    steps = cfg.max_steps if steps is None else steps
    if step is None or steps is None or steps >= step:
        return
    from .config import config_source

    if cfg.max_steps is not None:
        what = f"{config_source(cfg).where('max_steps')}: key 'max_steps': {steps} is"
    else:
        what = f"max_steps: null with epochs={cfg.epochs} gives {steps} step{'s' if steps != 1 else ''},"
    raise RecipeError(f"{what} fewer than the {step} steps the run has already trained ({ckpt}): a resumed run "
                      f"continues to max_steps >= {step}; to stop at an earlier step, start a new run (overwrite=true "
                      "or another output_dir)")


@dataclass
class TrainState:
    """The model, optimizer, schedule and data loader of a run, and how to checkpoint them.

    `tokenizer_dir`: the tokenizer files copied into every checkpoint's HF folder. `adapters`: LoRA, whose
    checkpoints keep the adapter tensors in the recipe state (the HF folder holds merged weights; a resumed
    run rebuilds its base from model.checkpoint_dir). `last_checkpoint`: the newest one this run wrote or
    resumed from, named by the non-finite-loss error."""

    cfg: TrainConfig
    rt: Runtime
    model: nn.Module
    args: ModelArgs
    tokenizer_dir: str | Path
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    adapters: bool = False
    last_checkpoint: Path | None = None
    # the step `last_checkpoint` holds (restored or written by this process): a save at it again would rewrite the
    # same state (Ctrl-C on a save_every step, the final save of a resumed run with nothing left to train)
    saved_step: int | None = None
    # the newest checkpoint this process wrote (None: none yet; a resumed one is not): the final model may copy its
    # HF folder only when it holds exactly these weights, config and tokenizer (`final_checkpoint`)
    written: Path | None = None

    def save(self, step: int) -> Path:
        """Checkpoint the state after `step` optimizer steps into output_dir/checkpoints/step_N (atomically,
        keeping `keep_last_n`); every rank calls it. An out-of-memory error names the checkpoint it was writing."""
        if step == self.saved_step and self.last_checkpoint is not None:  # nothing trained since it was saved
            return self.last_checkpoint
        began = time.perf_counter()
        try:
            self.last_checkpoint, self.saved_step = self._write(step), step
            self.written = self.last_checkpoint
        except (RuntimeError, MemoryError) as e:
            if is_out_of_memory(e):
                note_step(e, f"writing the checkpoint of step {step}", None, self.rt.device)
            raise
        if self.rt.is_main:  # a 7B model's checkpoint takes tens of seconds: said, above the progress bar
            size = sum(f.stat().st_size for f in self.last_checkpoint.rglob("*") if f.is_file())
            tqdm.write(f"checkpoint: {self.last_checkpoint} ({size / 1e9:.2f} GB) written in "
                       f"{time.perf_counter() - began:.1f} s")
        return self.last_checkpoint

    def final_checkpoint(self) -> Path | None:
        """The checkpoint this process wrote at its last step, whose HF folder the final model may copy; None when
        the last one was resumed (a resume of a finished run writes model/ from its own base, dtype and code)."""
        return self.last_checkpoint if self.written == self.last_checkpoint else None

    def _write(self, step: int) -> Path:
        cfg, rt, model = self.cfg, self.rt, self.model
        state = {"step": step, "scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(),
                 "rng": capture_rng(),
                 RUN_ID_KEY: current_run_id(cfg.output_dir)}  # resume continues only checkpoints of this run
        if rt.world_size > 1:
            def write_meta(d: Path) -> None:
                (d / "config.json").write_text(json.dumps(self.args.to_hf_config(dtype=dtype_name(rt.dtype)),
                                                          indent=2))
                copy_tokenizer_files(self.tokenizer_dir, d)

            return save_sharded_checkpoint(cfg.output_dir, step, model, self.optimizer, state, rt, write_meta,
                                           lora=lora_rank_alpha(model), keep_last_n=cfg.keep_last_n)
        state["optimizer"] = rt.optimizer_state_dict(model, self.optimizer)
        if self.adapters:
            own = model.state_dict()
            state["adapters"] = {n: own[n] for n in trainable_names(model) if n in own}
        return save_checkpoint(
            cfg.output_dir, step,
            # streamed from the model's device, adapters merged there one module at a time (stream_save): no host
            # copy of the model (a 7B LoRA checkpoint on one H200: 36 -> 10 s, 30 -> 0.13 GB of host memory)
            write_model=lambda d: save_model(model, self.args, d, self.tokenizer_dir),
            recipe_state=state, keep_last_n=cfg.keep_last_n, runtime=rt,
        )

    def restore(self, ckpt: Path, steps: int) -> int:
        """Load optimizer, schedule, data position and RNG (and the adapters of a LoRA run) from `ckpt`; returns
        its step. A one-process checkpoint's full weights were loaded when the model was built (`resume_weights`);
        a sharded one's are loaded here, into the already sharded model. A checkpoint at the run's last step
        (`steps`) is said: nothing is left to train, only the final model is written again.

        The optimizer's moments and the schedule's position come from the checkpoint; its hyperparameters (lr,
        weight decay, betas, ...) and the schedule's shape stay the config's, which the resume check compared
        with the run's (components/resume_changes.py): an accepted change (`resume_with_changes`, a longer
        `max_steps`) takes effect, and an unchanged config gives the checkpoint's values bit for bit."""
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        schedule = [dict(vars(f)) for f in self.scheduler.lr_lambdas]
        base_lrs = list(self.scheduler.base_lrs)
        state = load_recipe_state(ckpt)
        check_process_count(ckpt, state, self.rt.world_size)
        check_run_length(self.cfg, ckpt, steps)  # `epochs`' step count is known once the data has loaded
        try:
            self._load_weights_and_optimizer(ckpt, state)
        except (RuntimeError, ValueError, KeyError) as e:  # a checkpoint of another shape: one line, not a traceback
            if is_out_of_memory(e):
                raise
            lines = str(e).strip().splitlines()  # torch's size mismatches: a heading, then one line per tensor
            raise RecipeError(f"{ckpt}: the checkpoint does not fit the model or optimizer this config builds "
                              f"({lines[-1].strip() if lines else type(e).__name__}); resume with the values the run "
                              "started with (run.json), or start a new run") from None
        self.scheduler.load_state_dict(state["scheduler"])
        for group, values in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(values)
        for f, values in zip(self.scheduler.lr_lambdas, schedule, strict=True):
            vars(f).update(values)
        self.scheduler.base_lrs = base_lrs
        step = self.scheduler.last_epoch  # LambdaLR's lr at its position, as its step() computes it
        for group, base, f in zip(self.optimizer.param_groups, base_lrs, self.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * f(step)
        # a copy, as LambdaLR keeps it: torchao's low-bit AdamWs hold lr as a tensor that the next step() fills in
        # place, so an alias would make the step's logged lr the following step's
        self.scheduler._last_lr = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                                   for g in self.optimizer.param_groups]
        self.loader.load_state_dict(state["loader"])
        restore_rng(state["rng"])
        self.last_checkpoint = ckpt
        record_resume_changes(self.cfg, ckpt.name)  # loaded: now run.json records what this resume changed
        self.saved_step = int(state["step"])
        if self.saved_step >= steps and is_rank0():
            print(f"resume: {ckpt.name} is step {self.saved_step} of {steps}, the run's last: nothing left to "
                  "train; the final model is written again (a larger max_steps trains on)", flush=True)
        return self.saved_step

    def _load_weights_and_optimizer(self, ckpt: Path, state: dict) -> None:
        # a sharded checkpoint's weights and optimizer (DCP shards), or a one-process one's adapters and optimizer
        if is_sharded_checkpoint(ckpt):  # written by a run over several processes: weights + optimizer in DCP shards
            load_sharded_checkpoint(ckpt, self.model, self.optimizer, state)
            return
        if self.adapters:
            names = trainable_names(self.model)
            missing = set(names) - set(state["adapters"])
            if missing:
                raise RecipeError(f"{ckpt}: the checkpoint has no adapter weights for {sorted(missing)[:3]} "
                                  "(was it written with different lora settings?)")
            # Through the runtime: under FSDP each rank keeps its own shard of the saved full tensors.
            self.rt.load_full_state_dict(self.model, {n: state["adapters"][n] for n in names}, strict=False)
        self.rt.load_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
