"""Runtime: device/dtype policy, seeding, per-layer activation checkpointing and compile, state dicts, and a
two-process gloo run (torchrun env vars, all-reduce, FSDP2 sharding and full state dict gathering)."""

from __future__ import annotations

import os
import random
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.runtime import setup_runtime


class Layer(nn.Module):
    """Stands in for a torchtune TransformerSelfAttentionLayer: forward(x, mask=None, input_pos=None)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Linear(d, d)
        self.calls = 0

    def forward(self, x, mask=None, input_pos=None):
        if not torch.compiler.is_compiling():
            self.calls += 1
        return x + torch.tanh(self.ff(self.norm(x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 16, n_layers: int = 2, vocab: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([Layer(d) for _ in range(n_layers)])
        self.out = nn.Linear(d, vocab)
        self.register_buffer("cache", torch.ones(4))

    def forward(self, tokens, mask=None):
        h = self.tok(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask)
        return self.out(h)


def _tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def _loss_and_grads(model, tokens):
    loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def test_cpu_runtime_fields_and_dtype_policy():
    rt = setup_runtime("cpu", "fp32", seed=0)
    assert (rt.device.type, rt.dtype, rt.rank, rt.world_size, rt.is_main, rt.distributed) == (
        "cpu",
        torch.float32,
        0,
        1,
        True,
        False,
    )
    assert setup_runtime("auto", "bf16", seed=0).dtype == (
        torch.bfloat16 if torch.cuda.is_available() else torch.float32  # documented CPU fallback
    )
    with pytest.raises(RecipeError, match="dtype=fp16 needs a CUDA GPU"):
        setup_runtime("cpu", "fp16", seed=0)
    with pytest.raises(RecipeError, match="dtype='float64' is not supported"):
        setup_runtime("cpu", "float64", seed=0)
    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match="device='cuda' but CUDA is not available"):
            setup_runtime("cuda", "fp32", seed=0)
    with pytest.raises(RecipeError, match="device='tpu9'"):
        setup_runtime("tpu9", "fp32", seed=0)


def test_seed_makes_every_rng_repeat():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    setup_runtime("cpu", "fp32", seed=123)
    a = draw()
    setup_runtime("cpu", "fp32", seed=123)
    assert draw() == a
    setup_runtime("cpu", "fp32", seed=124)
    assert draw() != a


def test_activation_checkpointing_recomputes_and_keeps_names_and_grads():
    rt = setup_runtime("cpu", "fp32", seed=0)
    tokens = torch.randint(0, 32, (2, 5))
    ref = _tiny()
    ref_loss, ref_grads = _loss_and_grads(ref, tokens)
    model = rt.prepare_model(_tiny(), activation_checkpointing=True)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert type(model.layers[0]) is Layer
    loss, grads = _loss_and_grads(model, tokens)
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():
        assert torch.equal(grads[n], g), n
    # Each layer ran its forward twice (forward + recomputation in backward); once without checkpointing.
    assert [layer.calls for layer in model.layers] == [2, 2]
    assert [layer.calls for layer in ref.layers] == [1, 1]
    with torch.no_grad():
        model(tokens)
    assert [layer.calls for layer in model.layers] == [3, 3]


def test_compile_per_layer_on_cpu_matches_eager():
    rt = setup_runtime("cpu", "fp32", seed=0)
    tokens = torch.randint(0, 32, (2, 5))
    ref_loss, ref_grads = _loss_and_grads(_tiny(), tokens)
    model = rt.prepare_model(_tiny(), activation_checkpointing=True, compile=True)
    assert list(dict(model.named_parameters())) == list(ref_grads)
    loss, grads = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss, ref_loss)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, msg=n)


def test_prepare_model_casts_plain_floats_and_needs_layers():
    rt = setup_runtime("cpu", "fp32", seed=0)
    rt.dtype = torch.bfloat16  # as on a bf16 GPU
    model = _tiny()
    model.register_buffer("ids", torch.arange(3))
    rt.prepare_model(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.cache.dtype == torch.bfloat16 and model.ids.dtype == torch.int64
    with pytest.raises(RecipeError, match="Linear has no `layers` ModuleList"):
        rt.prepare_model(nn.Linear(2, 2), activation_checkpointing=True)
    with pytest.raises(RecipeError, match="fsdp=true needs a distributed run"):
        rt.prepare_model(_tiny(), fsdp=True)


def test_state_dicts_memory_and_collectives_single_process():
    rt = setup_runtime("cpu", "fp32", seed=0)
    model = rt.prepare_model(_tiny(0))
    sd = rt.full_state_dict(model)
    other = _tiny(1)
    rt.load_full_state_dict(other, sd)
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    opt = torch.optim.AdamW(model.parameters())
    assert rt.optimizer_state_dict(model, opt) == opt.state_dict()
    assert rt.all_reduce_mean(3.0) == 3.0 and rt.all_reduce_sum(torch.tensor(2.0)) == 2.0
    assert rt.all_reduce_max(torch.tensor([4, 1])).tolist() == [4, 1]
    assert rt.broadcast_object({"a": 1}) == {"a": 1}
    rt.barrier()
    big = torch.ones(64, 2**20, dtype=torch.uint8)  # 64 MiB touched: the RSS peak is at least that
    big.add_(1)
    assert 0.0625 < rt.peak_memory_gib() < 512
    rt.teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        rt = setup_runtime("cpu", "fp32", seed=7)
        out = {"rank": rt.rank, "distributed": rt.distributed, "is_main": rt.is_main}
        out["rand"] = torch.rand(2).tolist()  # same seed on every rank
        out["mean"] = rt.all_reduce_mean(float(rank))
        out["sum"] = rt.all_reduce_sum(torch.tensor([1.0, rank])).tolist()
        most = rt.all_reduce_max(torch.tensor([[rank, 5 - rank, 0]]))  # on-policy batch sizes: int64, on the host
        out["max"] = (most.tolist(), str(most.dtype), most.device.type)
        out["bcast"] = rt.broadcast_object(f"from {rank}")

        model = rt.prepare_model(_tiny(0), activation_checkpointing=True)  # fsdp: auto because world_size > 1
        from torch.distributed.fsdp import FSDPModule

        out["sharded"] = isinstance(model, FSDPModule) and all(
            isinstance(m, FSDPModule) for m in model.layers
        )
        tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(rank))
        loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.step()
        sd = rt.full_state_dict(model)
        # Tensors cross the queue as safetensors bytes (shared-memory tensors die with the worker).
        out["sd"] = st_save(sd) if sd else b""
        osd = rt.optimizer_state_dict(model, opt)
        out["opt_keys"] = sorted(osd.get("state", {}))
        # Round trip: load rank 0's full state into a fresh sharded model.
        fresh = rt.prepare_model(_tiny(5))
        rt.load_full_state_dict(fresh, sd if rt.is_main else {})
        reloaded = rt.full_state_dict(fresh)
        out["reloaded"] = st_save(reloaded) if reloaded else b""
        rt.teardown()
        queue.put(out)
    except Exception as e:  # surface the worker's error in the test
        queue.put({"rank": rank, "error": repr(e)})
        raise


def test_two_process_gloo_fsdp2():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        out = queue.get(timeout=120)
        results[out["rank"]] = out
    for p in procs:
        p.join(timeout=30)
    assert not [r["error"] for r in results.values() if "error" in r]
    r0, r1 = results[0], results[1]
    for r in (r0, r1):
        r["sd"], r["reloaded"] = (st_load(r[k]) if r[k] else {} for k in ("sd", "reloaded"))
    assert r0["distributed"] and r0["is_main"] and not r1["is_main"]
    assert r0["rand"] == r1["rand"]
    assert r0["mean"] == r1["mean"] == 0.5
    assert r0["sum"] == r1["sum"] == [2.0, 1.0]
    assert r0["max"] == r1["max"] == ([[1, 5, 0]], "torch.int64", "cpu")
    assert r0["bcast"] == r1["bcast"] == "from 0"
    assert r0["sharded"] and r1["sharded"]
    # Rank 0 holds the gathered full state dict (plain tensors, full shapes), rank 1 an empty one.
    ref = _tiny(0).state_dict()
    assert set(r0["sd"]) == set(ref) and r1["sd"] == {}
    for k, v in ref.items():
        assert type(r0["sd"][k]) is torch.Tensor and r0["sd"][k].shape == v.shape, k
    # The step changed the weights (gradients were averaged across ranks and applied to every shard).
    assert not torch.equal(r0["sd"]["layers.0.ff.weight"], ref["layers.0.ff.weight"])
    assert len(r0["opt_keys"]) == len(list(_tiny().parameters()))
    for k, v in r0["sd"].items():
        assert torch.equal(r0["reloaded"][k], v), k


def test_activation_checkpointing_auto_follows_free_memory(monkeypatch, tiny_model_dir):
    """`activation_checkpointing: auto` checkpoints only when the estimated activations + training state do not fit
    in the GPU's free memory, and says why; on CPU it stays off."""
    from llm_recipe.components import memory
    from llm_recipe.components.models import load_model

    model, _ = load_model(tiny_model_dir, dtype=torch.float32)
    assert memory.needs_checkpointing(model, 4096, torch.bfloat16, torch.device("cpu")) == (False, "off on CPU")
    acts = memory.activation_bytes(model, 4096, torch.bfloat16)
    need = acts + memory.training_state_bytes(model) + memory.RESERVE_BYTES
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(need / memory.USABLE_FRACTION) + 2**20, 0))
    on, why = memory.needs_checkpointing(model, 4096, torch.bfloat16, cuda)
    assert not on and why.startswith("off: about") and "4096 tokens per micro-batch" in why
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(need / memory.USABLE_FRACTION) - 2**20, 0))
    on, why = memory.needs_checkpointing(model, 4096, torch.bfloat16, cuda)
    assert on and why.startswith("on: about")
    # twice the tokens, twice the activations
    assert memory.activation_bytes(model, 8192, torch.bfloat16) == 2 * acts


