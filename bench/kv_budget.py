"""`python -m llm_recipe.cli.main ARGS` with on-policy KD's decode KV caches changed, for diagnosis rows of
bench/on_policy_speed.py:

- `..._kvsets`: a set of KV caches per decode shape, as before session 53 (now every shape's caches are views of
  one buffer per layer): what sharing them saves in peak memory with chat prompts of several widths;
- `..._kv4`: 4x the KV positions a sampling group may span (`OnPolicy.max_tokens`, shipped: batch_size x
  prompts_per_row x max_seq_len): fewer, larger groups of long prompts per step, each one decode loop, for 4x the
  KV memory.

    python bench/kv_budget.py kvsets|kv4 run kd --config ...
"""

from __future__ import annotations

import sys


def main() -> int:
    from llm_recipe.cli.main import main as recipe
    from llm_recipe.components import on_policy

    how, args = sys.argv[1], sys.argv[2:]
    init = on_policy.OnPolicy.__init__

    def patched(self, *a, **k) -> None:
        init(self, *a, **k)
        if self.static is None:
            return
        if how == "kvsets":
            self.static.kv_positions = None
        elif how == "kv4":
            self.max_tokens *= 4
            self.static.max_tokens = self.max_tokens
            self.static.kv_positions = min(self.max_tokens,
                                           self.static.batch * (self.static.max_width + self.s.max_new_tokens))
        else:
            raise SystemExit(f"kv_budget.py: kvsets or kv4, not {how!r}")

    on_policy.OnPolicy.__init__ = patched
    return recipe(args)


if __name__ == "__main__":
    sys.exit(main())
