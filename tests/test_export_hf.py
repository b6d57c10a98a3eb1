"""HF torchao export: transformers loads the folder pre-quantized and reproduces our quantized logits."""

import json

import pytest
import torch

from llm_recipe.components.assets import ensure_assets
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import ModelArgs, build_model, load_model
from llm_recipe.components.quantization import quantize_model
from llm_recipe.components.quantization.export_hf import export_hf_torchao, load_hf_torchao

transformers = pytest.importorskip("transformers")

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def embedded():
    return ensure_assets(quiet=True)


@pytest.mark.parametrize("scheme, tensor_type", [("8da4w", "IntxUnpackedToInt8Tensor"),
                                                 ("int8_weight_only", "Int8Tensor")])
def test_transformers_loads_export_and_matches_our_logits(embedded, tmp_path, scheme, tensor_type):
    model, args = load_model(embedded)
    model.eval()
    quantize_model(model, scheme, group_size=32)
    out = export_hf_torchao(model, args, embedded, tmp_path / "q", scheme, 32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "torchao"
    assert cfg["quantization_config"]["quant_type"]["default"]["_type"] in (
        "Int8DynamicActivationIntxWeightConfig", "Int8WeightOnlyConfig")
    assert not (out / "pytorch_model.bin").exists() and (out / "model.safetensors").is_file()

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf.model.layers[3].mlp.down_proj.weight).__name__ == tensor_type
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = model(ids)
    # Same torchao tensors and kernels on both sides: measured max |diff| 0.0 on CPU fp32.
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)
    # The quantized size is reported honestly: int4 values are stored one per byte by IntxUnpackedToInt8Tensor.
    src_bytes = (embedded / "model.safetensors").stat().st_size
    assert (out / "model.safetensors").stat().st_size < 0.5 * src_bytes


def test_round_trip_into_our_decoder_untied_and_output_quantized(tmp_path):
    args = ModelArgs(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False)
    torch.manual_seed(0)
    model = build_model(args, max_seq_len=64).eval()
    # export quantizes an unquantized model itself
    export_hf_torchao(model, args, None, tmp_path / "q", "8da4w", 32, include_output=True)
    assert type(model.output.weight).__name__ == "IntxUnpackedToInt8Tensor"
    back, back_args = load_hf_torchao(tmp_path / "q")
    assert back_args.num_layers == 2 and type(back.output.weight).__name__ == "IntxUnpackedToInt8Tensor"
    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-4)
    with pytest.raises(RecipeError, match="model.safetensors: not found"):
        load_hf_torchao(tmp_path)
