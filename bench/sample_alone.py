"""`python -m llm_recipe.cli.main ARGS` with on-policy KD sampling each micro-batch alone, as the kd recipe did
before session 51: a diagnosis row of bench/on_policy_speed.py (`onpolicy_compiled_alone`), the same run with
`sampling_groups` giving every on-policy micro-batch a sampling loop of its own and StaticDecode padding it to the
old batch_size x prompts_per_row rows (the old decode shapes exactly; the samples train packed, as now).

    python bench/sample_alone.py run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy

    on_policy.sampling_groups = lambda sizes, *_: [[i] for i in range(len(sizes))]
    init = on_policy.OnPolicy.__init__

    def fixed_rows(self, *args, **kwargs) -> None:  # batch_size x prompts_per_row decode rows, whatever the width
        init(self, *args, **kwargs)
        if self.static is not None:
            self.static.rows = lambda n, total: self.rows

    on_policy.OnPolicy.__init__ = fixed_rows
    return recipe(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
