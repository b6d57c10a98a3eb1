"""LoRA / DoRA / QLoRA fine-tuning: the base stays frozen (NF4-quantized for QLoRA), low-rank adapters train.

setup (runtime, tokenizer, base + adapters, data, optimizer, resume) -> loop (llm_recipe.components.training.train)
-> output_dir/model (adapters merged, a plain HF folder) and output_dir/adapter (PEFT format).
"""

from __future__ import annotations

from omegaconf import DictConfig

from llm_recipe.components.config import run_recipe_script
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import load_model
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.schema import ModelDir
from llm_recipe.components.setup_log import SetupLog
from llm_recipe.components.training import (
    LORA_SCHEMA,
    TRAIN_SCHEMA,
    freeze_all_but_adapters,
    lm_loss_sum,
    load_tokenizer,
    lora_settings,
    micro_batch_tokens,
    setup_training,
    start_or_resume_run,
    train,
    write_final_model,
)

SCHEMA = {**TRAIN_SCHEMA, "model": {"checkpoint_dir": ModelDir()}, "lora": LORA_SCHEMA}


def main(cfg: DictConfig) -> None:
    rt = setup_runtime(cfg.get("device", "auto"), cfg.get("dtype", "bf16"), cfg.get("seed", 0))
    base_dir = cfg.model.checkpoint_dir
    tokenizer = load_tokenizer(base_dir)
    lora = lora_settings(cfg.get("lora"))
    if lora is None:
        raise RecipeError("lora: the lora recipe needs a lora section (rank, alpha, targets, ...)")

    # The base always comes from model.checkpoint_dir; a resumed run restores only the adapters.
    resume_from = start_or_resume_run(cfg)
    setup = SetupLog(rt.is_main)  # says what setup is doing and how long each part takes
    with setup.phase("weights"):
        model, args = load_model(base_dir, dtype=rt.dtype, device=rt.build_device, lora=lora, max_seq_len=cfg.dataset.max_seq_len)
        freeze_all_but_adapters(model)
        rt.prepare_model(model, activation_checkpointing=cfg.get("activation_checkpointing", False),
                         compile=cfg.get("compile", False), micro_batch_tokens=micro_batch_tokens(cfg))

    with setup.phase("data and optimizer"):
        loader, steps, optimizer, scheduler, start = setup_training(cfg, rt, model, tokenizer, resume_from,
                                                                     adapters=True)

    # The loss: summed next-token cross-entropy, the output projection applied chunk by chunk.
    chunks = cfg.get("num_output_chunks", 8)

    def loss_fn(batch: dict) -> dict:
        return {"loss": lm_loss_sum(model, batch, chunks)}

    train(cfg, rt, model, args, base_dir, loader, optimizer, scheduler, steps, loss_fn, start, resume_from,
          adapters=True, setup_log=setup)
    final = write_final_model(cfg, rt, model, args, base_dir, lora=lora, base_model=str(base_dir))
    if rt.is_main:
        print(f"model (merged): {final}\nadapter (PEFT): {cfg.output_dir}/adapter\n"
              f"metrics: {cfg.output_dir}/metrics.jsonl\nloss plot: {cfg.output_dir}/loss.png")
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
