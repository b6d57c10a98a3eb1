"""Packed rows on a GPU attend through a flex-attention BlockMask: the same mask as the collator's dense one, and
(on a GPU) the same model outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from llm_recipe.components.data.collate import collate_packed
from llm_recipe.components.models.attention import document_block_mask, document_mask, use_flex_attention
from llm_recipe.components.training import to_device


def _packed_rows(length: int = 256) -> list[dict]:
    """Two packed rows: several documents of uneven lengths, the second ending in padding (its own document);
    `length` 96: documents of [40, 3, 53] and [90, 1, 5]."""
    rows = []
    for lens in ([100, 3, 60, 93], [200, 1, 40, 15]) if length == 256 else ([40, 3, 53], [90, 1, 5]):
        assert sum(lens) == length
        tokens = list(range(1, length + 1))
        rows.append({"tokens": tokens, "labels": tokens, "seq_lens": lens})
    return rows


def _small_llama(hidden: int, device: torch.device) -> torch.nn.Module:
    """A random 2-layer Llama (4 query heads on 2 KV heads, head dim hidden / 4) on `device`, seeded; fp32 matmuls
    without TF32."""
    from llm_recipe.components.models import ModelArgs, build_model

    args = ModelArgs.from_hf_config({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True})
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.device(device):
        return build_model(args, max_seq_len=256)


def _reference_mask(seq_lens_per_row: list[list[int]]) -> torch.Tensor:
    """[b, s, s]: causal inside each document of each row, nothing across, written from the documents' lengths."""
    rows = []
    for lens in seq_lens_per_row:
        s = sum(lens)
        m, start = torch.zeros(s, s, dtype=torch.bool), 0
        for n in lens:
            m[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            start += n
        rows.append(m)
    return torch.stack(rows)


def test_dense_and_block_masks_are_the_documents_masks():
    """From positions alone: the dense mask, and every (query, key) pair the BlockMask allows, are exactly the
    block-causal mask of the rows' documents (the padding at the end of a row is a document of its own)."""
    from torch.nn.attention.flex_attention import create_mask

    rows = _packed_rows()
    batch = collate_packed(rows)
    reference = _reference_mask([r["seq_lens"] for r in rows])
    assert torch.equal(document_mask(batch["input_pos"]), reference)
    bm = document_block_mask(batch["input_pos"])
    b, s = batch["tokens"].shape
    assert torch.equal(create_mask(bm.mask_mod, b, 1, s, s, device="cpu")[:, 0], reference)


def test_block_mask_skips_blocks_across_documents():
    """Documents of 128, 128 and 256 tokens in a 512-token row: of the 10 causal 128 x 128 blocks, only the 5
    inside a document are computed (the dense mask makes SDPA compute all 16)."""
    tokens = list(range(1, 513))
    batch = collate_packed([{"tokens": tokens, "labels": tokens, "seq_lens": [128, 128, 256]}])
    bm = document_block_mask(batch["input_pos"])
    assert int(bm.kv_num_blocks.sum()) + int(bm.full_kv_num_blocks.sum()) == 5


def test_cpu_batches_get_the_dense_mask():
    rows = _packed_rows()
    batch = collate_packed(rows)
    assert "mask" not in batch and not use_flex_attention(torch.device("cpu"))
    moved = to_device(batch, torch.device("cpu"))
    assert torch.equal(moved["mask"], _reference_mask([r["seq_lens"] for r in rows]))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_and_dense_masks_give_the_same_outputs_and_gradients(compiled):
    """A small random Llama on the GPU in fp32: logits and the gradients of a loss through them are the same with
    the dense mask (SDPA, eager) and with the BlockMask: eager (torchtune's flex call) and in compiled layers (our
    in-graph flex call with grouped-query heads, components/models/builder.py `Attention`). fp32, because compiled
    and eager bf16 differ by their own rounding (measured on an H200: the same for dense and flex masks)."""
    device = torch.device("cuda")
    assert use_flex_attention(device)
    model = _small_llama(256, device)
    batch = collate_packed(_packed_rows())
    flex = to_device(batch, device)
    assert not isinstance(flex["mask"], torch.Tensor)
    dense = {k: v.to(device) for k, v in batch.items()}
    dense["mask"] = document_mask(dense["input_pos"])
    results = []
    for b in (dense, flex):
        if compiled and b is flex:
            for layer in model.layers:
                layer.compile()
        model.zero_grad(set_to_none=True)
        logits = model(b["tokens"] % 1000, mask=b["mask"], input_pos=b["input_pos"])
        logits.logsumexp(-1).mean().backward()
        results.append((logits.detach(), model.layers[0].attn.q_proj.weight.grad.clone()))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, atol=1e-3 * l0.abs().max().item(), rtol=1e-3)
    torch.testing.assert_close(g1, g0, atol=1e-3 * g0.abs().max().item(), rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_layers_without_grad_attend_rows_shorter_than_a_flex_block(dtype):
    """A teacher's forward (no grad) of packed rows shorter than 128 tokens through compiled layers: the same logits
    as the dense mask in eager. Inductor's flex lowering takes its one-token decoding kernel for such rows unless told
    otherwise, which failed to compile in fp32 and bf16 on an H200 (first seen in a 2-GPU on-policy test's teacher,
    rows of 96 tokens)."""
    device = torch.device("cuda")
    model = _small_llama(64, device).to(dtype).requires_grad_(False)
    batch = collate_packed(_packed_rows(96))
    flex = to_device(batch, device)
    dense = {k: v.to(device) for k, v in batch.items()}
    dense["mask"] = document_mask(dense["input_pos"])
    with torch.no_grad():
        want = model(dense["tokens"] % 1000, mask=dense["mask"], input_pos=dense["input_pos"]).float()
        for layer in model.layers:
            layer.compile()
        got = model(flex["tokens"] % 1000, mask=flex["mask"], input_pos=flex["input_pos"]).float()
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
