"""Shared fixtures: the embedded model (converted once per machine) and a tiny random model that shares its
tokenizer, so recipe tests run real code paths in seconds on CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch


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
def tiny_model_dir(tmp_path_factory, embedded_model_dir) -> Path:
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
    save_model(model, args, out, tokenizer_dir=embedded_model_dir)
    assert (out / "tokenizer.json").is_file()
    return out


@pytest.fixture
def tiny_copy(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model folder (for tests that write next to it)."""
    dst = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, dst)
    return dst
