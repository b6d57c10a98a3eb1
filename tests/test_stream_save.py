"""The streaming safetensors writer (components/checkpoint/stream_save.py): files safetensors reads bit for bit,
Deferred tensors made one at a time, and checkpoints / HF folders that hold exactly what the copying path held."""

from __future__ import annotations

import functools
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llm_recipe.components.checkpoint import stream_save
from llm_recipe.components.checkpoint.stream_save import Deferred, save_tensors


def every_kind(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "bf16": torch.randn(37, 5, generator=g).bfloat16(),
        "f16": torch.randn(3, 7, generator=g).half(),
        "f32": torch.randn(11, generator=g),
        "f64": torch.randn(2, 3, generator=g).double(),
        "i64": torch.arange(-5, 9),
        "i32": torch.arange(13, dtype=torch.int32),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "f8": torch.randn(17, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 9, generator=g).t(),  # not contiguous
        "slice": torch.randn(40, generator=g)[3:30:3],
    }
    return {k: v.to(device) for k, v in out.items()}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.element_size() == 1 and a.dtype.is_floating_point:  # fp8: compare the bits
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a.cpu(), b.cpu())


def test_every_dtype_and_layout_reads_back_bit_for_bit(tmp_path):
    want = every_kind()
    path = save_tensors(tmp_path / "x.safetensors", want, metadata={"format": "pt", "note": "ours"})
    got = load_file(path)
    assert got.keys() == want.keys()
    assert all(same(got[k], want[k]) for k in want), [k for k in want if not same(got[k], want[k])]
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "ours"}
    # the data starts 8-byte aligned and every tensor at a multiple of its own item size
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert n % 8 == 0
    header = json.loads(path.read_bytes()[8:8 + n])
    assert all(v["data_offsets"][0] % want[k].element_size() == 0 for k, v in header.items() if k != "__metadata__")


def test_inputs_are_left_as_they_were(tmp_path):
    want = every_kind()
    before = {k: v.clone() for k, v in want.items()}
    save_tensors(tmp_path / "x.safetensors", want)
    assert all(same(want[k], before[k]) for k in want)


def test_deferred_tensors_are_made_once_each_and_only_while_written(tmp_path):
    made: list[str] = []
    live: list[int] = []

    def maker(name: str, value: float):
        def make() -> torch.Tensor:
            made.append(name)
            live.append(len(made))
            return torch.full((4, 3), float(value))
        return make

    tensors = {f"w{i}": Deferred(torch.Size([4, 3]), torch.float32, maker(f"w{i}", i)) for i in range(5)}
    tensors["plain"] = torch.ones(2)
    assert not made  # declaring them makes nothing
    got = load_file(save_tensors(tmp_path / "x.safetensors", tensors))
    assert sorted(made) == [f"w{i}" for i in range(5)]
    assert all(torch.equal(got[f"w{i}"], torch.full((4, 3), float(i))) for i in range(5))
    bf16 = Deferred(torch.Size([2]), torch.float32, lambda: torch.tensor([1.0, 3.0])).to(torch.bfloat16)
    assert load_file(save_tensors(tmp_path / "y.safetensors", {"b": bf16}))["b"].dtype == torch.bfloat16


def test_a_deferred_that_makes_another_shape_is_refused_by_name(tmp_path):
    bad = Deferred(torch.Size([4]), torch.float32, lambda: torch.ones(5))
    with pytest.raises(ValueError, match="wrong.*made torch.float32 \\[5\\], declared torch.float32 \\[4\\]"):
        save_tensors(tmp_path / "x.safetensors", {"ok": torch.ones(2), "wrong": bad})


