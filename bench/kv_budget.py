"""`python -m llm_recipe.cli.main ARGS` with on-policy KD's decode KV caches as before session 53, for diagnosis
rows of bench/on_policy_speed.py:

- `..._kvmicro`: a sampling group's KV caches span at most one micro-batch's prompts (batch_size x prompts_per_row
  x max_seq_len positions), as before; now, on one GPU, a whole step's when memory allows
  (components/memory.py: `sampling_kv_positions`);
- `..._kvsets`: the same, and a set of KV caches per decode shape, as before (now every shape's caches are views of
  one buffer per layer).

    python bench/kv_budget.py kvmicro|kvsets run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy

    how, args = sys.argv[1], sys.argv[2:]
    if how not in ("kvmicro", "kvsets"):
        raise SystemExit(f"kv_budget.py: kvmicro or kvsets, not {how!r}")
    on_policy.sampling_kv_positions = lambda model, micro, *_: (micro, f"{micro} positions ({how}: bench/kv_budget.py)")
    init = on_policy.OnPolicy.__init__

    def patched(self, *a, **k) -> None:
        init(self, *a, **k)
        if how == "kvsets" and self.static is not None:
            self.static.kv_positions = None

    on_policy.OnPolicy.__init__ = patched
    return recipe(args)


if __name__ == "__main__":
    sys.exit(main())