def test_a_sharded_model_built_on_this_gpu_is_not_counted_twice(monkeypatch, tiny_model_dir):
    """Under FSDP a model built on this GPU (Runtime.build_device) is freed by the sharding: the checkpointing
    decision counts 1/N of its weights, not 1/N more on top of the full copy that free memory no longer shows."""
    from llm_recipe.components import memory
    from llm_recipe.components.models import load_model

    model, _ = load_model(tiny_model_dir, dtype=torch.float32)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    acts = memory.activation_bytes(model, 4096, torch.bfloat16)
    need = acts + (memory.training_state_bytes(model) + weights) // 2 + memory.RESERVE_BYTES
    free_with_copy = int(need / memory.USABLE_FRACTION) - weights + 2**20  # the full copy is using `weights` now
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_with_copy, 0))
    cuda = torch.device("cuda", 0)
    assert memory.needs_checkpointing(model, 4096, torch.bfloat16, cuda, 2)[0]  # as if the copy were elsewhere
    on, why = memory.needs_checkpointing(model, 4096, torch.bfloat16, cuda, 2, built_here=True)
    assert not on and why.startswith("off:")


def test_a_model_gathered_for_the_whole_step_counts_all_its_weights_and_unsharded_gradients(monkeypatch,
                                                                                             tiny_model_dir):
    """Gathered once per step (components/fsdp.py), a sharded model keeps all of its weights and a gradient per
    trained weight on each GPU through the step; only the optimizer state stays 1/N: the decision counts that."""
    from llm_recipe.components import memory
    from llm_recipe.components.models import load_model

    model, _ = load_model(tiny_model_dir, dtype=torch.float32)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # in the weights' dtype (fp32 here)
    need = (memory.activation_bytes(model, 4096, torch.bfloat16) + memory.training_state_bytes(model) // 2 + weights
            + grads + memory.RESERVE_BYTES)
    cuda = torch.device("cuda", 0)
    for margin, on in ((2**20, False), (-(2**20), True)):
        free_with_copy = int(need / memory.USABLE_FRACTION) - weights + margin  # the full copy is here now
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, f=free_with_copy: (f, 0))
        assert memory.needs_checkpointing(model, 4096, torch.bfloat16, cuda, 2, True, gathered=True)[0] is on
        if not on:  # per micro-batch it would need 1/2 of the weights and no unsharded gradients
            assert not memory.needs_checkpointing(model, 4096, torch.bfloat16, cuda, 2, True)[0]


