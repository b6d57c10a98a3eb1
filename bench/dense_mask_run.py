"""`recipe ...` with packed rows attending through the collator's dense mask (SDPA) instead of flex attention's
BlockMask (both built on the device from the rows' positions): the before side of the attention-mask rows in bench/kd_throughput.py (a diagnosis, not a user setting).

    python bench/dense_mask_run.py run kd --config ... [overrides]
"""

from __future__ import annotations

import sys

import llm_recipe.components.models.attention as attention
from llm_recipe.cli.main import main

if __name__ == "__main__":
    attention.use_flex_attention = lambda device: False  # packed_attention_mask() then builds the dense mask
    sys.exit(main(sys.argv[1:]))
