"""ExecuTorch export: executorch.runtime runs the .pte, prefill and KV-cached decode match our eager 8da4w model."""

import copy

import pytest
import torch

pytest.importorskip("executorch.runtime")

from components.errors import RecipeError  # noqa: E402
from components.models import ModelArgs, build_model, load_model  # noqa: E402
from components.quantization import quantize_model  # noqa: E402
from components.quantization.export_pte import PteRunner, StaticCacheDecoder, export_pte  # noqa: E402


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def check_against_eager(model, path, prompt, steps, max_rel):
    """Prefill + `steps` greedy decode steps in the .pte and in eager (cached and full-recompute) references."""
    runner = PteRunner(path)
    eager = StaticCacheDecoder(copy.deepcopy(model), max_seq_len=64).eval()
    n = prompt.shape[1]
    with torch.no_grad():
        got, want = runner(prompt, torch.arange(n)), eager(prompt, torch.arange(n))
        assert got.shape == want.shape == (1, n, model.tok_embeddings.num_embeddings)
        assert rel(got, want) < max_rel
        full = model(prompt)
        torch.testing.assert_close(want, full, rtol=0, atol=1e-4)  # our static cache == no cache
        seq = prompt
        for i in range(steps):
            nxt = want[:, -1:].argmax(-1)
            assert torch.equal(got[:, -1:].argmax(-1), nxt)  # the .pte picks the same greedy token
            seq = torch.cat([seq, nxt], dim=1)
            pos = torch.tensor([n + i])
            got, want = runner(nxt, pos), eager(nxt, pos)
            assert got.shape == (1, 1, want.shape[-1]) and rel(got, want) < max_rel
            torch.testing.assert_close(want[:, -1], model(seq)[:, -1], rtol=0, atol=1e-4)


def test_tiny_8da4w_pte_prefill_and_decode_match_eager(tmp_path):
    args = ModelArgs(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False)
    torch.manual_seed(0)
    model = build_model(args, max_seq_len=64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    float_copy = copy.deepcopy(model)
    path = export_pte(model, tmp_path / "tiny.pte", max_seq_len=64)
    assert not any(type(p).__name__ != "Parameter" for p in model.parameters())  # caller's model untouched
    quantize_model(model, "8da4w", 32)
    # XNNPACK's int8 x int4 GEMMs round differently from torchao's reference: measured rel. L2 up to ~0.022
    # on this random model (XNNPACK keeps int4 block scales in bf16).
    check_against_eager(model, path, torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1)),
                        steps=2, max_rel=0.05)
    # 4-bit blocks are packed: the file is far smaller than the fp32 weights of the quantized layers.
    linear_bytes = sum(p.numel() * 4 for n, p in float_copy.named_parameters() if n.startswith("layers."))
    assert path.stat().st_size < 0.6 * linear_bytes + 2 * 256 * 64 * 4 + 2 * 64 * 64 * 2 * 4


def test_errors(tmp_path):
    with pytest.raises(RecipeError, match="no such .pte"):
        PteRunner(tmp_path / "missing.pte")
    args = ModelArgs(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=16, tie_word_embeddings=True, qkv_bias=False, o_bias=False)
    with pytest.raises(RecipeError, match="exceeds the model's RoPE table"):
        export_pte(build_model(args, max_seq_len=16), tmp_path / "x.pte", max_seq_len=32)


@pytest.mark.slow
def test_embedded_model_pte(tmp_path):
    from components.assets import ensure_assets

    model, _ = load_model(ensure_assets(quiet=True), max_seq_len=64)
    model.eval()
    quantize_model(model, "8da4w", 32)
    path = export_pte(model, tmp_path / "smollm2.pte", max_seq_len=64)
    prompt = torch.tensor([[1, 9690, 198, 504, 3575, 282, 4649, 314]])
    check_against_eager(model, path, prompt, steps=3, max_rel=0.05)
    assert path.stat().st_size < 0.5 * sum(p.numel() * 4 for p in load_model(ensure_assets())[0].parameters())
