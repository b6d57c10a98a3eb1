"""A frozen teacher's input embedding kept on the host (components/models/host_embedding.py): the same rows as
nn.Embedding, the batch's host tokens kept when it moves, the same hidden states, and on a GPU the same logits with
about the table's size less GPU memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from llm_recipe.components.data.collate import collate_packed
from llm_recipe.components.models.host_embedding import (
    HOST_TOKENS,
    HostEmbedding,
    embedding_on_host,
    move_embedding_to_host,
    why_not_on_host,
)
from llm_recipe.components.training import LOSS_ROWS, hidden_states, to_device


def _args(vocab: int = 1000, hidden: int = 64, tied: bool = False):
    from llm_recipe.components.models import ModelArgs

    return ModelArgs.from_hf_config({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tied})


def _frozen(vocab: int = 1000, hidden: int = 64, tied: bool = False, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> nn.Module:
    from llm_recipe.components.models import build_model

    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(_args(vocab, hidden, tied), max_seq_len=256)
    return model.to(dtype).requires_grad_(False).eval()


def _packed_batch(vocab: int, seed: int, length: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lens in ([50, 3, 75], [100, 28]):
        tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
        rows.append({"tokens": tokens, "labels": tokens, "seq_lens": lens})
    return collate_packed(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_nn_embedding_exactly_and_outputs_never_alias(dtype):
    """Random tokens of several shapes: the host lookup is nn.Embedding's, bit for bit; earlier outputs stay intact
    while the staging buffers are reused (more lookups than buffers, a larger one growing a buffer)."""
    torch.manual_seed(0)
    ref = nn.Embedding(5000, 48).to(dtype).requires_grad_(False)
    host = HostEmbedding(ref.weight, torch.device("cpu"))
    shapes = [(2, 7), (3, 11), (1, 5), (4, 33), (2, 7)]
    tokens = [torch.randint(0, 5000, s) for s in shapes]
    outs = [host(t) for t in tokens]
    for t, out in zip(tokens, outs, strict=True):
        assert out.dtype == dtype and out.shape == (*t.shape, 48)
        assert torch.equal(out, ref(t))
    assert host.weight.device.type == "cpu" and not host.weight.requires_grad
    assert set(host.state_dict()) == set(ref.state_dict())


def test_batch_keeps_its_host_tokens_and_nothing_else_changes():
    batch = _packed_batch(1000, 0)
    moved = to_device(batch, torch.device("cpu"))
    assert moved[HOST_TOKENS] is batch["tokens"]  # a reference to the host tensor: no copy
    assert set(moved) - {LOSS_ROWS} == set(batch) | {"mask", HOST_TOKENS}  # loss_rows: tests/test_loss_rows.py
    for k, v in batch.items():
        assert torch.equal(moved[k], v)
    again = to_device(moved, torch.device("cpu"))  # moving a moved batch keeps the host copy on the host
    assert again[HOST_TOKENS] is batch["tokens"]


def test_teacher_hidden_states_with_the_host_embedding_equal_the_device_ones():
    """The code path of a GPU run on the CPU: the embedding replaced by a HostEmbedding whose output device is the
    CPU, the batch moved with to_device (host tokens kept); and device tokens alone (the one-copy fallback)."""
    teacher = _frozen()
    host = copy.deepcopy(teacher)
    move_embedding_to_host(host, torch.device("cpu"))
    assert embedding_on_host(host) and not embedding_on_host(teacher)
    for seed in range(3):
        batch = to_device(_packed_batch(1000, seed), torch.device("cpu"))
        want = hidden_states(teacher, batch)
        assert torch.equal(hidden_states(host, batch), want)
        without = {k: v for k, v in batch.items() if k != HOST_TOKENS}
        assert torch.equal(hidden_states(host, without), want)


def test_only_frozen_untied_unsharded_teachers_on_a_gpu_move():
    from llm_recipe.components.runtime import Runtime, prepare_teacher

    cuda = torch.device("cuda")
    assert why_not_on_host(_frozen(), cuda) is None
    assert why_not_on_host(_frozen(), torch.device("cpu")) == "not a CUDA run"
    assert why_not_on_host(_frozen(tied=True), cuda) == "tied to the output head"
    assert why_not_on_host(_frozen().requires_grad_(True), cuda) == "not frozen"
    # a CPU run: prepare_teacher leaves the embedding where it is
    teacher = prepare_teacher(Runtime(device=torch.device("cpu"), dtype=torch.float32), _frozen())
    assert type(teacher.tok_embeddings) is nn.Embedding


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_teacher_logits_equal_and_memory_drops_by_the_table(compiled, capsys):
    """On a GPU, through prepare_teacher as kd runs it: the logits of several packed micro-batches (more than the
    staging buffers) equal the on-device embedding's exactly, and allocated memory drops by the table's size."""
    from llm_recipe.components.runtime import Runtime, prepare_teacher

    device = torch.device("cuda")
    rt = Runtime(device=device, dtype=torch.bfloat16)
    teacher = _frozen(vocab=32768, hidden=256, device="cuda", dtype=torch.bfloat16)  # prepare_teacher casts to it
    table = teacher.tok_embeddings.weight.numel() * teacher.tok_embeddings.weight.element_size()
    if compiled:
        for layer in teacher.layers:
            layer.compile()
    batches = [to_device(_packed_batch(32768, seed), device) for seed in range(5)]
    with torch.inference_mode():
        want = [teacher(b["tokens"], mask=b["mask"], input_pos=b["input_pos"]) for b in batches]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    prepare_teacher(rt, teacher)  # compile is already on its layers; prepare_model leaves them as they are
    torch.cuda.synchronize()
    dropped = before - torch.cuda.memory_allocated(device)
    assert embedding_on_host(teacher)
    assert abs(dropped - table) < 2**20, (dropped, table)
    assert "teacher embeddings: on the host" in capsys.readouterr().out
    with torch.inference_mode():
        got = [teacher(b[HOST_TOKENS], mask=b["mask"], input_pos=b["input_pos"]) for b in batches]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
