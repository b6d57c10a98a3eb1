"""Our decoder vs transformers (the oracle): same logits for HF folders we read and folders we write."""

import json

import pytest
import torch

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import (
    LoRASettings,
    keep_every,
    load_hf_state_dict,
    load_model,
    read_model_args,
    save_model,
)

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)
CASES = {
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3_scaled_rope": ("LlamaConfig", dict(tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
}


def _hf_model(kind: str, tmp_path, **overrides):
    cls_name, extra = CASES[kind]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-zero biases so a dropped bias would show
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / kind
    model.save_pretrained(path)
    return model, path


def _tokens():
    return torch.randint(0, TINY["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_match_transformers_both_ways(kind, tmp_path):
    hf, path = _hf_model(kind, tmp_path)
    ours, args = load_model(path)
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)

    # Round trip: the folder we write loads in transformers with the same logits.
    out = tmp_path / "ours"
    save_model(ours, args, out, tokenizer_dir=None)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ref, atol=1e-4, rtol=0)


def test_sharded_save_and_load(tmp_path):
    _, path = _hf_model("llama_tied", tmp_path)
    ours, args = load_model(path)
    out = tmp_path / "sharded"
    from llm_recipe.components.models.convert import tune_to_hf_names
    from llm_recipe.components.models.hf_io import write_hf_folder
    from llm_recipe.components.models.loader import merged_state_dict
    write_hf_folder(out, tune_to_hf_names(merged_state_dict(ours)), args.to_hf_config("float32"),
                    max_shard_bytes=100_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(load_hf_state_dict(out))
    again, _ = load_model(out)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), ours(tokens), atol=0, rtol=0)


def test_lora_merge_saves_effective_weights(tmp_path):
    _, path = _hf_model("qwen2", tmp_path)
    for dora in (False, True):
        lora = LoRASettings(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), use_dora=dora)
        model, args = load_model(path, lora=lora)
        tokens = _tokens()
        with torch.no_grad():
            before = model(tokens)
            for n, p in model.named_parameters():  # move the adapters away from their zero init
                if "lora_b" in n or "magnitude" in n:
                    p.add_(torch.randn_like(p) * 0.05)
            after = model(tokens)
        assert not torch.allclose(before, after)
        out = tmp_path / f"merged_{dora}"
        save_model(model, args, out, tokenizer_dir=None)
        plain, _ = load_model(out)
        with torch.no_grad():
            torch.testing.assert_close(plain(tokens), after, atol=1e-4, rtol=0)


def test_pruned_student_keeps_chosen_layers(tmp_path):
    _, path = _hf_model("llama_tied", tmp_path)
    full, _ = load_model(path)
    student, sargs = load_model(path, keep_layers=[0, 2])
    assert sargs.num_layers == 2 and len(student.layers) == 2
    torch.testing.assert_close(student.layers[1].attn.q_proj.weight, full.layers[2].attn.q_proj.weight)
    assert keep_every(30, 3) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29]
    with pytest.raises(RecipeError, match="keep_layers"):
        load_model(path, keep_layers=[0, 5])


def test_pruned_qwen2_student_loads_in_transformers_with_the_same_logits(tmp_path):
    """A layer-pruned student's config.json keeps only its layers' entries of per-layer lists (Qwen2's
    `layer_types`, which transformers checks against num_hidden_layers: it refused the 3-entry list for 2 layers)."""
    _, path = _hf_model("qwen2", tmp_path)
    assert len(json.loads((path / "config.json").read_text())["layer_types"]) == 3
    student, sargs = load_model(path, keep_layers=[0, 2])
    save_model(student, sargs, tmp_path / "student", tokenizer_dir=None)
    assert json.loads((tmp_path / "student" / "config.json").read_text())["layer_types"] == ["full_attention"] * 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "student", dtype=torch.float32).eval()
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(student(tokens), hf(tokens).logits, atol=1e-4, rtol=0)


