"""Safetensors read straight into a model's tensors (components/models/stream_load.py): the same bytes as
safetensors' own loader, across shards, chunks, threads and a dtype conversion; one-line errors for a wrong shape or
a short file; on a GPU, `load_model` through it gives the CPU build's weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import load_model
from llm_recipe.components.models.stream_load import read_into, stored_tensors


def sharded_folder(path):
    """Two shards, bf16 / fp32 / int64 tensors of odd byte sizes, with an index as HF writes it."""
    g = torch.Generator().manual_seed(0)
    shards = {
        "model-00001-of-00002.safetensors": {f"w{i}": torch.randn(37 + i, 129, generator=g).bfloat16() for i in range(4)},
        "model-00002-of-00002.safetensors": {"f": torch.randn(5, 7, 3, generator=g),
                                             "ids": torch.arange(11, dtype=torch.int64), "b": torch.randn(1)},
    }
    path.mkdir()
    for name, sd in shards.items():
        save_file(sd, path / name)
    weight_map = {k: name for name, sd in shards.items() for k in sd}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {k: v for sd in shards.values() for k, v in sd.items()}


@pytest.mark.parametrize("threads,chunk_bytes", [(1, 64 << 20), (3, 40), (8, 8)])
def test_read_into_gives_safetensors_bytes(tmp_path, threads, chunk_bytes):
    want = sharded_folder(tmp_path / "m")
    stored = stored_tensors(tmp_path / "m")
    assert set(stored) == set(want)
    targets = {k: torch.full_like(v, 3) for k, v in want.items()}
    read_into(targets, stored, threads=threads, chunk_bytes=chunk_bytes)
    for k, v in want.items():
        assert torch.equal(targets[k], v), k


def test_read_into_converts_dtype_like_load_state_dict(tmp_path):
    want = sharded_folder(tmp_path / "m")
    stored = stored_tensors(tmp_path / "m")
    targets = {k: torch.zeros(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype) for k, v in want.items()}
    targets["f"] = torch.zeros(5, 7, 3, dtype=torch.bfloat16)  # an fp32 tensor into a bf16 model
    read_into(targets, stored, threads=2, chunk_bytes=24)
    assert torch.equal(targets["f"], want["f"].bfloat16())
    assert torch.equal(targets["w2"], want["w2"].float())


def test_single_file_matches_load_file(tmp_path):
    sd = {"a": torch.randn(300, 1000).bfloat16(), "b": torch.randn(3, 3).half()}
    save_file(sd, tmp_path / "model.safetensors")
    targets = {k: torch.empty_like(v) for k, v in sd.items()}
    read_into(targets, stored_tensors(tmp_path), threads=4, chunk_bytes=4096)
    ref = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(targets[k], ref[k]) for k in sd)


def test_wrong_shape_names_the_tensor(tmp_path):
    sharded_folder(tmp_path / "m")
    stored = stored_tensors(tmp_path / "m")
    targets = {"w1": torch.empty(38, 128, dtype=torch.bfloat16)}
    with pytest.raises(RecipeError, match=r"model-00001-of-00002.safetensors: w1 has shape \[38, 129\], the model "
                                          r"expects \[38, 128\]"):
        read_into(targets, {"w1": stored["w1"]})


def test_truncated_file_is_a_one_line_error(tmp_path):
    sd = {"a": torch.randn(64, 64), "z": torch.randn(64, 64)}
    save_file(sd, tmp_path / "model.safetensors")
    stored = stored_tensors(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    last = max(stored, key=lambda k: stored[k].start)
    with pytest.raises(RecipeError, match=f"model.safetensors: ends inside {last}"):
        read_into({k: torch.empty(64, 64) for k in sd}, stored, threads=2)


def test_folders_without_safetensors_are_left_to_the_usual_loader(tmp_path):
    assert stored_tensors(tmp_path) is None
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")  # no readable header
    assert stored_tensors(tmp_path) is None


def test_nothing_to_read_is_not_an_error():
    read_into({}, {})


@pytest.mark.gpu
def test_gpu_read_into_through_small_chunks_threads_and_a_conversion(tmp_path):
    want = sharded_folder(tmp_path / "m")
    stored = stored_tensors(tmp_path / "m")
    for threads, chunk_bytes in [(3, 4096), (8, 8), (1, 1 << 20)]:
        torch.cuda.synchronize()
        targets = {k: torch.full(v.shape, 7, dtype=v.dtype, device="cuda") for k, v in want.items()}
        targets["f"] = torch.full((5, 7, 3), 7, dtype=torch.bfloat16, device="cuda")  # fp32 stored, bf16 model
        read_into(targets, stored, threads=threads, chunk_bytes=chunk_bytes)
        for k, v in want.items():  # read on the default stream, without a synchronize of our own
            assert torch.equal(targets[k].cpu(), v.bfloat16() if k == "f" else v), (k, threads, chunk_bytes)


@pytest.mark.gpu
def test_gpu_load_model_reads_the_weights_of_the_cpu_build(tiny_model_dir, monkeypatch):
    from llm_recipe.components.models import LoRASettings, loader

    calls = []
    monkeypatch.setattr(loader, "read_into", lambda *a, **k: (calls.append(1), read_into(*a, **k)))
    cpu, _ = load_model(tiny_model_dir, dtype="bf16", device="cpu")
    assert not calls  # a host build keeps the memory map
    gpu, _ = load_model(tiny_model_dir, dtype="bf16", device="cuda")
    assert calls  # the GPU build streamed
    want, got = cpu.state_dict(), gpu.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k].cpu()) for k in want)
    lora = LoRASettings(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    pruned, args = load_model(tiny_model_dir, dtype="fp32", device="cuda", keep_layers=[0, 3], lora=lora)
    want, _ = load_model(tiny_model_dir, dtype="fp32", device="cpu", keep_layers=[0, 3], lora=lora)
    assert args.num_layers == 2
    got, want = pruned.state_dict(), want.state_dict()
    base = [k for k in want if ".lora_" not in k]
    assert "layers.1.attn.q_proj.weight" in base
    assert all(torch.equal(want[k], got[k].cpu()) for k in base)


def test_ranks_of_one_node_share_the_cores(monkeypatch):
    from llm_recipe.components.models import stream_load

    monkeypatch.setattr(stream_load.os, "cpu_count", lambda: 64)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert stream_load.default_threads() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert stream_load.default_threads() == 4
    monkeypatch.setattr(stream_load.os, "cpu_count", lambda: 2)
    assert stream_load.default_threads() == 1
