"""PTQ: each scheme's torchao tensor type, its error vs. float, device checks, and size reporting."""

import pytest
import torch

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.quantization import SCHEMES, quantize_model, size_on_disk, summarize_sizes
from llm_recipe.components.quantization.schemes import check_device


def tiny_model(**kw):
    args = dict(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                tie_word_embeddings=False, qkv_bias=False, o_bias=False)
    lora = kw.pop("lora", None)
    args.update(kw)
    torch.manual_seed(0)
    return build_model(ModelArgs(**args), lora=lora, max_seq_len=64).eval()


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "scheme, tensor_type, max_rel_err",
    [("8da4w", "IntxUnpackedToInt8Tensor", 0.25), ("int8_weight_only", "Int8Tensor", 0.02),
     ("float8_weight_only", "Float8Tensor", 0.1)],
)
def test_cpu_schemes_quantize_block_linears_only(scheme, tensor_type, max_rel_err):
    model = tiny_model()
    with torch.no_grad():
        ref = model(TOKENS)
    quantize_model(model, scheme, group_size=32)
    assert type(model.layers[0].attn.q_proj.weight).__name__ == tensor_type
    assert type(model.layers[1].mlp.w2.weight).__name__ == tensor_type
    assert type(model.output.weight) is torch.nn.Parameter and type(model.tok_embeddings.weight) is torch.nn.Parameter
    with torch.no_grad():
        out = model(TOKENS)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 0 < rel < max_rel_err  # changed, but close (4-bit groups < 8-bit float < 8-bit int per row)


def test_include_output_quantizes_untied_lm_head():
    model = quantize_model(tiny_model(), "int8_weight_only", include_output=True)
    assert type(model.output.weight).__name__ == "Int8Tensor"


def test_group_size_changes_8da4w_weight_error():
    errs = {}
    for g in (16, 64):
        model = tiny_model()
        w = model.layers[0].mlp.w1.weight.detach().clone()
        quantize_model(model, "8da4w", group_size=g)
        q = model.layers[0].mlp.w1.weight
        assert q.block_size == (1, g)
        errs[g] = ((q.dequantize() - w).norm() / w.norm()).item()
    assert 0 < errs[16] < errs[64] < 0.2  # smaller groups, finer scales


def test_unknown_scheme_lists_all_schemes():
    with pytest.raises(RecipeError) as e:
        quantize_model(tiny_model(), "int3_magic")
    assert "int3_magic" in str(e.value) and all(s in str(e.value) for s in SCHEMES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("scheme, match", [("int4_weight_only", "needs a CUDA GPU"),
                                           ("float8_dynamic", "compute capability >= 8.9")])
def test_gpu_only_schemes_refuse_cpu_clearly(scheme, match):
    with pytest.raises(RecipeError, match=match):
        quantize_model(tiny_model(), scheme)


def test_bad_group_size_names_layer_and_lora_is_refused():
    with pytest.raises(RecipeError, match=r"group_size 24 does not divide the input width 64 of layers\.0\."):
        quantize_model(tiny_model(), "8da4w", group_size=24)
    with pytest.raises(RecipeError, match="LoRA adapters"):
        quantize_model(tiny_model(lora=LoRASettings(rank=4)), "8da4w")
    model = quantize_model(tiny_model(), "int8_weight_only")
    with pytest.raises(RecipeError, match="already quantized"):
        quantize_model(model, "int8_weight_only")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_weight_only_on_gpu():
    with pytest.raises(RecipeError, match="bfloat16"):
        check_device("int4_weight_only", "cuda", torch.float32)
    model = tiny_model().to("cuda", torch.bfloat16)
    tokens = TOKENS.cuda()
    with torch.no_grad():
        ref = model(tokens).float()
        quantize_model(model, "int4_weight_only", group_size=32)
        out = model(tokens).float()
    assert type(model.layers[0].attn.q_proj.weight).__name__ == "Int4TilePackedTo4dTensor"
    assert 0 < ((out - ref).norm() / ref.norm()).item() < 0.25


def test_sizes(tmp_path):
    (tmp_path / "before").mkdir()
    (tmp_path / "before" / "model.safetensors").write_bytes(b"x" * 4000)
    (tmp_path / "before" / "tokenizer.json").write_bytes(b"t" * 1000)
    (tmp_path / "after.gguf").write_bytes(b"y" * 1000)
    assert size_on_disk(tmp_path / "before") == 5000
    s = summarize_sizes(tmp_path / "before", tmp_path / "after.gguf")
    assert s["before_bytes"] == 4000 and s["after_bytes"] == 1000 and s["ratio"] == 4.0
    assert "4.00x" in s["text"]
    with pytest.raises(RecipeError, match="no such file"):
        size_on_disk(tmp_path / "missing")
    # a training checkpoint as the source: its optimizer state (recipe_state/) is no part of the model's size
    (tmp_path / "before" / "recipe_state").mkdir()
    (tmp_path / "before" / "recipe_state" / "optimizer.safetensors").write_bytes(b"o" * 3000)
    assert size_on_disk(tmp_path / "before") == 5000
    assert summarize_sizes(tmp_path / "before", tmp_path / "after.gguf")["before_bytes"] == 4000
