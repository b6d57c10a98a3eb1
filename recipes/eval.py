"""Evaluate a model folder with the lm-eval harness (our `recipe` model; offline task pack or stock tasks).

Works on float, LoRA-merged, QAT (`quantization.json`) and torchao-quantized folders. Prints lm-eval's table
and writes output_dir/results.json.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.eval.run import evaluate
from llm_recipe.components.models.loader import DTYPES
from llm_recipe.components.schema import DEVICE, Choice, ListOf, ModelDir, OutputDir, Range

SCHEMA = {
    "model": {"checkpoint_dir": ModelDir()},
    "tasks": ListOf(str, min_len=1),
    "limit": Range(float, gt=0, optional=True),  # lm-eval: a count of items, or a fraction of each task below 1
    "num_fewshot": Range(int, ge=0, optional=True),
    "batch_size": Range(int, ge=1),
    "max_length": Range(int, ge=2, optional=True),
    "apply_chat_template": bool,
    "log_samples": bool,
    "device": DEVICE,
    "dtype": Choice(*DTYPES),
    "seed": Range(int, ge=0),
    "output_dir": OutputDir(),
}


def main(cfg: DictConfig) -> None:
    device = cfg.get("device", "auto")
    evaluate(
        cfg.model.checkpoint_dir,
        tasks=list(OmegaConf.to_container(cfg.tasks)),
        limit=cfg.get("limit"),
        num_fewshot=cfg.get("num_fewshot"),
        batch_size=cfg.get("batch_size", 8),
        apply_chat_template=cfg.get("apply_chat_template", False),
        output_dir=cfg.get("output_dir"),
        seed=cfg.get("seed", 1234),
        device=None if device == "auto" else device,
        dtype=cfg.get("dtype", "float32"),
        max_length=cfg.get("max_length"),
        log_samples=cfg.get("log_samples", False),
    )
    print(f"results: {cfg.output_dir}/results.json")


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
