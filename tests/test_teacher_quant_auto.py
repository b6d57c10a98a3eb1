"""`teacher.quantize: auto` (the shipped 8B -> 1B KD config's value): fp8 where fp8 can run (an sm89+ GPU, an
unsharded teacher), else the run dtype, said in one line, so the same file runs on an H100 and on an A100 or an
RTX 30; an explicit `fp8` on a GPU without fp8 matmuls is refused before the teacher's weights load
(components/quantization/teacher.py, components/teacher.py). GPUs are stood in for by patching torch.cuda's
capability and name: what is checked is the decision and the words, not a kernel. A `kd` run with `auto` on the
CPU is tests/test_recipes_train.py's reference run (kd_forward)."""

from __future__ import annotations

import pytest
import torch

from llm_recipe.components import teacher as teacher_mod
from llm_recipe.components.config import load_recipe_config
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.quantization.teacher import check_teacher_quant_device, resolve_teacher_quant
from llm_recipe.recipes.kd import CONFIG as KD

CUDA = torch.device("cuda", 0)
BF16 = torch.bfloat16


@pytest.fixture
def gpu(monkeypatch):
    """Make torch.cuda report a GPU of the given name and compute capability."""

    def as_gpu(name: str, capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return as_gpu


def test_auto_is_fp8_on_an_sm89_gpu_and_bf16_on_an_a100_or_a_cpu(gpu, capsys):
    gpu("NVIDIA H200", (9, 0))
    assert resolve_teacher_quant("auto", CUDA, BF16) == "fp8"
    assert capsys.readouterr().out == "teacher.quantize=auto: fp8: NVIDIA H200 has fp8 matmuls\n"
    gpu("NVIDIA GeForce RTX 4090", (8, 9))
    assert resolve_teacher_quant("auto", CUDA, BF16, say=False) == "fp8" and capsys.readouterr().out == ""
    gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    assert resolve_teacher_quant("auto", CUDA, BF16) is None
    assert capsys.readouterr().out == ("teacher.quantize=auto: null, the teacher runs in the run dtype: this GPU "
                                       "(NVIDIA A100-SXM4-80GB) is sm80 (fp8 matmuls need compute capability >= 8.9)\n")
    assert resolve_teacher_quant("auto", torch.device("cpu"), torch.float32) is None
    assert "the teacher is on the CPU (fp8 matmuls need" in capsys.readouterr().out


def test_auto_keeps_a_teacher_in_fp32_or_fp16_and_explicit_fp8_needs_bf16(gpu, capsys, monkeypatch, tmp_path):
    """torchao's per-row fp8 asserts bf16 weights: with dtype fp32 the teacher loaded, its drift was measured, then
    an AssertionError traceback. `auto` keeps such a run's teacher in its dtype; an explicit fp8 is refused at load."""
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert resolve_teacher_quant("auto", CUDA, torch.float32) is None
    assert capsys.readouterr().out == ("teacher.quantize=auto: null, the teacher runs in the run dtype: the run dtype "
                                       "is float32 (fp8 with a scale per row needs bf16)\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RecipeError, match=r"teacher.quantize=fp8 needs dtype: bf16 .* but dtype is fp16; set dtype: "
                                          r"bf16, or teacher.quantize: auto or null"):
        load_recipe_config("kd/llama3_1_8b_to_llama3_2_1b", ["teacher.quantize=fp8", "dtype=fp16",
                                                             f"output_dir={tmp_path}/out"], KD)


def test_auto_keeps_a_sharded_teacher_in_the_run_dtype(gpu, capsys):
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    assert resolve_teacher_quant("auto", CUDA, BF16, sharded=True) is None
    assert "the teacher is sharded (teacher.placement), and fp8 needs one full copy per GPU" in capsys.readouterr().out


def test_other_values_pass_through_unchanged_and_fp8_needs_fp8_matmuls(gpu, capsys):
    gpu("NVIDIA H100 80GB HBM3", (9, 0))
    for mode in (None, "fp8", "int8_weight_only"):
        assert resolve_teacher_quant(mode, CUDA, BF16) == mode
    gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    for mode in (None, "int8_weight_only"):
        assert resolve_teacher_quant(mode, CUDA, BF16) == mode
    assert capsys.readouterr().out == ""
    with pytest.raises(RecipeError, match=r"^teacher.quantize=fp8 needs a CUDA GPU .* is sm80"):
        resolve_teacher_quant("fp8", CUDA, BF16)


def test_explicit_fp8_on_an_a100_is_refused_before_the_teacher_loads(gpu, monkeypatch, tmp_path):
    gpu("NVIDIA A100-SXM4-80GB", (8, 0))
    with pytest.raises(RecipeError, match=r"^teacher.quantize=fp8 needs a CUDA GPU with compute capability >= 8.9 "
                                          r"\(fp8 matmuls\), but this GPU \(NVIDIA A100-SXM4-80GB\) is sm80; use "
                                          r"teacher.quantize: int8_weight_only or null$"):
        check_teacher_quant_device("fp8", CUDA)
    for mode in (None, "auto", "int8_weight_only"):
        check_teacher_quant_device(mode, CUDA)

    # load_teacher says it before reading a byte of the teacher's weights
    loaded = []
    monkeypatch.setattr(teacher_mod, "load_model", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(
        AssertionError("the teacher was loaded")))
    cfg = load_recipe_config("kd/llama3_1_8b_to_llama3_2_1b", ["teacher.quantize=fp8"], KD, recipe="kd")

    class Rt:
        device, is_main = CUDA, True

    with pytest.raises(RecipeError, match=r"^teacher.quantize=fp8 needs a CUDA GPU .* is sm80"):
        teacher_mod.load_teacher(cfg.teacher, {}, Rt(), cfg.student.checkpoint_dir, 1.0, 2048, compile=False)
    assert loaded == []


def test_the_shipped_8b_config_is_auto_and_the_key_names_it():
    cfg = load_recipe_config("kd/llama3_1_8b_to_llama3_2_1b", [], KD, recipe="kd")
    assert cfg.teacher.quantize == "auto"
    with pytest.raises(RecipeError, match=r"key 'teacher.quantize' must be one of auto, fp8, int8_weight_only "
                                          r"\(or null\), got 'fp16'"):
        load_recipe_config("kd/llama3_1_8b_to_llama3_2_1b", ["teacher.quantize=fp16"], KD, recipe="kd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_this_gpu_follows_its_capability(capsys):
    expected = "fp8" if torch.cuda.get_device_capability(CUDA) >= (8, 9) else None
    assert resolve_teacher_quant("auto", CUDA, BF16) == expected
    assert torch.cuda.get_device_name(CUDA) in capsys.readouterr().out
