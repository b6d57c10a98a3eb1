"""`python -m llm_recipe.cli.main ARGS` with on-policy KD sampling each micro-batch alone, as the kd recipe did
before session 51: a diagnosis row of bench/on_policy_speed.py (`onpolicy_compiled_alone`), the same run with
`sampling_groups` giving every on-policy micro-batch a sampling loop of its own (StaticDecode then pads to the old
batch_size x prompts_per_row rows: the old shapes exactly).

    python bench/sample_alone.py run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy

    on_policy.sampling_groups = lambda sizes, max_rows, max_tokens: [[i] for i in range(len(sizes))]
    return recipe(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
