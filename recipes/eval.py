"""Evaluate a model folder with the lm-eval harness (our `recipe` model; offline task pack or stock tasks).

Works on float, LoRA-merged, QAT (`quantization.json`) and torchao-quantized folders. Prints lm-eval's table
and writes output_dir/results.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.eval.run import evaluate
from llm_recipe.components.launch import is_rank0
from llm_recipe.components.models.loader import DTYPES, dtype_name
from llm_recipe.components.result_runs import RECORD_KEY, check_rerun, run_identity, writing_run
from llm_recipe.components.schema import DEVICE, Choice, ListOf, OutputDir, Range
from llm_recipe.components.settings import REQUIRED, section, setting
from llm_recipe.components.train_config import SEED, ModelSection


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The eval recipe's keys."""

    model: ModelSection = section(ModelSection, "the model to score")
    tasks: tuple[str, ...] = setting(REQUIRED, ListOf(str, min_len=1), "offline pack (recipe_*) or stock lm-eval "
                                     "task names")
    limit: float | None = setting(None, Range(float, gt=0, optional=True), "items per task (null: all; below 1: a "
                                  "fraction of each task)")
    num_fewshot: int | None = setting(None, Range(int, ge=0, optional=True), "null: the task's default")
    batch_size: int = setting(8, Range(int, ge=1), "loglikelihood requests per forward pass")
    max_length: int | None = setting(None, Range(int, ge=2, optional=True), "context window for scoring (null: the "
                                     "model's max_position_embeddings)")
    apply_chat_template: bool = setting(False, bool, "wrap prompts in the model's chat template")
    log_samples: bool = setting(False, bool, "also write per-item samples into results.json")
    device: str = setting("auto", DEVICE, "auto | cpu | cuda | cuda:N")
    dtype: str = setting("float32", Choice(*DTYPES), "float32 (fp32) | bfloat16 (bf16) | float16 (fp16) (float "
                         "models; quantized folders keep their types)")
    seed: int = setting(1234, SEED, "lm-eval's python/numpy/torch/few-shot seeds")
    output_dir: str | None = setting(None, OutputDir(optional=True), "results.json goes here (null: "
                                    "printed only)")
    overwrite: bool = setting(False, bool, "replace results.json of an earlier eval of another model, weights or "
                              "settings in output_dir (a rerun of the same one writes again without it)")

    def check(self) -> None:
        """A limit of 1 or more counts items, so it must be whole (lm-eval would cut 2.5 to 2 without a word)."""
        if self.limit is not None and self.limit >= 1 and self.limit != int(self.limit):
            raise RecipeError(f"limit: {self.limit} is not a whole number of items per task (below 1 it is a "
                              "fraction of each task)")


CONFIG = EvalConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys eval`)


def main(cfg: EvalConfig) -> None:
    # one evaluation per folder: the same one again rewrites results.json, another is refused (or overwrite=true);
    # the same scores whatever the tasks' order or the dtype's spelling
    identity = run_identity(cfg.model.checkpoint_dir, tasks=sorted(cfg.tasks), limit=cfg.limit,
                            num_fewshot=cfg.num_fewshot, max_length=cfg.max_length,
                            apply_chat_template=cfg.apply_chat_template, seed=cfg.seed,
                            dtype=dtype_name(DTYPES[cfg.dtype]))
    if cfg.output_dir is not None and is_rank0():  # under torchrun only rank 0 writes results.json
        check_rerun("eval", cfg.output_dir, "eval", "results.json", identity, cfg.overwrite)
    if is_rank0():  # what is scored, before lm-eval's own progress output (its task loading prints a bar per split)
        limit = "all items" if cfg.limit is None else (f"{int(cfg.limit)} items per task" if cfg.limit >= 1
                                                       else f"{cfg.limit:g} of each task")
        print(f"eval: {cfg.model.checkpoint_dir} on {', '.join(cfg.tasks)} ({limit})", flush=True)
    with writing_run(cfg.output_dir, "eval", identity, cfg.overwrite):
        evaluate(cfg.model.checkpoint_dir, tasks=list(cfg.tasks), limit=cfg.limit, num_fewshot=cfg.num_fewshot,
                 batch_size=cfg.batch_size, apply_chat_template=cfg.apply_chat_template, output_dir=cfg.output_dir,
                 seed=cfg.seed, device=None if cfg.device == "auto" else cfg.device, dtype=cfg.dtype,
                 max_length=cfg.max_length, log_samples=cfg.log_samples, record={RECORD_KEY: identity},
                 resume_key=identity)  # interrupted, the same command continues from the answers kept
    if cfg.output_dir is not None and is_rank0():
        print(f"results: {cfg.output_dir}/results.json")


if __name__ == "__main__":
    run_recipe_script(EvalConfig, main)
