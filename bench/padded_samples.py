"""`python -m llm_recipe.cli.main ARGS` with on-policy KD training each sample in a row of its own, padded to the
longest, as the kd recipe did before session 52 (now a training row's samples are packed back into that row): a
diagnosis row of bench/on_policy_speed.py (`onpolicy_compiled_chat_padded`); sampling is as now. Its tokens/s counts
every micro-batch as an off-policy one of the same window (the packed layout's rows x max_seq_len), not the padded
rows' tokens, so that tokens/s compares step times with the packed rows'.

    python bench/padded_samples.py run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy
    from llm_recipe.components.training import Throughput

    rate = Throughput.rate
    Throughput.rate = lambda self, window, rt: rate(
        self, [next(b for b in window if "prompt_lens" not in b)] * len(window), rt)
    on_policy.packed_completion_batch = (
        lambda prompts, completions, pad_id, *_: on_policy.completion_batch(prompts, completions, pad_id))
    return recipe(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
