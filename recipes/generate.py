"""Generate text from a model folder: chat template for instruct models, KV cache, streaming to stdout.

Works on float, LoRA-merged, QAT-converted and torchao-quantized folders (loaded like the eval recipe).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models.generation import generate
from llm_recipe.components.models.loader import DTYPES
from llm_recipe.components.quantization import load_checkpoint
from llm_recipe.components.schema import DEVICE, Choice, Pattern, Range
from llm_recipe.components.settings import REQUIRED, section, setting
from llm_recipe.components.train_config import SEED, ModelSection


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """The generate recipe's keys."""

    model: ModelSection = section(ModelSection, "the model that generates")
    prompt: str = setting(REQUIRED, Pattern(r"(?s).*\S.*", "some text (not empty)"),
                          "the user message (or raw text when chat is false)")
    chat: bool = setting(True, bool, "wrap the prompt in the model's chat template (if it has one)")
    system: str | None = setting(None, (str, type(None)), "optional system message")
    max_new_tokens: int = setting(128, Range(int, ge=1), "stop after this many new tokens (or at an end-of-turn "
                                  "token)")
    temperature: float = setting(0.0, Range(float, ge=0), "0: greedy; > 0: sample")
    top_k: int | None = setting(None, Range(int, ge=1, optional=True), "sample from the k most likely tokens")
    top_p: float | None = setting(None, Range(float, gt=0, le=1, optional=True), "nucleus sampling: smallest set "
                                  "with this much probability mass")
    device: str = setting("auto", DEVICE, "auto | cpu | cuda | cuda:N")
    dtype: str = setting("float32", Choice(*DTYPES), "float32 (fp32) | bfloat16 (bf16) | float16 (fp16), for float folders")
    seed: int = setting(0, SEED, "sampling seed")


CONFIG = GenerateConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys generate`)


def main(cfg: GenerateConfig) -> None:
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    model, tokenizer = load_checkpoint(cfg.model.checkpoint_dir, dtype=cfg.dtype, device=device)
    model.eval()

    # Instruct models get their chat template; base models (no template) see the raw prompt.
    text = cfg.prompt
    if cfg.chat and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": cfg.system}] if cfg.system else []
        messages.append({"role": "user", "content": cfg.prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_bos=True)
    context = getattr(model, "max_seq_len", None)  # the positions its rotary table covers
    if context is not None and len(prompt) + cfg.max_new_tokens > context:
        raise RecipeError(f"max_new_tokens={cfg.max_new_tokens}: the prompt ({len(prompt)} tokens) and that many "
                          f"new ones exceed the model's context of {context} tokens; set max_new_tokens <= "
                          f"{max(context - len(prompt), 0)}")

    # Stream: decode everything so far and print only the new suffix (multi-byte characters stay whole).
    out: list[int] = []
    shown = ""

    def on_token(tok: int) -> None:
        nonlocal shown
        out.append(tok)
        now = tokenizer.decode(out)
        if not now.endswith("\ufffd"):
            sys.stdout.write(now[len(shown):])
            sys.stdout.flush()
            shown = now

    start = time.perf_counter()
    generate(model, prompt, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
             stop_ids=tokenizer.stop_ids, seed=cfg.seed, on_token=on_token)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if not shown.strip() and out and out[-1] in tokenizer.stop_ids:  # an empty answer is not a silent mystery
        print(f"note: the model ended its answer with a stop token (id {out[-1]}) before any "
              "text" + (" (chat=false: an instruct model sees the raw prompt, not the chat template it was trained "
                        "on)" if not cfg.chat and tokenizer.has_chat_template else ""), file=sys.stderr)
    print(f"[{len(out)} tokens in {elapsed:.1f}s, {len(out) / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)


if __name__ == "__main__":
    run_recipe_script(GenerateConfig, main)
