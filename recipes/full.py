"""Full fine-tuning: every weight trains on next-token cross-entropy.

setup (runtime, tokenizer, model, data, optimizer, resume) -> loop (llm_recipe.components.training.train: accumulate,
clip, step, log, checkpoint) -> final HF folder in output_dir/model.
"""

from __future__ import annotations

from omegaconf import DictConfig

from llm_recipe.components.config import run_recipe_script
from llm_recipe.components.models import load_model
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.schema import ModelDir
from llm_recipe.components.setup_log import SetupLog
from llm_recipe.components.training import (
    TRAIN_SCHEMA,
    lm_loss_sum,
    load_tokenizer,
    micro_batch_tokens,
    resume_weights,
    setup_training,
    start_or_resume_run,
    train,
    write_final_model,
)

SCHEMA = {**TRAIN_SCHEMA, "model": {"checkpoint_dir": ModelDir()}}


def main(cfg: DictConfig) -> None:
    rt = setup_runtime(cfg.get("device", "auto"), cfg.get("dtype", "bf16"), cfg.get("seed", 0))
    base_dir = cfg.model.checkpoint_dir
    tokenizer = load_tokenizer(base_dir)

    # Full fine-tuning resumes from the checkpoint's own weights (saved in the training dtype).
    resume_from = start_or_resume_run(cfg)
    setup = SetupLog(rt.is_main)  # says what setup is doing and how long each part takes
    with setup.phase("weights"):
        model, args = load_model(resume_weights(resume_from) or base_dir, dtype=rt.dtype, device=rt.build_device, max_seq_len=cfg.dataset.max_seq_len)
        rt.prepare_model(model, activation_checkpointing=cfg.get("activation_checkpointing", False),
                         compile=cfg.get("compile", False), micro_batch_tokens=micro_batch_tokens(cfg))

    with setup.phase("data and optimizer"):
        loader, steps, optimizer, scheduler, start = setup_training(cfg, rt, model, tokenizer, resume_from,
                                                                     adapters=False)

    # The loss: summed next-token cross-entropy, the output projection applied chunk by chunk.
    chunks = cfg.get("num_output_chunks", 8)

    def loss_fn(batch: dict) -> dict:
        return {"loss": lm_loss_sum(model, batch, chunks)}

    train(cfg, rt, model, args, base_dir, loader, optimizer, scheduler, steps, loss_fn, start, resume_from, setup_log=setup)
    final = write_final_model(cfg, rt, model, args, base_dir)
    if rt.is_main:
        print(f"model: {final}\nmetrics: {cfg.output_dir}/metrics.jsonl\nloss plot: {cfg.output_dir}/loss.png")
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
