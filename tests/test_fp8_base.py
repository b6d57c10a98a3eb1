"""`lora.quantize_base: fp8`: the frozen LoRA base stored as torchao's Float8Tensor (components/quantization/fp8_base.py).

torch 2.13 runs `torch._scaled_mm` on the CPU too, so the CPU tests run the real fp8 path (torchao's float8 dynamic
activation / per-row weight linear) with the recipe's sm89 check and torchao's hardware assert switched off
(`cpu_fp8`); they check the settings, the refusals, the backward rule, merge, resume state and compile. The `gpu`
tests (skipped without an sm89+ GPU) check the same against the bf16 LoRA model on the GPU, with inductor:

    .venv/bin/python -m pytest tests/test_fp8_base.py -q -p no:cacheprovider    # on an H100/H200
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.models.loader import lora_modules, merged_state_dict
from llm_recipe.components.quantization.fp8_base import (
    Fp8BaseLinear,
    pending_fp8_bases,
    quantize_fp8_bases,
)
from llm_recipe.components.settings import schema_of

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def args(hidden=64, layers=2, **kw) -> ModelArgs:
    base = dict(family="llama", vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rope_theta=10000.0, rms_norm_eps=1e-5,
                max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False)
    return ModelArgs(**{**base, **kw})


def lora_pair(device="cpu", targets=TARGETS, **kw):
    """(bf16 LoRA model, the same model marked for an fp8 base), non-zero adapters, only the adapters trainable."""
    lora = LoRASettings(rank=4, alpha=8.0, targets=targets, quantize_base="fp8")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = build_model(args(**kw), lora=lora, max_seq_len=64)
    finally:
        torch.set_default_dtype(default)
    for m in lora_modules(model).values():
        torch.nn.init.normal_(m.lora_b.weight, std=0.02)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    ref = copy.deepcopy(model)
    for m in ref.modules():
        m.__dict__.pop("fp8_base_pending", None)
    return ref, model


def tokens(device="cpu", b=2, s=16):
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(1)).to(device)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def adapter_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if "lora_" in n}


# -------------------------------------------------------------------------------------------- settings
def test_quantize_base_values():
    assert LoRASettings(quantize_base=True).quantize_base == "nf4"  # the older spelling keeps working
    assert LoRASettings(quantize_base="nf4").quantize_base == "nf4"
    assert LoRASettings(quantize_base="fp8").quantize_base == "fp8"
    assert LoRASettings().quantize_base is False
    with pytest.raises(RecipeError, match="lora.quantize_base: must be one of false, true, nf4, fp8, got 'fp4'"):
        LoRASettings(quantize_base="fp4")
    with pytest.raises(RecipeError, match="fp8 does not support DoRA"):
        LoRASettings(quantize_base="fp8", use_dora=True)
    spec = schema_of(LoRASettings)["quantize_base"]
    assert [spec.problem(v) for v in (False, True, "nf4", "fp8")] == [None] * 4
    assert "nf4" in spec.problem("int8")


def test_builder_marks_fp8_bases_but_not_the_head():
    _, model = lora_pair(targets=(*TARGETS, "lm_head"))
    pending = pending_fp8_bases(model)
    assert len(pending) == 2 * len(TARGETS) and not any(n == "output" for n in pending)
    assert model.layers[0].attn.q_proj.weight.dtype == torch.bfloat16  # loaded as usual, quantized on the GPU


# -------------------------------------------------------------------------------------------- backward
def test_backward_is_grad_out_times_the_dequantized_weight(cpu_fp8):
    from torchao.quantization import quantize_

    from llm_recipe.components.quantization.schemes import base_config

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    quantize_(lin, base_config("float8_dynamic"))  # the fp8 base's tensor: fp8 activations too in forward
    w8 = lin.weight
    w = w8.dequantize(torch.bfloat16)  # the weight the fp8 base stands for
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    g = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    out = Fp8BaseLinear.apply(x, w8)
    out.backward(g)
    F.linear(x_ref, w).backward(g)
    assert 0 < rel(out, F.linear(x_ref.detach(), w)) < 0.1  # forward: fp8 activations against the same weight
    torch.testing.assert_close(x.grad, x_ref.grad)  # backward: exactly grad_out @ dequantized weight
    assert not w8.requires_grad


def test_cpu_model_matches_bf16_lora_and_merges_the_dequantized_base(cpu_fp8):
    ref, model = lora_pair()
    assert quantize_fp8_bases(model, torch.device("cpu")) == 2 * len(TARGETS)
    q = model.layers[0].attn.q_proj
    assert type(q.weight).__name__ == "Float8Tensor" and q.weight.qdata.dtype == torch.float8_e4m3fn
    assert type(q).__name__ == "Fp8BaseLoRALinear" and not pending_fp8_bases(model)
    assert q.weight.qdata.element_size() == 1 and not q.weight.requires_grad
    assert q.weight.act_quant_kwargs is not None  # the dynamic-activation fp8 matmul, as the fp8 teacher's
    t = tokens()
    out, want = model(t), ref(t)
    assert rel(out, want) < 0.05
    out.float().logsumexp(-1).mean().backward()
    want.float().logsumexp(-1).mean().backward()
    got, exp = adapter_grads(model), adapter_grads(ref)
    assert set(got) == set(exp) and all(g is not None for g in got.values())
    assert max(rel(got[n], exp[n]) for n in got) < 0.15
    # merge/export: bf16, the dequantized fp8 base + (alpha / rank) * B @ A in fp32, rounded once
    sd = merged_state_dict(model)
    a, b = q.lora_a.weight.detach().float(), q.lora_b.weight.detach().float()
    expected = (q.weight.dequantize(torch.bfloat16).float() + (8.0 / 4) * b @ a).to(torch.bfloat16)
    assert sd["layers.0.attn.q_proj.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(sd["layers.0.attn.q_proj.weight"], expected, atol=0, rtol=0)
    assert not any("lora" in k for k in sd)


def test_compiled_layers_do_not_recompile_for_fp8_weights(cpu_fp8):
    from torch._dynamo.utils import counters

    ref, model = lora_pair(layers=3)
    quantize_fp8_bases(model, torch.device("cpu"))
    frames = []
    for m in (ref, model):
        torch._dynamo.reset()
        counters.clear()
        for layer in m.layers:
            layer.compile(backend="aot_eager")  # Dynamo and AOTAutograd (where a tensor subclass is flattened)
        m(tokens()).float().logsumexp(-1).mean().backward()
        assert not counters["graph_break"]
        frames.append(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    assert frames[1] == frames[0]  # the fp8 base adds no graph (and no recompile) per layer to the bf16 model's


def test_resume_state_round_trips_the_adapters(cpu_fp8):
    from llm_recipe.components.runtime import setup_runtime

    rt = setup_runtime("cpu", "bf16", 0)
    _, model = lora_pair()
    quantize_fp8_bases(model, torch.device("cpu"))
    full = rt.full_state_dict(model)  # what a checkpoint reads the adapters from
    adapters = {n: v for n, v in full.items() if "lora_" in n}
    _, fresh = lora_pair()
    torch.manual_seed(5)
    for m in lora_modules(fresh).values():
        torch.nn.init.normal_(m.lora_a.weight)
    quantize_fp8_bases(fresh, torch.device("cpu"))
    rt.load_full_state_dict(fresh, adapters, strict=False)
    for n, v in adapters.items():
        torch.testing.assert_close(fresh.get_parameter(n).detach(), v)


# -------------------------------------------------------------------------------------------- refusals
def test_cpu_refusal_names_the_key():
    _, model = lora_pair()
    with pytest.raises(RecipeError, match=r"lora.quantize_base=fp8 needs a CUDA GPU with compute capability >= 8.9"):
        quantize_fp8_bases(model, torch.device("cpu"))


def test_refusal_under_fsdp():
    _, model = lora_pair()
    with pytest.raises(RecipeError, match="runs on one GPU"):
        quantize_fp8_bases(model, torch.device("cpu"), sharded=True)


def test_refusals_shapes_dtype(cpu_fp8):
    _, odd = lora_pair(hidden=40)  # 40x40 projections: not a multiple of 16
    with pytest.raises(RecipeError, match="divisible by 16"):
        quantize_fp8_bases(odd, torch.device("cpu"))
    _, fp32 = lora_pair()
    fp32.float()
    with pytest.raises(RecipeError, match="needs dtype: bf16"):
        quantize_fp8_bases(fp32, torch.device("cpu"))


def test_qat_refuses_an_fp8_base():
    from llm_recipe.components.quantization.qat import prepare_qat

    _, model = lora_pair()
    with pytest.raises(RecipeError, match="QAT needs a plain base weight"):
        prepare_qat(model, "8da4w")


# -------------------------------------------------------------------------------------------- GPU (sm89+)
def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_sm89 = pytest.mark.skipif(not _sm89(), reason="needs a CUDA GPU with compute capability >= 8.9 (fp8 matmuls)")


@pytest.mark.gpu
@needs_sm89
def test_gpu_fp8_base_is_close_to_bf16_lora_and_smaller():
    ref, model = lora_pair("cuda", hidden=256, layers=2)
    before = torch.cuda.memory_allocated()
    quantize_fp8_bases(model, torch.device("cuda"))
    torch.cuda.synchronize()
    base = sum(m.weight.numel() for m in lora_modules(model).values())
    assert torch.cuda.memory_allocated() - before < -0.9 * base  # ~1 byte per base parameter freed
    q = model.layers[0].attn.q_proj.weight
    assert q.act_quant_kwargs is not None  # the dynamic-activation fp8 matmul, as the fp8 teacher
    t = tokens("cuda", b=4, s=64)
    out, want = model(t), ref(t)
    assert rel(out, want) < 0.1  # test_ptq's bound for fp8 weights; activations are fp8 here too
    out.float().logsumexp(-1).mean().backward()
    want.float().logsumexp(-1).mean().backward()
    got, exp = adapter_grads(model), adapter_grads(ref)
    assert max(rel(got[n], exp[n]) for n in got) < 0.2
    # a checkpoint's state (moved to the CPU) and the merged model: the dequantized base + (alpha / rank) * B @ A
    from llm_recipe.components.runtime import setup_runtime

    full = setup_runtime("cuda", "bf16", 0).full_state_dict(model)
    assert full["layers.0.attn.q_proj.weight"].device.type == "cpu"
    m = model.layers[0].attn.q_proj
    merged = merged_state_dict(model)["layers.0.attn.q_proj.weight"]
    # merged in fp32 and rounded once, as merge_lora_state_dict does (a bf16 sum rounds twice: a step apart)
    want_w = (m.weight.dequantize().float()
              + 2.0 * m.lora_b.weight.detach().float() @ m.lora_a.weight.detach().float()).bfloat16()
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged, want_w)


@pytest.mark.gpu
@needs_sm89
def test_gpu_compiled_fp8_base_does_not_recompile_per_layer():
    from torch._dynamo.utils import counters

    from llm_recipe.components.runtime import setup_runtime

    rt = setup_runtime("cuda", "bf16", 0)
    ref, model = lora_pair("cuda", hidden=256, layers=4)
    graphs, outs = [], []
    for m in (ref, model):
        torch._dynamo.reset()
        counters.clear()
        rt.prepare_model(m, compile=True)  # quantizes the pending fp8 bases, then compiles each layer (inductor)
        for _ in range(2):
            out = m(tokens("cuda", b=4, s=64))
            out.float().logsumexp(-1).mean().backward()
        assert not counters["graph_break"]
        graphs.append(counters["stats"]["unique_graphs"])
        outs.append(out.detach())
    torch._dynamo.reset()
    assert type(model.layers[0].attn.q_proj.weight).__name__ == "Float8Tensor"
    assert graphs[1] == graphs[0]
    assert rel(outs[1], outs[0]) < 0.1


def test_validate_refuses_an_fp8_base_on_cpu_or_outside_bf16_before_anything_loads(tmp_path, tiny_model_dir):
    # `recipe validate` (config load) says it: no weights, no layer scoring before the refusal. The model folder is
    # given, so the test needs no embedded assets (a GPU machine without PyPI runs it too)
    from llm_recipe.components.config import load_recipe_config
    from llm_recipe.recipes.full import CONFIG as FULL
    from llm_recipe.recipes.kd import CONFIG as KD

    for recipe, config, cfg_type in (("lora", "lora/smollm2", FULL), ("kd", "kd/smollm2_demo", KD)):
        if recipe == "lora":
            given = [f"model.checkpoint_dir={tiny_model_dir}"]
        else:
            given = [f"teacher.checkpoint_dir={tiny_model_dir}", "student.prune.keep=2", "lora={rank: 8}"]
        with pytest.raises(RecipeError, match="needs a CUDA GPU .* but device: cpu;"):
            load_recipe_config(config, [*given, "device=cpu", "lora.quantize_base=fp8"], cfg_type, recipe=recipe)
        if torch.cuda.is_available():  # the shipped device: auto; the GPU's capability is checked when placed
            with pytest.raises(RecipeError, match="needs dtype: bf16, got dtype: fp32"):
                load_recipe_config(config, [*given, "dtype=fp32", "lora.quantize_base=fp8"], cfg_type, recipe=recipe)
            load_recipe_config(config, [*given, "lora.quantize_base=fp8"], cfg_type, recipe=recipe)
        else:  # auto without a GPU: said at load too (it used to fail once the weights had loaded)
            with pytest.raises(RecipeError, match="needs a CUDA GPU .* but device: auto found no GPU;"):
                load_recipe_config(config, [*given, "lora.quantize_base=fp8"], cfg_type, recipe=recipe)
        with pytest.raises(RecipeError, match="needs dtype: bf16, got dtype: fp32"):
            load_recipe_config(config, [*given, "device=cuda", "dtype=fp32", "lora.quantize_base=fp8"], cfg_type,
                               recipe=recipe)