def test_several_gpu_processes_build_on_the_gpu_when_the_model_fits(monkeypatch, tiny_model_dir, tmp_path):
    """One process on a GPU builds there; several build there when the weights in the run dtype take at most half
    of the free memory (the host build of an 8B model took 11+ minutes per rank under torchrun), else on the host;
    CPU runs, and folders whose size is unknown, build on the host."""
    from safetensors.torch import load_file

    from llm_recipe.components.runtime import Runtime, _weight_bytes

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    size = _weight_bytes(tiny_model_dir, torch.bfloat16)
    assert size == 2 * sum(t.numel() for t in load_file(str(tiny_model_dir / "model.safetensors")).values())
    one = Runtime(device=cuda, dtype=torch.bfloat16)
    two = Runtime(device=cuda, dtype=torch.bfloat16, rank=1, world_size=2)  # not joined: it decides for itself
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * size, 0))
    assert one.build_device(tiny_model_dir) == cuda and two.build_device(tiny_model_dir) == cuda
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * size - 1, 0))
    assert two.build_device(tiny_model_dir) == cpu and one.build_device(tiny_model_dir) == cuda
    assert two.build_device(tmp_path) == cpu  # no safetensors here: size unknown
    assert Runtime(device=cpu, dtype=torch.float32, world_size=2).build_device(tiny_model_dir) == cpu


def test_memory_estimates_count_what_an_nf4_weight_stores():
    """An NF4 weight (QLoRA) says 2 bytes per element but stores about 0.52: counted at its nominal size, a model
    built on the GPU would look ~4 GB smaller than it frees on two GPUs (8B QLoRA), turning checkpointing off."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from llm_recipe.components.memory import stored_bytes

    w = torch.randn(256, 512, dtype=torch.bfloat16)
    q = torch.nn.Parameter(to_nf4(w), requires_grad=False)
    assert stored_bytes(torch.nn.Parameter(w)) == w.numel() * 2
    assert 0.5 * w.numel() < stored_bytes(q) < 0.55 * w.numel()


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux: /proc/meminfo")
def test_available_ram_counts_the_page_cache_the_kernel_can_drop():
    """The free RAM that decides how FSDP gathers layers on a CPU run is MemAvailable, not the free pages alone
    (which leave out the page cache: 1.2 GiB read on a machine with 18.7 GiB available)."""
    from llm_recipe.components.runtime import available_ram

    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    assert available_ram() == int(meminfo["MemAvailable"].split()[0]) * 1024
    assert available_ram() >= os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.9
