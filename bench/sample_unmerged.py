"""`python -m llm_recipe.cli.main ARGS` with on-policy KD's LoRA adapters left in the decode step, as the kd recipe
sampled before session 61 (one GPU) and 62 (several): a diagnosis row of bench/on_policy_speed.py (`..._unmerged`),
the same run without the merged sampling copy (components/merged_sampler.py) and with the sampling twin's adapters
unmerged (components/sampling_twin.py), so one call measures what merging buys. The patch lives in this process:
for several processes, launch each rank with it (`torchrun ... bench/sample_unmerged.py run kd ...`).

    python bench/sample_unmerged.py run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy, sampling_twin

    on_policy.make_merged = lambda *args, **kwargs: (None, None)
    sampling_twin.mergeable = lambda model: {}
    return recipe(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
