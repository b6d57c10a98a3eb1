"""With `use_one_pass_row_reductions` (what a recipe installs when it compiles on CUDA), the fp8 activation
quantization of a 14,336-wide row compiles to one persistent kernel that reads the row once, and gives the same
numbers as Inductor's looped kernel."""

import pytest
import torch
import torch.nn.functional as F

from llm_recipe.components.inductor_choices import use_one_pass_row_reductions

CUDA = torch.cuda.is_available()


def test_the_heuristic_pickles_by_name_so_inductor_s_compile_cache_keeps_working():
    """torch 2.11 pickles `config.inductor_choices_class` into every graph's cache key: a class defined inside a
    function cannot be pickled, and every graph then bypassed the cache (recompiled on every run)."""
    import pickle

    from torch._inductor import config
    from torch._inductor.virtualized import V

    from llm_recipe.components import inductor_choices

    before = V.choices
    with config.patch(inductor_choices_class=None):  # restored after the test
        try:
            use_one_pass_row_reductions()
            factory = pickle.loads(pickle.dumps(config.inductor_choices_class))
            assert factory is inductor_choices.one_pass_row_choices
            assert factory().uuid() == "llm_recipe.OnePassRowReductions.16384"
            assert isinstance(V.choices, type(factory()))
        finally:
            V.set_choices_handler(before)


def _quantize_down_input(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torchao's per-row fp8 input quantization of the MLP's down projection, fused with SiLU(gate) * up
    x = F.silu(gate) * up
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale



@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Inductor's Triton kernels)")
def test_wide_rows_compile_to_one_pass_with_the_looped_kernel_s_numbers():
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.utils import run_and_get_code
    from torch._inductor.virtualized import V

    g = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(64, 14_336, device="cuda", generator=g).bfloat16()
    up = torch.randn(64, 14_336, device="cuda", generator=g).bfloat16()
    with config.patch(inductor_choices_class=None):  # Inductor's own heuristic first
        V.set_choices_handler(InductorChoices())
        torch._dynamo.reset()
        (q_looped, scale_looped), codes = run_and_get_code(torch.compile(_quantize_down_input), gate, up)
    assert "triton_red_fused" in "\n".join(codes)  # without it: a looped kernel, the row read twice

    use_one_pass_row_reductions()
    torch._dynamo.reset()
    (q, scale), codes = run_and_get_code(torch.compile(_quantize_down_input), gate, up)
    code = "\n".join(codes)
    assert "triton_per_fused" in code and "triton_red_fused" not in code, code[-3000:]
    assert torch.equal(scale, scale_looped) and torch.equal(q.view(torch.uint8), q_looped.view(torch.uint8))

