"""The activation estimate behind `activation_checkpointing: auto` (components/memory.py) against what autograd
really saves for backward, measured with `saved_tensors_hooks` on small models from our builder."""

from __future__ import annotations

import pytest
import torch

from llm_recipe.components import memory
from llm_recipe.components.models.args import ModelArgs
from llm_recipe.components.models.builder import LoRASettings, build_model

SHIPPED = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # bench/kd_throughput.py's LoRA
SIZES = {"small": (64, 256, 4, 2), "wider": (128, 384, 8, 4)}  # hidden, intermediate, heads, kv heads
MODES = {"full": None, "lora_shipped": LoRASettings(rank=8, targets=SHIPPED), "lora_qv": LoRASettings(rank=4)}


def _student(size: str, mode: str) -> torch.nn.Module:
    """A 3-layer bf16 student; LoRA students train only their adapters (as the recipes freeze them)."""
    d, inter, heads, kv = SIZES[size]
    args = ModelArgs(family="llama", vocab_size=97, hidden_size=d, intermediate_size=inter, num_layers=3,
                     num_heads=heads, num_kv_heads=kv, head_dim=d // heads, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=512, tie_word_embeddings=True, qkv_bias=False, o_bias=False)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model(args, lora=MODES[mode], max_seq_len=512)
    finally:
        torch.set_default_dtype(default)
    if MODES[mode] is not None:
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
    model.skip_output = True  # the loss projects chunks itself; the estimate covers layers + final norm
    return model


def _saved_bytes(model: torch.nn.Module, seq: int) -> int:
    """Bytes of the distinct storages autograd saves in a forward of one row of `seq` tokens (weights and buffers
    are not activations and are left out)."""
    fixed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in fixed:
            seen[s.data_ptr()] = s.nbytes()
        return t

    tokens = torch.randint(0, 97, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(tokens)
    assert out.requires_grad
    return sum(seen.values())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("size", list(SIZES))
def test_estimate_matches_saved_tensors(size, mode):
    """Within 15% of the measured saved bytes at two sequence lengths, and growing with them as measured."""
    model = _student(size, mode)
    for seq in (64, 256):
        measured = _saved_bytes(model, seq)
        estimated = memory.activation_bytes(model, seq, torch.bfloat16)
        assert abs(estimated - measured) <= 0.15 * measured, (size, mode, seq, estimated, measured)


def test_frozen_linears_save_less():
    """A LoRA student keeps less than the same model trained in full (frozen weights need no inputs saved), but
    not much less: the MLP intermediates and attention tensors are saved either way."""
    full = memory.activation_bytes(_student("wider", "full"), 4096, torch.bfloat16)
    shipped = memory.activation_bytes(_student("wider", "lora_shipped"), 4096, torch.bfloat16)
    qv = memory.activation_bytes(_student("wider", "lora_qv"), 4096, torch.bfloat16)
    assert qv < shipped < full and qv < 0.8 * full


def test_formula_at_llama_3_2_1b():
    """The formula's numbers for Llama 3.2 1B (16 layers, 4096 tokens, bf16), as quoted in docs/benchmarks.md."""
    shape = dict(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, dtype_bytes=2)
    full = memory.layer_saved_bytes_per_token(**shape, trains=set(memory.LINEARS), norms_train=True)
    lora = memory.layer_saved_bytes_per_token(**shape, trains=set(SHIPPED), adapter_rank_sum=6 * 64)
    assert (full, lora) == (123_528, 107_912)
