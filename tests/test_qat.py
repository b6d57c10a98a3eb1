"""QAT: torchao QATConfig prepare/convert on our decoder, the fake-quant delay switch, and QAT + LoRA."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model, lora_modules, merged_state_dict
from llm_recipe.components.quantization import (
    QAT_METADATA_FILE,
    convert_qat,
    fake_quant_enabled_at,
    prepare_qat,
    qat_metadata,
    quantize_model,
    read_qat_metadata,
    set_fake_quant_enabled,
    write_qat_metadata,
)


def tiny_args(**kw) -> ModelArgs:
    base = dict(family="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                tie_word_embeddings=True, qkv_bias=False, o_bias=False)
    base.update(kw)
    return ModelArgs(**base)


def tiny_model(lora=None, seed=0, **kw):
    torch.manual_seed(seed)
    model = build_model(tiny_args(**kw), lora=lora, max_seq_len=64)
    if lora is not None:  # non-zero adapters, so merging matters
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_b.weight, std=0.02)
    return model


def batch(seed=1, b=4, s=24, vocab=128):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def loss_of(model, tokens, labels):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, :-1].reshape(-1))


def train(model, steps, lr=3e-3):
    tokens, labels = batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, tokens, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_prepare_fake_quantizes_block_linears_only_and_switch_restores_float():
    from torchao.quantization.qat import FakeQuantizedLinear

    model = tiny_model(tie_word_embeddings=False)
    ref = copy.deepcopy(model)
    tokens, _ = batch()
    prepare_qat(model, "8da4w", group_size=32)
    fq = {n for n, m in model.named_modules() if isinstance(m, FakeQuantizedLinear)}
    assert len(fq) == 7 * 2 and all(n.startswith("layers.") for n in fq)
    assert type(model.output) is torch.nn.Linear and type(model.tok_embeddings) is torch.nn.Embedding
    assert model.state_dict().keys() == ref.state_dict().keys()  # checkpoints stay HF-convertible
    with torch.no_grad():
        on = model(tokens)
        assert set_fake_quant_enabled(model, False) == 2 * 14  # activation + weight quantizer per linear
        off = model(tokens)
        set_fake_quant_enabled(model, True)
        again = model(tokens)
        want = ref(tokens)
    torch.testing.assert_close(off, want, rtol=0, atol=0)
    assert (on - want).abs().max() > 1e-3  # fake quantization really changes the numerics
    torch.testing.assert_close(again, on, rtol=0, atol=0)  # deterministic flag flip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_fake_quantizer_matches_torchaos_and_traces_in_one_graph(dtype):
    # prepare_qat swaps torchao's per-token activation quantizer for one that Dynamo traces in one piece (torchao's
    # broke every linear's compiled graph on torch 2.11); outputs and gradients must stay torchao's, bit for bit
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    from llm_recipe.components.quantization.schemes import base_config

    ours = prepare_qat(tiny_model(), "8da4w", group_size=32).to(dtype)
    theirs = tiny_model()
    quantize_(theirs, QATConfig(base_config("8da4w", 32, for_qat_prepare=True), step="prepare"))
    theirs = theirs.to(dtype)
    assert type(ours.layers[0].attn.q_proj.activation_fake_quantizer).__name__ == "TraceableIntxFakeQuantizer"
    x = (torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    outs = []
    for model in (ours, theirs):
        xi = x.clone().requires_grad_()
        y = model.layers[0].mlp(xi)
        (y.float() ** 2).sum().backward()
        outs.append((y, xi.grad, model.layers[0].mlp.w1.weight.grad))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    explained = torch._dynamo.explain(ours.layers[0].mlp)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_prepare_can_include_untied_output():
    from torchao.quantization.qat import FakeQuantizedLinear

    model = prepare_qat(tiny_model(tie_word_embeddings=False), "8da4w", 32, include_output=True)
    assert isinstance(model.output, FakeQuantizedLinear)


def test_fake_quant_delay_schedule():
    assert [fake_quant_enabled_at(s, 3) for s in range(5)] == [False, False, False, True, True]
    assert fake_quant_enabled_at(0, None) and fake_quant_enabled_at(0, 0)


def test_qat_training_reduces_loss_and_convert_equals_ptq_of_trained_weights():
    from torchao.quantization import IntxUnpackedToInt8Tensor

    model = prepare_qat(tiny_model(), "8da4w", 32)
    losses = train(model, 25)
    assert losses[-1] < 0.7 * losses[0]
    tokens, _ = batch(seed=5)
    with torch.no_grad():
        fake = model(tokens)
    ptq = tiny_model()
    ptq.load_state_dict(model.state_dict())
    quantize_model(ptq, "8da4w", 32)
    convert_qat(model, "8da4w", 32)
    assert isinstance(model.layers[0].attn.q_proj.weight, IntxUnpackedToInt8Tensor)
    with torch.no_grad():
        real, via_ptq = model(tokens), ptq(tokens)
    torch.testing.assert_close(real, via_ptq, rtol=0, atol=0)
    # The fake-quantized training graph predicts the converted model (same int4 grid, same int8 activations).
    torch.testing.assert_close(real, fake, rtol=0, atol=1e-4)


def test_qat_lora_trains_adapters_and_converts_to_merged_quantized_weights():
    from torchao.quantization import IntxUnpackedToInt8Tensor

    lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    model = tiny_model(lora=lora)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    keys = set(model.state_dict())
    base_before = model.layers[0].attn.q_proj.weight.detach().clone()
    prepare_qat(model, "8da4w", 32)
    assert set(model.state_dict()) == keys and len(lora_modules(model)) == 8  # still LoRALinear (subclass)
    assert not hasattr(model.layers[0].attn.q_proj.lora_a, "weight_fake_quantizer")  # adapters not quantized
    losses = train(model, 30, lr=1e-2)
    assert losses[-1] < 0.85 * losses[0]
    torch.testing.assert_close(model.layers[0].attn.q_proj.weight, base_before, rtol=0, atol=0)  # frozen
    tokens, _ = batch(seed=7)
    with torch.no_grad():
        fake = model(tokens)
    merged = tiny_model()
    merged.load_state_dict(merged_state_dict(model))  # the lead's merge (what save_model writes)
    quantize_model(merged, "8da4w", 32)
    convert_qat(model, "8da4w", 32)
    assert not lora_modules(model)
    assert isinstance(model.layers[1].mlp.w2.weight, IntxUnpackedToInt8Tensor)
    with torch.no_grad():
        real, want = model(tokens), merged(tokens)
    torch.testing.assert_close(real, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(real, fake, rtol=0, atol=1e-4)  # trained graph == shipped graph


def test_int4_weight_only_fake_quant_trains_on_cpu_but_convert_needs_gpu():
    model = prepare_qat(tiny_model(), "int4_weight_only", 32)
    losses = train(model, 10)
    assert losses[-1] < losses[0]
    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match="int4_weight_only.*GPU"):
            convert_qat(model, "int4_weight_only", 32)


@pytest.mark.parametrize(
    "kwargs, lora, match",
    [
        (dict(scheme="int8_weight_only"), None, "no QAT support.*8da4w"),
        (dict(scheme="nope"), None, "unknown quantization scheme 'nope'.*8da4w"),
        (dict(scheme="8da4w", group_size=48), None, "group_size 48 does not divide .* layers.0"),
        (dict(scheme="8da4w"), LoRASettings(rank=4, use_dora=True), "DoRA"),
        (dict(scheme="8da4w"), LoRASettings(rank=4, dropout=0.1), "lora.dropout"),
    ],
)
def test_prepare_errors_name_the_culprit(kwargs, lora, match):
    with pytest.raises(RecipeError, match=match):
        prepare_qat(tiny_model(lora=lora), **kwargs)


def test_convert_without_prepare_is_an_error():
    with pytest.raises(RecipeError, match="prepare_qat"):
        convert_qat(tiny_model(), "8da4w", 32)


def test_metadata_round_trip(tmp_path):
    meta = qat_metadata("8da4w", 64)
    assert meta["scheme"] == "8da4w" and meta["group_size"] == 64
    assert meta["torchao_config"]["_type"] == "Int8DynamicActivationIntxWeightConfig"
    write_qat_metadata(tmp_path, "8da4w", 64)
    assert read_qat_metadata(tmp_path) == json.loads(json.dumps(meta))
    (tmp_path / QAT_METADATA_FILE).write_text('{"scheme": "8da4w"')
    with pytest.raises(RecipeError, match="quantization.json:1: invalid JSON"):
        read_qat_metadata(tmp_path)
    with pytest.raises(RecipeError, match="not found"):
        read_qat_metadata(tmp_path / "nowhere")


def test_bf16_qat_lora_trains_the_weight_model_folder_holds():
    """In bf16, the merged weight QAT + LoRA fake-quantizes is, bit for bit, the one `model/` gets
    (merged_state_dict, which merges plain LoRA in fp32) and the one convert quantizes: what trains is what ships."""
    from llm_recipe.components.quantization.qat import _merge_lora_into_linear

    lora = LoRASettings(rank=4, alpha=12.0, targets=("q_proj", "v_proj", "gate_proj", "down_proj"))  # scale 3
    model = tiny_model(lora=lora).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.copy_(torch.randn_like(p) * 0.3)
    prepare_qat(model, "8da4w", 32)
    saved = merged_state_dict(model)
    modules = lora_modules(model)
    assert len(modules) == 8
    for name, module in modules.items():
        trained = _merge_lora_into_linear(module).weight
        assert trained.dtype == torch.bfloat16
        assert torch.equal(trained, saved[f"{name}.weight"]), name


def test_a_gpu_only_conversion_on_a_cpu_run_is_refused_at_load(tiny_model_dir):
    """QAT (and KD-QAT) ending in a conversion the CPU cannot do (int4_weight_only: CUDA) is refused when the config
    loads (`recipe validate` says it), not after training; without the conversion, or with a CPU scheme, it loads."""
    from llm_recipe.components.config import load_recipe_config
    from llm_recipe.recipes.full import CONFIG as FULL
    from llm_recipe.recipes.kd import CONFIG as KD

    for recipe, config, cfg_type, given in (
            ("qat", "qat/smollm2", FULL, [f"model.checkpoint_dir={tiny_model_dir}"]),
            ("kd", "kd/smollm2_demo", KD, [f"teacher.checkpoint_dir={tiny_model_dir}", "student.prune.keep=2",
                                           "qat={scheme: 8da4w}"])):
        with pytest.raises(RecipeError, match="qat.convert=true converts at the end of training: scheme "
                                              "'int4_weight_only' needs a CUDA GPU"):
            load_recipe_config(config, [*given, "device=cpu", "qat.scheme=int4_weight_only"], cfg_type, recipe=recipe)
        load_recipe_config(config, [*given, "device=cpu", "qat.scheme=int4_weight_only", "qat.convert=false"],
                           cfg_type, recipe=recipe)
        load_recipe_config(config, [*given, "device=cpu", "qat.scheme=8da4w"], cfg_type, recipe=recipe)
        # on a GPU, int4_weight_only converts from bf16 only: another run dtype is refused at load too (it trained,
        # then failed in the conversion)
        with pytest.raises(RecipeError, match=r"to int4_weight_only, which needs dtype: bf16 \(its CUDA kernel is "
                                              r"bf16 only\), but dtype is fp32; set dtype: bf16"):
            load_recipe_config(config, [*given, "device=cuda", "dtype=fp32", "qat.scheme=int4_weight_only"], cfg_type,
                               recipe=recipe)
        load_recipe_config(config, [*given, "device=cuda", "dtype=bf16", "qat.scheme=int4_weight_only"], cfg_type,
                           recipe=recipe)
