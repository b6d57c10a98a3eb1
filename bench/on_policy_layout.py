"""`python -m llm_recipe.cli.main ARGS` with on-policy KD's training micro-batches changed, for diagnosis rows of
bench/on_policy_speed.py. Why: on one H200 (session 56) an on-policy micro-batch of the shipped text row (~15
samples of 160 tokens, one per row: ~2,400 tokens) trained in about the time of a 4,096-token data micro-batch.
Every mode counts each micro-batch of a step as a data one (the loader's rows x max_seq_len), so tokens/s compares
step times across layouts:

- `steptime`: nothing else (the shipped layout: one sample per row, padded, or packed where that holds fewer tokens);
- `packed`: every on-policy micro-batch packed back into its training rows (the loader's shape, whose compiled
  graphs the data micro-batches already use), however many tokens that holds;
- `static`: the shipped layout, with Dynamo's automatic dynamic shapes off (and room for more recompiles): each
  on-policy shape gets a static graph, as the loader's shape has, instead of one graph with dynamic sizes.

    python bench/on_policy_layout.py steptime|packed|static run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch._dynamo

    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy
    from llm_recipe.components.training import Throughput

    how, args = sys.argv[1], sys.argv[2:]
    if how not in ("steptime", "packed", "static"):
        raise SystemExit(f"on_policy_layout.py: steptime, packed or static, not {how!r}")
    rate = Throughput.rate  # each micro-batch counted as the window's first data one (none: its first)
    Throughput.rate = lambda self, window, rt: rate(self, [next(
        (b for b in window if "prompt_lens" not in b), window[0])] * len(window), rt)
    if how == "packed":  # the padded layout's comparison loses: its `tokens` count as more than any packed batch
        padded = on_policy.completion_batch

        class _More:
            def numel(self) -> int:
                return 1 << 62

        on_policy.completion_batch = lambda *a, **k: {**padded(*a, **k), "tokens": _More()}
    if how == "static":
        torch._dynamo.config.automatic_dynamic_shapes = False
        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
    return recipe(args)


if __name__ == "__main__":
    sys.exit(main())
