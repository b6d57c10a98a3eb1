"""Shared fixtures: the embedded model (converted once per machine) and a tiny random model that shares its
tokenizer, so recipe tests run real code paths in seconds on CPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    # `make test` runs one xdist worker per core; a worker's torch (and the recipe processes it starts) would
    # otherwise use every core too, and OpenMP threads that outnumber the cores spin against each other. Each
    # worker gets its share of the cores; a user's own OMP_NUM_THREADS wins.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)


def pytest_runtest_logreport(report):
    # RECIPE_TEST_FAILURES_AT_ONCE=1 (the device scripts): a failure's traceback right under its FAILED line, not
    # only in the summary at the end, which a lent GPU machine may be taken back before (session 55 lost the cause
    # of a 2-GPU failure that way).
    if report.failed and os.environ.get("RECIPE_TEST_FAILURES_AT_ONCE") == "1":
        import sys

        sys.__stderr__.write(f"\n---- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n----\n")
        sys.__stderr__.flush()


def pytest_collection_modifyitems(config, items):
    # GPU tests skip cleanly on machines without CUDA (CI has none).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """HF folder of the embedded SmolLM2-135M-Instruct (see llm_recipe.components.assets)."""
    from llm_recipe.components.assets import ensure_assets

    return ensure_assets(quiet=True)


@pytest.fixture(scope="session")
def embedded_tokenizer_dir(request) -> Path:
    """SmolLM2's tokenizer files. RECIPE_TEST_TOKENIZER_DIR names a folder that already holds them (the GPU
    machine's harness carries them as `.carry/tok`, bench/make_carry.py: its 10-minute calls then run the GPU tests
    before the 98 MB GGUF has arrived in three parts); otherwise the embedded model's folder."""
    import json
    import os

    folder = os.environ.get("RECIPE_TEST_TOKENIZER_DIR")
    if not folder:
        return request.getfixturevalue("embedded_model_dir")
    vocab = json.loads((Path(folder) / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) == 49152, f"RECIPE_TEST_TOKENIZER_DIR={folder}: not SmolLM2's tokenizer ({len(vocab)} tokens)"
    return Path(folder)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer_dir) -> Path:
    """A 4-layer, 64-wide Llama with random weights and SmolLM2's real tokenizer and chat template."""
    from llm_recipe.components.models import ModelArgs, build_model, save_model

    args = ModelArgs.from_hf_config({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2,
    })
    torch.manual_seed(0)
    model = build_model(args)
    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    save_model(model, args, out, tokenizer_dir=embedded_tokenizer_dir)
    assert (out / "tokenizer.json").is_file()
    return out


@pytest.fixture
def tiny_copy(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model folder (for tests that write next to it)."""
    dst = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, dst)
    return dst


@pytest.fixture
def cpu_fp8(monkeypatch):
    """The fp8 path on the CPU: the recipe's device checks (fp8 LoRA base, fp8 teacher) and torchao's sm89 assert
    off (torch runs _scaled_mm on the CPU)."""
    import torchao.quantization.quant_api as quant_api

    from llm_recipe.components.quantization import fp8_base, teacher

    if not _cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only (rowwise came with torch 2.13)")
    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    monkeypatch.setattr(fp8_base, "check_fp8_base", lambda device, sharded: None)
    monkeypatch.setattr(teacher, "has_fp8_matmuls", lambda device: True)


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether torch runs an fp8 matmul with per-row scales on the CPU (torch 2.11's CPU kernel asserts)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True