def test_short_writes_are_continued(tmp_path, monkeypatch):
    """An unbuffered write may take fewer bytes than given (Linux: 2 GiB - 4 KiB at most per call)."""
    class Trickle:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            return self.f.write(bytes(data[:5]))

    with open(tmp_path / "t.bin", "wb") as f:
        stream_save._write_all(Trickle(f), memoryview(bytes(range(23))))
    assert (tmp_path / "t.bin").read_bytes() == bytes(range(23))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_lora_model_folder_streamed_equals_the_merged_copy(tiny_model_dir, tmp_path, dtype):
    """save_model from the live LoRA model (nothing copied first) writes the weights merged_state_dict gives and
    leaves the model as it was (torchtune's merge adds in place: an fp32 weight's .float() is the weight itself)."""
    from llm_recipe.components.models import LoRASettings, load_model, save_model
    from llm_recipe.components.models.convert import tune_to_hf_names
    from llm_recipe.components.models.hf_io import load_hf_state_dict
    from llm_recipe.components.models.loader import merged_state_dict

    lora = LoRASettings(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"])
    model, args = load_model(tiny_model_dir, dtype=dtype, lora=lora)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    live = {k: v.clone() for k, v in model.state_dict().items()}
    save_model(model, args, tmp_path / "m", tiny_model_dir)
    got = load_hf_state_dict(tmp_path / "m")
    want = tune_to_hf_names(merged_state_dict(model))
    want.pop("lm_head.weight", None)  # tied
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    base = load_hf_state_dict(tiny_model_dir)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"].to(got["model.norm.weight"].dtype))
    assert all(torch.equal(v, live[k]) for k, v in model.state_dict().items())  # the live model untouched


def test_a_rank_that_writes_nothing_gathers_what_the_writer_gathers_in_its_order(tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    """Several processes: each rank makes the state dict's Deferreds (FSDP gathers, every rank must join each one in
    the same order) while only rank 0 writes. `save_model(out_dir=None)` makes exactly the writer's sequence, over
    several shard files and LoRA merges (a merged weight gathers its adapter's parts, then its base); and a folder
    streamed from such Deferreds equals the one from the model's own tensors."""
    from llm_recipe.components.models import LoRASettings, hf_io, load_model, loader, save_model
    from llm_recipe.components.models.hf_io import load_hf_state_dict
    from llm_recipe.components.models.loader import lazily_merged_state_dict

    lora = LoRASettings(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"])
    model, args = load_model(tiny_model_dir, dtype="fp32", lora=lora)
    torch.manual_seed(2)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    own = model.state_dict()

    def gathers(log: list[str]) -> dict[str, Deferred]:  # what Runtime.gathered_state_dict gives a sharded model
        def make(k: str) -> torch.Tensor:
            log.append(k)
            return own[k]
        return {k: Deferred(v.shape, v.dtype, lambda k=k: make(k)) for k, v in own.items()}

    writer, other = [], []
    # small shards: several files, so their order counts too
    monkeypatch.setattr(loader, "write_hf_folder", functools.partial(hf_io.write_hf_folder, max_shard_bytes=64 << 10))
    save_model(model, args, tmp_path / "w", tiny_model_dir, state_dict=lazily_merged_state_dict(model, gathers(writer)))
    assert save_model(model, args, None, tiny_model_dir,
                      state_dict=lazily_merged_state_dict(model, gathers(other))) is None
    assert len(list((tmp_path / "w").glob("model-*.safetensors"))) > 1
    assert writer == other and any(k.endswith(".lora_a.weight") for k in writer)
    assert list(tmp_path.iterdir()) == [tmp_path / "w"]  # the other rank wrote nothing
    save_model(model, args, tmp_path / "plain", tiny_model_dir)
    got, want = load_hf_state_dict(tmp_path / "w"), load_hf_state_dict(tmp_path / "plain")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_merge_out_of_device_memory_is_done_on_the_host(tiny_model_dir, tmp_path, monkeypatch, device):
    """A GPU full at checkpoint time (QLoRA on a small card): the module that did not fit merges on the host (its
    base and adapter copied there; on the GPU this is what tells the two apart) and the HF folder is written, with
    the weights the merge on the host gives."""
    from llm_recipe.components.models import LoRASettings, load_model, loader, save_model
    from llm_recipe.components.models.convert import tune_to_hf_names
    from llm_recipe.components.models.hf_io import load_hf_state_dict

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lora = LoRASettings(rank=4, alpha=8.0, targets=["q_proj"])
    model, args = load_model(tiny_model_dir, dtype="fp32", device=device, lora=lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    want = tune_to_hf_names(loader.merged_state_dict(model, {k: v.cpu() for k, v in model.state_dict().items()}))
    want.pop("lm_head.weight", None)  # tied
    real, calls = loader.merged_weight, []

    def first_fails(module, parts, base, *a, **k):
        calls.append((module, base.device.type, {v.device.type for v in parts.values()}))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (emulated)")
        return real(module, parts, base, *a, **k)

    monkeypatch.setattr(loader, "merged_weight", first_fails)
    save_model(model, args, tmp_path / "m", tiny_model_dir)
    assert calls[0] == ("layers.0.attn.q_proj", device, {device}) and calls[1] == ("layers.0.attn.q_proj", "cpu",
                                                                                  {"cpu"})
    assert all(c[1] == device for c in calls[2:])  # the other modules still merge on their device
    got = load_hf_state_dict(tmp_path / "m")
    assert got.keys() == want.keys()
    for k in want:  # the GPU's fp32 sums may round the last bit differently from the host's
        torch.testing.assert_close(got[k], want[k], rtol=0 if device == "cpu" else 1e-6, atol=0 if device == "cpu"
                                   else 1e-6, msg=k)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_quantized_base_out_of_device_memory_is_dequantized_on_the_host(tiny_model_dir, tmp_path, monkeypatch,
                                                                          device):
    """QLoRA at checkpoint time with a full GPU: the NF4 base's dequantized copy that does not fit is made on the
    host (the quantized base copied there) and merged there, and the HF folder holds what the merge on the device
    gives."""
    from llm_recipe.components.models import LoRASettings, load_model, loader, save_model
    from llm_recipe.components.models.hf_io import load_hf_state_dict

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lora = LoRASettings(rank=4, alpha=8.0, targets=["q_proj"], quantize_base="nf4")
    model, args = load_model(tiny_model_dir, dtype="bf16", device=device, lora=lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    save_model(model, args, tmp_path / "want", tiny_model_dir)
    real, calls = loader._plain, []

    def first_fails(v):
        if hasattr(v, "get_original_weight"):  # the NF4 bases
            calls.append(v.device.type)
            if len(calls) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (emulated)")
        return real(v)

    monkeypatch.setattr(loader, "_plain", first_fails)
    save_model(model, args, tmp_path / "m", tiny_model_dir)
    assert calls[:2] == [device, "cpu"] and set(calls[2:]) == {device}  # the others dequantize on their device
    got, want = load_hf_state_dict(tmp_path / "m"), load_hf_state_dict(tmp_path / "want")
    assert got.keys() == want.keys()
    for k in want:  # the GPU's fp32 sums may round the last bit differently from the host's
        torch.testing.assert_close(got[k], want[k], rtol=0 if device == "cpu" else 1e-2, atol=0 if device == "cpu"
                                   else 1e-2, msg=k)


@pytest.mark.gpu
def test_gpu_tensors_stream_through_small_chunks(tmp_path):
    """GPU tensors through the pinned buffers, host tensors between them (a checkpoint's recipe state: optimizer
    moments on the GPU, RNG states on the host; a host tensor written before a GPU one's last chunk scrambled
    both, and resume failed with "Invalid mt19937 state")."""
    want = every_kind("cuda")
    want.update({f"host_{k}": v for k, v in every_kind("cpu").items()})
    big = torch.randn(1000, 33, device="cuda").bfloat16()
    want["big"] = big
    want["deferred"] = Deferred(big.shape, torch.float32, lambda: big.float() * 2)
    for chunk in (8, 1000, 1 << 20):
        got = load_file(save_tensors(tmp_path / f"x{chunk}.safetensors", want, chunk_bytes=chunk))
        assert all(same(got[k], want[k]) for k in want if k != "deferred"), chunk
        assert torch.equal(got["deferred"], (big.float() * 2).cpu())


@pytest.mark.gpu
def test_gpu_lora_checkpoint_streams_the_merge_done_on_the_host(tiny_model_dir, tmp_path):
    """A LoRA model on the GPU written as a checkpoint's HF folder: merged on the GPU, as the host merge gives."""
    from llm_recipe.components.models import LoRASettings, load_model, save_model
    from llm_recipe.components.models.convert import tune_to_hf_names
    from llm_recipe.components.models.hf_io import load_hf_state_dict
    from llm_recipe.components.models.loader import merged_state_dict

    lora = LoRASettings(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "gate_proj"])
    model, args = load_model(tiny_model_dir, dtype="bf16", device="cuda", lora=lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.normal_()
    save_model(model, args, tmp_path / "m", tiny_model_dir)
    got = load_hf_state_dict(tmp_path / "m")
    host = {k: v.cpu() for k, v in model.state_dict().items()}
    want = tune_to_hf_names(merged_state_dict(model, host))
    want.pop("lm_head.weight", None)
    assert got.keys() == want.keys()
    # fp32 matmuls of bf16 adapters: the GPU's sums may round the last fp32 bit differently, rarely the bf16 one
    for k in want:
        assert (got[k].float() - want[k].float()).abs().max() <= 2 ** -7 * want[k].float().abs().max(), k
