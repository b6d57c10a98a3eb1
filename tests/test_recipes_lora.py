"""The lora recipe end to end through `recipe run`, on tiny random models with SmolLM2's tokenizer: the adapter
peft applies to the base with the logits of the merged model, DoRA, QLoRA (the merged model is the NF4 base plus
the adapter), and the fp8 base (its one-line error on CPU; on a GPU compiled, resumed and merged). The other
training recipes: test_recipes_train.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import recipes_common as rc
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

STEP_KEYS, LR = rc.STEP_KEYS, rc.LR
assert_loads_like_hf, assert_peft_matches_merged = rc.assert_loads_like_hf, rc.assert_peft_matches_merged


def lora_overrides(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [*rc.COMMON, f"model.checkpoint_dir={model_dir}", f"output_dir={out}", "max_steps=2", *LR,
            "lora.rank=4", "lora.alpha=8.0", *extra]


def test_lora_recipe_adapter_loads_in_peft(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    proc = rc.run_cli("lora", "lora/smollm2", lora_overrides(tiny_model_dir, out), cwd=tmp_path)
    rc.assert_ok(proc)
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    rc.assert_metrics(out, 2, STEP_KEYS)
    rc.assert_png(out / "loss.png")
    assert_loads_like_hf(out / "model")
    assert_peft_matches_merged(tiny_model_dir, out)
    # model/ is a copy of the final checkpoint's merged HF folder (not merged and serialized a second time), not a
    # hard link to it; the checkpoint's size and time are said
    (ckpt,) = (out / "checkpoints").iterdir()
    ours, theirs = out / "model" / "model.safetensors", ckpt / "model.safetensors"
    assert ours.read_bytes() == theirs.read_bytes() and not ours.samefile(theirs)
    assert f"checkpoint: {ckpt} (" in proc.stdout and " GB) written in " in proc.stdout, proc.stdout
    # Frozen weights are saved untouched (only targeted projections change, by the merged adapter).
    before, after = rc.weights(tiny_model_dir), rc.weights(out / "model")
    assert torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"])
    assert torch.equal(before["model.layers.2.input_layernorm.weight"], after["model.layers.2.input_layernorm.weight"])


def test_dora_adapter_loads_in_peft(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    assert rc.run_in_process("lora", "lora/smollm2", lora_overrides(tiny_model_dir, out, "lora.use_dora=true")) == 0
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    assert_peft_matches_merged(tiny_model_dir, out)


@pytest.fixture(scope="module")
def qlora_model(tmp_path_factory, embedded_model_dir) -> Path:
    # torchao's NF4 (block 64, scalers double-quantized in blocks of 256) needs every quantized weight's size to
    # be a multiple of 64 * 256 = 16384: the 64-wide tiny model's 64x64 projections are too small, so QLoRA
    # gets its own 128-wide model with 4 KV heads (all projections 128x128 or 128x256).
    return rc.make_llama(tmp_path_factory.mktemp("qlora") / "m", embedded_model_dir, seed=2, hidden=128,
                         intermediate=256, layers=2, heads=4, kv_heads=4)


def test_qlora_merges_onto_the_nf4_base(tmp_path, qlora_model):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as nf4

    out = tmp_path / "out"
    assert rc.run_in_process("lora", "lora/smollm2", lora_overrides(qlora_model, out, "lora.quantize_base=true")) == 0
    rc.assert_metrics(out, 2, STEP_KEYS)
    assert_loads_like_hf(out / "model")
    # The merged model is what was trained: the NF4-rounded base plus the adapter's (alpha/rank) * B @ A.
    from safetensors.torch import load_file

    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    base, merged = rc.weights(qlora_model), rc.weights(out / "model")
    name = "model.layers.1.self_attn.q_proj"
    a = next(v for k, v in adapter.items() if k.endswith(f"{name}.lora_A.weight"))
    b = next(v for k, v in adapter.items() if k.endswith(f"{name}.lora_B.weight"))
    expected = nf4(base[f"{name}.weight"]).get_original_weight() + (8.0 / 4) * b @ a
    torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    assert b.abs().max() > 0


def test_qlora_on_smollm2_sized_projections(tmp_path, embedded_model_dir):
    # 96x96 projections (9216 = 144 NF4 blocks): like SmolLM2-135M's 576x576 (5184 blocks), not a multiple of 256.
    model = rc.make_llama(tmp_path / "m96", embedded_model_dir, seed=3, hidden=96, intermediate=192, layers=1,
                          heads=3, kv_heads=3)
    code = rc.run_in_process("lora", "lora/smollm2", lora_overrides(model, tmp_path / "out", "lora.quantize_base=true",
                                                                   "max_steps=1"))
    assert code == 0


def test_fp8_base_on_cpu_says_what_to_change(tmp_path, embedded_model_dir, capsys):
    # lora.quantize_base=fp8 needs fp8 matmuls (sm89+); tests/test_fp8_base.py has the rest
    model = rc.make_llama(tmp_path / "m", embedded_model_dir, seed=2, layers=1)
    code = rc.run_in_process("lora", "lora/smollm2", lora_overrides(model, tmp_path / "out", "dtype=bf16",
                                                                   "max_steps=1", "lora.quantize_base=fp8"))
    assert code != 0
    err = capsys.readouterr().err
    assert "lora.quantize_base=fp8 needs a CUDA GPU" in err and "nf4 or false" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with compute capability >= 8.9 (fp8 matmuls)")
def test_fp8_base_trains_compiled_resumes_and_merges_on_gpu(tmp_path, embedded_model_dir):
    # lora.quantize_base=fp8 through the recipe: compiled layers, a checkpoint, resume, the merged bf16 model
    model = rc.make_llama(tmp_path / "m", embedded_model_dir, seed=2, layers=2)
    out = tmp_path / "out"
    gpu = ["device=cuda", "dtype=bf16", "compile=true", "lora.quantize_base=fp8", "save_every_n_steps=1"]
    assert rc.run_in_process("lora", "lora/smollm2", lora_overrides(model, out, *gpu)) == 0
    assert rc.run_in_process("lora", "lora/smollm2", lora_overrides(model, out, *gpu, "max_steps=3",
                                                                   "resume=true")) == 0
    rc.assert_metrics(out, 3, STEP_KEYS)
    merged = rc.weights(out / "model")
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert (out / "adapter" / "adapter_model.safetensors").exists()