def test_bad_folder_errors_name_the_file(tmp_path):
    with pytest.raises(RecipeError, match="no config.json"):
        read_model_args(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(RecipeError, match="config.json: model_type 'gpt2' is not supported"):
        read_model_args(tmp_path)


def test_torchtune_imports_through_nf4_alias_and_qlora_trains(tmp_path):
    import importlib
    import sys

    from llm_recipe.components.models.tune import import_torchtune

    import_torchtune()  # what building a model calls first: the alias, then torchtune

    # `torchao.quantization.quantize_` is also a function name, so import the module by its string path.
    new_nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

    assert sys.modules["torchao.dtypes.nf4tensor"] is new_nf4
    # NF4 quantizes in blocks of 64 with scalers in blocks of 256: weights need a multiple of 16384 elements.
    _, path = _hf_model("llama_tied", tmp_path, hidden_size=128, num_key_value_heads=4, intermediate_size=256)
    ref, _ = load_model(path)
    for dora in (False, True):
        lora = LoRASettings(rank=4, alpha=8, targets=("q_proj", "v_proj", "gate_proj"), quantize_base=True,
                            use_dora=dora)
        model, _ = load_model(path, lora=lora)
        assert isinstance(model.layers[0].attn.q_proj.weight, new_nf4.NF4Tensor)
        tokens = _tokens()
        with torch.no_grad():
            err = (model(tokens) - ref(tokens)).abs().max()
        assert 0 < err < 0.5  # NF4 rounding changes the logits a little, not a lot
        trainable = [p for n, p in model.named_parameters() if "lora" in n or "magnitude" in n]
        for n, p in model.named_parameters():
            p.requires_grad_("lora" in n or "magnitude" in n)
        model(tokens).logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in trainable)


@pytest.mark.parametrize("dora", [False, True])
def test_peft_adapter_loads_in_peft_with_same_logits(dora, tmp_path):
    peft = pytest.importorskip("peft")
    from llm_recipe.components.models.peft_adapter import save_peft_adapter

    hf, path = _hf_model("qwen2", tmp_path)
    lora = LoRASettings(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "up_proj"), use_dora=dora)
    model, _ = load_model(path, lora=lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n or "magnitude" in n:
                p.add_(torch.randn_like(p) * 0.05)
    save_peft_adapter(model.state_dict(), lora, tmp_path / "adapter", base_model=str(path))
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(tokens).logits, model(tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dora", [False, True])
def test_a_bf16_merge_is_peft_merge_rounded_once(dora, tmp_path):
    """A GPU run trains bf16 adapters on a bf16 base: `model/` must hold PEFT's merge of the adapter file, rounded
    to bf16 once. Rounding `scale * B @ A` to bf16 before adding it (torchtune's merge in the weights' dtype) moved
    0.3% of a 1B model's weights, by up to 255 steps where base and update cancel, on the H200."""
    peft = pytest.importorskip("peft")
    from llm_recipe.components.models.convert import tune_to_hf_names
    from llm_recipe.components.models.loader import merged_state_dict
    from llm_recipe.components.models.peft_adapter import save_peft_adapter

    _, path = _hf_model("llama3_scaled_rope", tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()  # the bf16 base
    lora = LoRASettings(rank=8, alpha=16, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"),
                        use_dora=dora)
    model, _ = load_model(path, dtype=torch.bfloat16, lora=lora)
    with torch.no_grad():  # updates of a weight's own size and far smaller, so some of them cancel the base
        for n, p in model.named_parameters():
            if "lora_b" in n or "magnitude" in n:
                p.add_(torch.randn_like(p) * (0.05 if "lora_b" in n else 0.01))
    save_peft_adapter(model.state_dict(), lora, tmp_path / "adapter", base_model=str(path))
    merged = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").merge_and_unload().state_dict()
    ours = tune_to_hf_names(merged_state_dict(model))
    checked = 0
    for key, w in ours.items():
        if not any(f".{t}." in key for t in lora.targets):
            continue
        assert w.dtype == torch.bfloat16, key
        ref = merged[key].to(torch.bfloat16)
        if dora:  # PEFT normalises by the norm in its own order of fp32 operations: a near-tie may round apart
            assert (w != ref).float().mean() < 1e-3, key
            torch.testing.assert_close(w.float(), ref.float(), atol=0, rtol=2**-7)
        else:
            assert torch.equal(w, ref), f"{key}: {(w != ref).float().mean():.2%} of the weights differ"
        checked += 1
    assert checked == 5 * TINY["num_hidden_layers"]


def test_a_quantized_folder_as_a_float_source_says_so(tiny_model_dir, tmp_path):
    """Re-quantizing (or training from) a `recipe run quantize` hf/ export failed 15 s in with 'weights do not match
    config.json (missing [...q_proj.weight], unexpected [...q_proj._weight_qdata])'."""
    import json
    import shutil

    from llm_recipe.components.errors import RecipeError
    from llm_recipe.components.models import load_model

    q = tmp_path / "hf"
    shutil.copytree(tiny_model_dir, q)
    cfg = json.loads((q / "config.json").read_text())
    (q / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "torchao"}}))
    with pytest.raises(RecipeError) as e:
        load_model(q)
    assert str(e.value) == (f"{q} is already quantized (torchao: quantization_config in config.json): train or "
                            "quantize from the float model it was made from (e.g. a run's model/)")
