"""The quantize recipe in-process on the tiny model: the GGUF type follows the scheme, a scheme the device cannot
run fails before any weights load, report.json is written atomically."""

import json
import logging
import os
import sys
import time

import pytest
import recipes_common as rc
import torch

from llm_recipe.components.folders import LOCK_NAME
from llm_recipe.components.quantization.export_gguf import gguf_tensor_types

CONFIG = "quantize/smollm2_8da4w"


def quick(tiny_model_dir, out, *overrides):
    return [f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={out}", "perplexity.limit=2",
            "perplexity.max_seq_len=32", "device=cpu", *overrides]


def gguf_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name.endswith("export_gguf") and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("scheme, overrides, qtype", [
    ("int8_weight_only", [], "Q8_0"),           # auto: an int8 scheme gives an 8-bit GGUF, packed code for code
    ("8da4w", [], "Q4_0"),                      # auto: int4 weights give Q4_0
    ("int8_weight_only", ["gguf_qtype=Q4_0"], "Q4_0"),  # an explicit type still wins
])
def test_gguf_type_follows_the_scheme(tmp_path, tiny_model_dir, caplog, scheme, overrides, qtype):
    out = tmp_path / "q"
    assert rc.run_in_process("quantize", CONFIG, quick(tiny_model_dir, out, f"scheme={scheme}", "formats=[gguf]",
                                                       *overrides)) == 0
    assert [p.name for p in out.glob("*.gguf")] == [f"model-{qtype}.gguf"]
    types = gguf_tensor_types(out / f"model-{qtype}.gguf")
    blocks = {t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")}
    assert blocks == {qtype} and types["token_embd.weight"] == "Q8_0"
    assert json.loads((out / "report.json").read_text())["gguf_qtype"] == qtype
    warned = gguf_warnings(caplog)
    if overrides:  # int8 codes forced into Q4_0 blocks: requantized, said once with a count (4 layers x 7)
        assert len(warned) == 1 and "28 torchao Int8Tensor weights" in warned[0], warned
    else:
        assert warned == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("scheme, match", [("int4_weight_only", "key 'scheme': int4_weight_only needs a CUDA GPU, "
                                                                 "but device: cpu"),
                                           ("float8_dynamic", "key 'scheme': float8_dynamic needs a CUDA GPU with "
                                                              "compute capability >= 8.9 (Ada/Hopper), but device: cpu")])
def test_scheme_the_device_cannot_run_fails_before_the_weights_load(tmp_path, tiny_model_dir, monkeypatch, capsys,
                                                                     scheme, match):
    from llm_recipe.recipes import quantize

    loads = []
    monkeypatch.setattr(quantize, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("weights loaded"))
    t0 = time.perf_counter()
    code = rc.run_in_process("quantize", CONFIG, quick(tiny_model_dir, tmp_path / "q", f"scheme={scheme}"))
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 1 and loads == []
    (line,) = [ln for ln in err.splitlines() if ln.startswith("recipe: error:")]
    assert match in line and "Traceback" not in err
    assert elapsed < 5, elapsed  # no model, no tokenizer, no LAMBADA texts


def test_report_is_written_atomically(tmp_path, tiny_model_dir, monkeypatch):
    out = tmp_path / "q"
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: replaced.append(os.fspath(dst)) or real_replace(src, dst))
    assert rc.run_in_process("quantize", CONFIG, quick(tiny_model_dir, out, "scheme=int8_weight_only",
                                                       "formats=[gguf]")) == 0
    assert str(out / "report.json") in replaced  # a complete temp file renamed into place, never a half-written one
    assert json.loads((out / "report.json").read_text())["scheme"] == "int8_weight_only"
    # no temp file left; the hidden record of what the exports were computed from (components/result_runs.py)
    assert [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME] == [".quantize_run.json"]


def test_each_part_says_when_it_starts_and_how_long_it_took(tmp_path, tiny_model_dir, capsys):
    """A CPU run of the pte export takes minutes: each part prints a line as it starts and one as it ends. (A rerun
    into the same folder: tests/test_result_runs.py.)"""
    capsys.readouterr()
    assert rc.run_in_process("quantize", CONFIG, quick(tiny_model_dir, tmp_path / "q", "scheme=8da4w",
                                                       "formats=[gguf]")) == 0
    stdout = capsys.readouterr().out
    for part in ("weights", "perplexity before, 2 LAMBADA texts", "8da4w quantization", "gguf export (Q4_0)"):
        assert f"quantize: {part} ...\n" in stdout and f"quantize: {part}: " in stdout, part


def test_a_pte_export_without_executorch_fails_before_any_work(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """formats=[hf, pte] without ExecuTorch: one line naming the extra before the weights load; nothing is written
    (it used to fail after the perplexities and the hf export, leaving a folder of mixed runs)."""
    monkeypatch.setitem(sys.modules, "executorch", None)
    monkeypatch.setitem(sys.modules, "executorch.exir", None)
    out = tmp_path / "q"
    capsys.readouterr()
    assert rc.run_in_process("quantize", CONFIG, quick(tiny_model_dir, out, "formats=[hf,pte]")) == 1
    captured = capsys.readouterr()
    assert "recipe: error: exporting a .pte needs ExecuTorch" in captured.err
    assert "quantize: weights" not in captured.out and not (out / "hf").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and compute capability >= 8.9 for float8)")
@pytest.mark.parametrize("scheme, blocks", [("int4_weight_only", "Q4_0"), ("float8_dynamic", "Q8_0")])
def test_gpu_only_schemes_export_hf_and_gguf(tmp_path, tiny_model_dir, scheme, blocks):
    """The GPU-only schemes through the recipe as a user runs them (`device=cuda`, hf + GGUF). Both failed with a
    traceback: float8_dynamic's per-row weights need a bf16 model, and the int4 tinygemm weight has no dequantize
    for the GGUF. The GGUF's matrices are the float weights to within the 4/8-bit grids (a transposed read-back of
    the int4 weight would be off by its whole norm)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    out = tmp_path / "q"
    assert rc.run_in_process("quantize", CONFIG, quick(tiny_model_dir, out, f"scheme={scheme}", "device=cuda",
                                                       "formats=[hf,gguf]")) == 0
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["exports"]) == ["gguf", "hf"]
    assert report["perplexity_after"] != report["perplexity_before"]  # measured on the quantized weights
    (path,) = out.glob("*.gguf")
    types = gguf_tensor_types(path)
    assert {t for n, t in types.items() if n.startswith("blk.") and not n.endswith("norm.weight")} == {blocks}
    want = load_file(next(tiny_model_dir.glob("*.safetensors")))["model.layers.1.mlp.down_proj.weight"].float()
    got = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.1.ffn_down.weight"]
    got = torch.from_numpy(np.array(gguf.quants.dequantize(got.data, got.tensor_type))).reshape(want.shape)
    assert ((got - want).norm() / want.norm()).item() < (0.2 if blocks == "Q4_0" else 0.05)
