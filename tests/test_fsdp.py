"""When FSDP2 gathers a trained model once per optimizer step instead of per micro-batch (components/fsdp.py).
The schedule itself is covered end to end by tests/test_distributed_recipes.py (2 processes vs 1, 2 micro-batches)."""

from torch import nn

from llm_recipe.components.fsdp import GATHER_SHARE, gather_per_step


def lora_like() -> nn.Module:
    """A frozen 64x64 base and a trained 64x64 layer, fp32: 32 KiB of weights, 16 KiB of gradients."""
    m = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    m[0].requires_grad_(False)
    return m


def test_a_trained_model_gathers_once_only_while_weights_and_gradients_fit_the_share_of_free_memory():
    need = 3 * 64 * 64 * 4  # both weights, and the gradient of the trained one only
    keep, why = gather_per_step(lora_like(), free_bytes=need / GATHER_SHARE)
    assert keep and why.startswith("once:")
    keep, why = gather_per_step(lora_like(), free_bytes=need / GATHER_SHARE - 8)
    assert not keep and why.startswith("per micro-batch:")


def test_a_frozen_model_is_never_gathered_for_a_step():
    """A sharded teacher is sharded to save memory and never runs backward: it keeps per-layer gathers."""
    m = lora_like().requires_grad_(False)
    assert gather_per_step(m, free_bytes=1e15) == (False, "frozen")
