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


def test_kv_bytes_per_position_are_what_the_decode_caches_hold():
    """On-policy KD's decode KV budget counts, per position, exactly the bytes StaticDecode's caches allocate."""
    from llm_recipe.components.models.generation import StaticDecode

    model = _student("wider", "lora_shipped")
    static = StaticDecode(4, mode="default", backend="eager", max_tokens=300)
    with static.caches(model, total=60, rows=4):
        pass
    held = sum(t.untyped_storage().nbytes() for pair in static._shared.values() for k, v in pair for t in (k, v))
    assert memory.kv_bytes_per_position(model) * static.kv_positions == held == 3 * 2 * 4 * 16 * 2 * 300


def test_sampling_kv_positions_take_a_step_when_it_fits_beside_training(monkeypatch):
    """One decode loop per step's on-policy prompts when their KV caches and the rest (the larger of a micro-batch's
    activations and the prompts' forward, the training state, the reserve) fit in usable free memory; a
    micro-batch's when they do not, or on CPU; the reason gives the sizes."""
    model = _student("wider", "lora_shipped")
    per = memory.kv_bytes_per_position(model)
    train = (max(memory.activation_bytes(model, 4096, torch.bfloat16), 40_000 * memory.prefill_bytes_per_token(model))
             + memory.training_state_bytes(model) + memory.RESERVE_BYTES)
    assert memory.prefill_bytes_per_token(model) == (4 * 384 + 4 * 128) * 2
    cuda = torch.device("cuda", 0)
    for free, want in ((int((train + 40_000 * per) / memory.USABLE_FRACTION) + 1, 40_000),
                       (int((train + 40_000 * per) / memory.USABLE_FRACTION) - per, 10_000)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free: (free, 2 * free))
        got, why = memory.sampling_kv_positions(model, 10_000, 40_000, 4096, cuda)
        assert got == want and why.startswith(f"{want} positions, a {'step' if want == 40_000 else 'micro-batch'}'s")
        assert "GiB usable free" in why
    assert memory.sampling_kv_positions(model, 10_000, 40_000, 4096, torch.device("cpu"))[0] == 10_000
    assert memory.sampling_kv_positions(model, 10_000, 10_000, 4096, cuda)[0] == 10_000
    # sharded over 2 processes, a rank holds half the training state: a step fits in what one process lacks
    state = memory.training_state_bytes(model)
    free = int((train - state + state // 2 + 40_000 * per) / memory.USABLE_FRACTION) + 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    assert memory.sampling_kv_positions(model, 10_000, 40_000, 4096, cuda)[0] == 10_000
    assert memory.sampling_kv_positions(model, 10_000, 40_000, 4096, cuda, shards=2)[0] == 40_000
