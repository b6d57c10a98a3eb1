"""Generate text from a model folder: chat template for instruct models, KV cache, streaming to stdout.

Works on float, LoRA-merged, QAT-converted and torchao-quantized folders (loaded like the eval recipe).
"""

from __future__ import annotations

import sys
import time

import torch
from omegaconf import DictConfig

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.models.generation import generate
from llm_recipe.components.models.loader import DTYPES
from llm_recipe.components.quantization import load_checkpoint
from llm_recipe.components.schema import DEVICE, Choice, ModelDir, Range

SCHEMA = {
    "model": {"checkpoint_dir": ModelDir()},
    "prompt": str,
    "chat": bool,
    "system": (str, type(None)),
    "max_new_tokens": Range(int, ge=1),
    "temperature": Range(float, ge=0),  # 0: greedy
    "top_k": Range(int, ge=1, optional=True),
    "top_p": Range(float, gt=0, le=1, optional=True),
    "device": DEVICE,
    "dtype": Choice(*DTYPES),
    "seed": Range(int, ge=0),
}


def main(cfg: DictConfig) -> None:
    device = cfg.get("device", "auto")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model, tokenizer = load_checkpoint(cfg.model.checkpoint_dir, dtype=cfg.get("dtype", "float32"), device=device)
    model.eval()

    # Instruct models get their chat template; base models (no template) see the raw prompt.
    text = cfg.prompt
    if cfg.get("chat", True) and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": cfg.system}] if cfg.get("system") else []
        messages.append({"role": "user", "content": cfg.prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_bos=True)

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
    generate(model, prompt, cfg.get("max_new_tokens", 128), temperature=cfg.get("temperature", 0.0),
             top_k=cfg.get("top_k"), top_p=cfg.get("top_p"), stop_ids=tokenizer.stop_ids, seed=cfg.get("seed", 0),
             on_token=on_token)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[{len(out)} tokens in {elapsed:.1f}s, {len(out) / max(elapsed, 1e-9):.1f} tokens/s]", file=sys.stderr)


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
