"""One Inductor heuristic changed for what we compile on CUDA: rows up to 16,384 wide reduce in one pass.

Inductor reduces a row in one pass (the whole row in registers: a persistent reduction) only up to 1,024 columns;
wider rows take a looped kernel that reads the row once per reduction and once more for the output. The fp8
teacher's activation quantization is such a kernel: the amax of each 14,336-wide down-projection input (fused with
SiLU x up) and of each 4,096-wide RMSNorm output, then the scaled fp8 write, so those rows were read two or three
times (170 us per down-projection input on the H200 where one read and write take ~70 us). With rows up to 16,384
in one pass, the shipped 8B -> 1B LoRA KD step ran 2.1% faster, 2.3% with the fp8 student base (docs/benchmarks.md,
session 31). Installed through Inductor's own seam for heuristics (``config.inductor_choices_class``, an
``InductorChoices`` subclass, with a ``uuid`` for its compile cache), when a recipe compiles on CUDA, not at import.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["WIDEST_ONE_PASS_ROW", "one_pass_row_choices", "use_one_pass_row_reductions"]

WIDEST_ONE_PASS_ROW = 16_384  # the 8B's MLP width (14,336) fits; the 128,256-wide logits stay looped


@functools.cache
def _choices_class() -> type:
    """The ``InductorChoices`` subclass (defined on first use: torch._inductor is not imported before a compile)."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class OnePassRowReductions(InductorChoices):
        """Inner (row) reductions up to ``WIDEST_ONE_PASS_ROW`` columns are persistent; the rest as Inductor
        decides."""

        @staticmethod
        def should_use_persistent_reduction(features: Any, cooperative_reduction: bool) -> bool:
            if (config.triton.persistent_reductions and not cooperative_reduction
                    and features.get_reduction_hint() == ReductionHint.INNER
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, WIDEST_ONE_PASS_ROW)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)

        def uuid(self) -> str:  # part of Inductor's cache key: graphs compiled without it are not reused
            return f"llm_recipe.OnePassRowReductions.{WIDEST_ONE_PASS_ROW}"

    return OnePassRowReductions


def one_pass_row_choices() -> Any:
    """The heuristic as Inductor's config holds it: a factory at module level, so that Inductor's cache key can
    pickle it by name (torch 2.11 pickles the config value; a class defined in a function cannot be pickled, and
    every graph then bypassed the compile cache)."""
    return _choices_class()()


def use_one_pass_row_reductions() -> None:
    """Make the heuristic Inductor's for every later compile in this process (idempotent). Threads that already
    compiled keep theirs (Inductor's handler is per thread): recipes install it before their first compile."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    config.inductor_choices_class = one_pass_row_choices
    if not isinstance(V.choices, _choices_class()):  # a compile earlier in this thread already fixed its handler
        V.set_choices_handler(one_pass_row_choices())
