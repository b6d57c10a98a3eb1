"""ExecuTorch export: executorch.runtime runs the .pte, prefill and KV-cached decode match our eager 8da4w model."""

import contextlib
import copy
import io
import re
import warnings

import pytest
import torch

pytest.importorskip("executorch.runtime")

from llm_recipe.components.errors import RecipeError  # noqa: E402
from llm_recipe.components.models import ModelArgs, build_model, load_model  # noqa: E402
from llm_recipe.components.quantization import quantize_model  # noqa: E402
from llm_recipe.components.quantization.export_pte import (  # noqa: E402
    PteRunner,
    StaticCacheDecoder,
    _quiet_export,
    export_pte,
    round_scales_like_xnnpack,
)
from llm_recipe.components.setup_log import SetupLog  # noqa: E402


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


@pytest.fixture(scope="module")
def tiny_pte(tmp_path_factory):
    """A tiny float model, its .pte, and every warning the export raised (recorded with the "always" action)."""
    args = ModelArgs(family="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False)
    torch.manual_seed(0)
    model = build_model(args, max_seq_len=64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    said = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(said):
        warnings.simplefilter("always")
        path = export_pte(model, tmp_path_factory.mktemp("pte") / "tiny.pte", max_seq_len=64,
                          log=SetupLog(is_main=True, prefix="quantize"))
    return model, path, [f"{w.category.__name__}: {w.message}" for w in caught], said.getvalue()


def test_each_part_of_the_export_says_when_it_starts_and_ends(tiny_pte):
    """The lowering alone takes ~10 minutes for SmolLM2 on a 2-core CPU: the log names each part as it runs."""
    said = tiny_pte[3].splitlines()
    parts = ["pte: tracing (torch.export)", "pte: lowering to XNNPACK", "pte: the ExecuTorch program"]
    assert [ln.split(" ...")[0] for ln in said if ln.endswith(" ...")] == [f"quantize: {p}" for p in parts]
    for line, part in zip([ln for ln in said if not ln.endswith(" ...")], parts, strict=True):
        assert re.fullmatch(rf"quantize: {re.escape(part)}: \d+\.\d s", line), line


def test_tiny_8da4w_pte_prefill_and_decode_match_eager(tiny_pte):
    model, path, _, _ = tiny_pte
    model = copy.deepcopy(model)
    float_copy = copy.deepcopy(model)
    assert not any(type(p).__name__ != "Parameter" for p in model.parameters())  # caller's model untouched
    quantize_model(model, "8da4w", 32)
    assert round_scales_like_xnnpack(model) == 7  # XNNPACK stores group scales in bf16: compare with that twin
    check_against_eager(model, path, torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1)),
                        steps=2, max_rel=1e-4)  # measured 3e-7
    # 4-bit blocks are packed: the file is far smaller than the fp32 weights of the quantized layers.
    linear_bytes = sum(p.numel() * 4 for n, p in float_copy.named_parameters() if n.startswith("layers."))
    assert path.stat().st_size < 0.6 * linear_bytes + 2 * 256 * 64 * 4 + 2 * 64 * 64 * 2 * 4


def test_export_hides_only_warnings_a_user_cannot_act_on(tiny_pte):
    """torch's pytree FutureWarning (9 blocks), ExecuTorch's advice to run the pass we run, the attribute we set
    during export: none reaches the user; the file still loads and runs."""
    model, path, caught, _ = tiny_pte
    noise = ("LeafSpec", "Mutation on a buffer", "assigned during export")
    assert [w for w in caught if any(n in w for n in noise)] == []
    logits = PteRunner(path)(torch.tensor([[1, 2, 3]]), torch.arange(3))
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()


def test_quiet_export_is_narrow():
    """Other warnings (same categories, other messages) still show, and errors pass through."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="real error"), _quiet_export():
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
            warnings.warn("some other deprecation", FutureWarning, stacklevel=1)
            warnings.warn("a user should see this", UserWarning, stacklevel=1)
            raise RuntimeError("real error")
        warnings.warn("Mutation on a buffer in the model is detected.", UserWarning, stacklevel=1)  # outside: shown
    assert [str(w.message) for w in caught] == ["some other deprecation", "a user should see this",
                                                "Mutation on a buffer in the model is detected."]


def test_errors(tmp_path):
    with pytest.raises(RecipeError, match="no such .pte"):
        PteRunner(tmp_path / "missing.pte")
    args = ModelArgs(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=16, tie_word_embeddings=True, qkv_bias=False, o_bias=False)
    with pytest.raises(RecipeError, match="exceeds the model's RoPE table"):
        export_pte(build_model(args, max_seq_len=16), tmp_path / "x.pte", max_seq_len=32)
    int8 = quantize_model(build_model(args, max_seq_len=16), "int8_weight_only")
    with pytest.raises(RecipeError, match="only 8da4w.*Int8Tensor"):
        export_pte(int8, tmp_path / "x.pte", max_seq_len=16)


def check_embedded_pte(model, path):
    """SmolLM2-135M's activations have large outliers, so int8 per-token activation quantization turns any
    rounding difference between XNNPACK and torchao into visible logit changes (measured: position 0 equal,
    prefill rel. L2 0.051, decode steps 0.08-0.29, greedy tokens equal for 3 steps, then they diverge)."""
    runner = PteRunner(path)
    eager = StaticCacheDecoder(copy.deepcopy(model), max_seq_len=64).eval()
    prompt = torch.tensor([[1, 9690, 198, 504, 3575, 282, 4649, 314]])
    n = prompt.shape[1]
    with torch.no_grad():
        got, want = runner(prompt, torch.arange(n)), eager(prompt, torch.arange(n))
        assert rel(got[0, 0], want[0, 0]) < 1e-3 and rel(got, want) < 0.1
        for i in range(3):
            nxt = want[:, -1:].argmax(-1)
            assert torch.equal(got[:, -1:].argmax(-1), nxt)
            got, want = runner(nxt, torch.tensor([n + i])), eager(nxt, torch.tensor([n + i]))


@pytest.mark.slow
def test_embedded_model_pte(tmp_path):
    from llm_recipe.components.assets import ensure_assets

    model, _ = load_model(ensure_assets(quiet=True), max_seq_len=64)
    model.eval()
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    quantize_model(model, "8da4w", 32)
    path = export_pte(model, tmp_path / "smollm2.pte", max_seq_len=64)  # ~11-13 min on a busy 2-core machine
    round_scales_like_xnnpack(model)
    check_embedded_pte(model, path)
    # 287 MB of 538: the tied fp32 embedding is stored twice (embedding table + XNNPACK's output GEMM).
    assert path.stat().st_size < 0.6 * fp32_bytes
