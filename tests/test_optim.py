"""Optimizer/scheduler builders and bit-exact resume of every optimizer's state through a checkpoint."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from llm_recipe.components.checkpoint.state import (
    capture_rng,
    load_recipe_state,
    restore_rng,
    save_checkpoint,
)
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.optim import build_optimizer, build_scheduler, load_optimizer_state

CPU = SimpleNamespace(device=torch.device("cpu"))
STEPS = 3  # steps before and after the checkpoint


def _model() -> nn.Module:
    # 64x64 = 4096 weights: the smallest tensor torchao stores in low bit; the bias stays a plain tensor.
    torch.manual_seed(0)
    return nn.Linear(64, 64)


def _train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randn(8, 64)  # drawn from the torch RNG: the RNG restore matters too
        loss = (model(x) - x.flip(-1)).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def _fresh(node):
    model = _model()
    opt = build_optimizer(node, model.parameters(), CPU)
    sched = build_scheduler(opt, "cosine", warmup_steps=2, total_steps=2 * STEPS, min_lr_ratio=0.1)
    return model, opt, sched


OPTIMIZERS = [
    {"_component_": "torch.optim.AdamW", "lr": 1e-2, "weight_decay": 0.1},
    {"_component_": "torchao.optim.AdamW8bit", "lr": 1e-2, "weight_decay": 0.1},
    {"_component_": "torchao.optim.AdamW4bit", "lr": 1e-2, "weight_decay": 0.1},
    {"_component_": "torchao.optim.AdamWFp8", "lr": 1e-2, "weight_decay": 0.1},
    {"_component_": "llm_recipe.components.optim.MasterWeightAdamW", "lr": 1e-2, "weight_decay": 0.1},
]


@pytest.mark.parametrize("node", OPTIMIZERS, ids=lambda n: n["_component_"].rsplit(".", 1)[1])
def test_resume_is_bit_exact(node, tmp_path):
    # Uninterrupted reference run.
    torch.manual_seed(1)
    ref, opt, sched = _fresh(node)
    _train(ref, opt, sched, 2 * STEPS)
    low_bit = node["_component_"].startswith("torchao")
    if low_bit:
        assert type(opt.state[ref.weight]["exp_avg"]).__name__.startswith("OptimState")

    # Interrupted run: train, checkpoint, then continue in fresh objects.
    torch.manual_seed(1)
    model, opt, sched = _fresh(node)
    _train(model, opt, sched, STEPS)
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": capture_rng()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = save_checkpoint(tmp_path, STEPS, lambda d: None, state)
    torch.randn(100)  # the crash happens later: the RNG moved on

    loaded = load_recipe_state(ckpt)
    model, opt, sched = _fresh(node)
    model.load_state_dict(weights)
    opt.load_state_dict(loaded["optimizer"])
    sched.load_state_dict(loaded["scheduler"])
    restore_rng(loaded)
    if low_bit:
        assert type(opt.state[model.weight]["exp_avg"]).__name__.startswith("OptimState")
    _train(model, opt, sched, STEPS)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), f"{node['_component_']}: {name} differs after resume"
    assert sched.get_last_lr() == pytest.approx([float(g["lr"]) for g in opt.param_groups])

    # Control: continuing without the optimizer state gives different weights (the check above can fail).
    model, opt, sched = _fresh(node)
    model.load_state_dict(weights)
    sched.load_state_dict(loaded["scheduler"])
    restore_rng(loaded)
    _train(model, opt, sched, STEPS)
    assert not torch.equal(ref.weight, model.weight)


def test_scheduler_values():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    expected = {
        "cosine": [1.0, 2.0] + [0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * i / 4)) for i in range(5)] + [0.2],
        "linear": [1.0, 2.0] + [0.2 + 1.8 * (1 - i / 4) for i in range(5)] + [0.2],
        "constant": [1.0] + [2.0] * 7,
    }
    for name, lrs in expected.items():
        opt.param_groups[0].pop("initial_lr", None)
        opt.param_groups[0]["lr"] = 2.0
        sched = build_scheduler(opt, name, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
        got = []
        for _ in range(8):
            got.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert got == pytest.approx(lrs), name


def test_scheduler_errors_name_the_key():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(RecipeError, match="lr_scheduler.name='cosin'"):
        build_scheduler(opt, "cosin", 0, 10)
    with pytest.raises(RecipeError, match="min_lr_ratio=2"):
        build_scheduler(opt, "linear", 0, 10, min_lr_ratio=2)


def test_build_optimizer_defaults_and_errors():
    model = nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    opt = build_optimizer(
        {"_component_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.95]}, model.parameters(), CPU
    )
    assert opt.param_groups[0]["params"] == [model.weight]  # frozen params dropped
    assert opt.defaults["betas"] == (0.9, 0.95) and not opt.defaults["fused"]
    # On CUDA, AdamW defaults to the fused kernel (fused AdamW also exists on CPU, so this builds here).
    opt = build_optimizer(
        {"_component_": "torch.optim.AdamW"}, model.parameters(), SimpleNamespace(device=torch.device("cuda"))
    )
    assert opt.defaults["fused"] is True
    with pytest.raises(RecipeError, match="CPUOffloadOptimizer needs a CUDA device"):
        build_optimizer(
            {
                "_component_": "torchao.optim.CPUOffloadOptimizer",
                "optimizer_class": "torchao.optim.AdamW8bit",
            },
            model.parameters(),
            CPU,
        )
    with pytest.raises(RecipeError, match=r"optimizer._component_='os.system' is not an optimizer"):
        build_optimizer({"_component_": "os.system"}, model.parameters(), CPU)
    with pytest.raises(RecipeError, match=r"'torch.optim.AdamWW' does not exist"):
        build_optimizer({"_component_": "torch.optim.AdamWW"}, model.parameters(), CPU)
    with pytest.raises(RecipeError, match="bad arguments for torch.optim.AdamW"):
        build_optimizer({"_component_": "torch.optim.AdamW", "lrr": 1.0}, model.parameters(), CPU)
    with pytest.raises(RecipeError, match="no trainable parameters"):
        build_optimizer({"_component_": "torch.optim.AdamW"}, [model.bias], CPU)


def test_low_bit_adamw_under_fsdp_falls_back_loudly(caplog):
    """torchao's low-bit AdamWs fail on FSDP2 shards (see llm_recipe.components.optim._low_bit_fallback): several
    processes get torchao's full-precision _AdamW with the same hyperparameters and a warning naming why."""
    from torchao.optim import _AdamW

    model = torch.nn.Linear(64, 64)
    with caplog.at_level("WARNING"):
        opt = build_optimizer({"_component_": "torchao.optim.AdamW4bit", "lr": 3e-4, "weight_decay": 0.1,
                               "block_size": 128, "bf16_stochastic_round": True}, model.parameters(),
                              SimpleNamespace(device=CPU.device, world_size=2, is_main=True))
    assert type(opt) is _AdamW
    g = opt.param_groups[0]
    assert (g["lr"], g["weight_decay"]) == (3e-4, 0.1) and opt.bf16_stochastic_round
    assert "AdamW4bit does not run under FSDP2" in caplog.text and "pytorch/ao PR #4216" in caplog.text
    assert "dropped: block_size" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("node,dtype", [
    # the shipped GPU optimizer (bf16 weights, fp32 masters, the fused kernel): its step counters came back on the
    # host from a one-GPU (safetensors) checkpoint and the first resumed step failed ("state_steps is on cpu")
    ({"_component_": "llm_recipe.components.optim.MasterWeightAdamW", "lr": 1e-2, "weight_decay": 0.1},
     torch.bfloat16),
    ({"_component_": "torchao.optim.CPUOffloadOptimizer", "optimizer_class": "torch.optim.AdamW", "lr": 1e-2},
     torch.float32),
], ids=["MasterWeightAdamW", "CPUOffloadOptimizer"])
def test_resume_on_cuda_is_bit_exact(node, dtype, tmp_path: Path):
    gpu = SimpleNamespace(device=torch.device("cuda"))

    def fresh():
        torch.manual_seed(0)
        model = nn.Linear(64, 64).cuda().to(dtype)
        opt = build_optimizer(node, model.parameters(), gpu)
        return model, opt, build_scheduler(opt, "cosine", 2, 6, min_lr_ratio=0.1)

    def train(model, opt, sched, steps):
        for _ in range(steps):
            x = torch.randn(8, 64, device="cuda", dtype=dtype)
            (model(x) - x.flip(-1)).float().pow(2).mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()

    torch.manual_seed(1)
    ref, opt, sched = fresh()
    train(ref, opt, sched, 6)
    torch.manual_seed(1)
    model, opt, sched = fresh()
    train(model, opt, sched, 3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = save_checkpoint(tmp_path, 3, lambda d: None,
                           {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": capture_rng()})
    loaded = load_recipe_state(ckpt)
    model, opt, sched = fresh()
    model.load_state_dict(weights)  # after CPUOffloadOptimizer snapshotted the initial weights to the host
    load_optimizer_state(opt, loaded["optimizer"])  # loads state (CPUOffloadOptimizer: re-syncs the host weights)
    sched.load_state_dict(loaded["scheduler"])
    restore_rng(loaded)
    train(model, opt, sched, 3)
    assert torch.equal(ref.weight, model.weight) and torch.equal(ref.bias, model.bias)


def test_bf16_rounded_away_fraction_follows_bf16_resolution():
    from llm_recipe.components.optim import bf16_rounded_away_fraction

    ones = torch.ones(1000, dtype=torch.bfloat16)  # ulp(1.0) = 2**-7: lr 2e-5 cannot move it, 1e-2 can
    small = torch.full((1000,), 1e-3, dtype=torch.bfloat16)  # ulp ~ 7.6e-6: lr 2e-5 moves it
    assert bf16_rounded_away_fraction([ones], 2e-5) == 1.0
    assert bf16_rounded_away_fraction([ones], 1e-2) == 0.0
    assert bf16_rounded_away_fraction([small], 2e-5) == 0.0
    assert bf16_rounded_away_fraction([ones, small], 2e-5) == 0.5
    assert bf16_rounded_away_fraction([ones.float()], 2e-5) == 0.0  # fp32 weights are not affected


def test_warns_when_bf16_updates_round_away_unless_stochastic_rounding(caplog):
    import torchao.optim  # noqa: F401  (imported first: its import-time warnings are not the ones checked below)

    from llm_recipe.components.optim import warn_if_bf16_updates_round_away

    model = nn.Linear(64, 64).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(0.5)  # ulp/2 = 2**-10 ~ 1e-3: an lr of 2e-5 is lost, 1e-2 is kept
    with caplog.at_level("WARNING", logger="llm_recipe.components.optim"):
        opt = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 2e-5}, model.parameters(), CPU)
        assert warn_if_bf16_updates_round_away(opt) > 0.9
    assert "lr=2.0e-05 rounds away" in caplog.text and "bf16_stochastic_round=true" in caplog.text
    # the fix it names first is the one the GPU configs ship (it named torchao's slower _AdamW)
    assert "use optimizer._component_=llm_recipe.components.optim.MasterWeightAdamW" in caplog.text
    # The warning is true: one real step leaves the weights exactly where they were.
    before = model.weight.detach().clone()
    model(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    assert torch.equal(model.weight, before)

    caplog.clear()
    with caplog.at_level("WARNING", logger="llm_recipe.components.optim"):
        sr = build_optimizer({"_component_": "torchao.optim._AdamW", "lr": 2e-5, "bf16_stochastic_round": True},
                             model.parameters(), CPU)
        assert warn_if_bf16_updates_round_away(sr) == 0.0
        torch.manual_seed(0)
        model(torch.randn(4, 64, dtype=torch.bfloat16)).sum().backward()
        sr.step()  # stochastic rounding: some weights move by a whole ulp, unbiased in expectation
        assert not torch.equal(model.weight, before)
        big = build_optimizer({"_component_": "torch.optim.AdamW", "lr": 1e-2}, model.parameters(), CPU)
        assert warn_if_bf16_updates_round_away(big) == 0.0
    assert caplog.text == ""


def _bf16_steps(model, opt, grads):
    for g in grads:
        for p, gp in zip(model.parameters(), g):
            p.grad = gp.to(p.dtype)
        opt.step()
        opt.zero_grad()


def test_master_weight_adamw_keeps_small_updates_of_bf16_weights(tmp_path):
    """bf16 weights under MasterWeightAdamW follow an fp32 AdamW exactly (its master is that run's weight), where
    plain bf16 AdamW would not move them at this lr; its fp32 state survives a checkpoint, so resume is exact."""
    torch.manual_seed(0)
    # bf16-representable gradients, so the bf16 model and the fp32 reference see the same numbers
    grads = [[torch.randn(64, 64).bfloat16().float(), torch.randn(64).bfloat16().float()] for _ in range(6)]
    node = {"_component_": "llm_recipe.components.optim.MasterWeightAdamW", "lr": 2e-5, "weight_decay": 0.1}

    def fresh():
        torch.manual_seed(0)
        return nn.Linear(64, 64).to(torch.bfloat16)

    ref32 = fresh().float()  # the fp32 run the master must reproduce (same kernels: foreach on CPU)
    ref_opt = torch.optim.AdamW(ref32.parameters(), lr=2e-5, weight_decay=0.1, foreach=True)
    _bf16_steps(ref32, ref_opt, grads)
    model = fresh()
    start = model.weight.detach().clone()
    opt = build_optimizer(node, model.parameters(), CPU)
    _bf16_steps(model, opt, grads)
    master = opt.state[model.weight]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, ref32.weight), (master - ref32.weight).abs().max()
    assert torch.equal(model.weight, master.to(torch.bfloat16))
    # Every master moved by 6 x ~2e-5; a bf16 AdamW step of 2e-5 is below half an ulp here and would move none.
    assert bool((master != start.float()).all()) and bool((model.weight != start).any())

    # Interrupted after 3 steps: the checkpointed state keeps fp32 masters and moments.
    model = fresh()
    opt = build_optimizer(node, model.parameters(), CPU)
    _bf16_steps(model, opt, grads[:3])
    ckpt = save_checkpoint(tmp_path, 3, lambda d: None, {"optimizer": opt.state_dict()})
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model = fresh()
    model.load_state_dict(weights)
    opt = build_optimizer(node, model.parameters(), CPU)
    opt.load_state_dict(load_recipe_state(ckpt)["optimizer"])
    assert {v.dtype for k, v in opt.state[model.weight].items() if k != "step"} == {torch.float32}
    _bf16_steps(model, opt, grads[3:])
    assert torch.equal(opt.state[model.weight]["master"], ref32.weight)
    assert torch.equal(model.weight, ref32.weight.to(torch.bfloat16))


@pytest.mark.slow  # ~45 s on 2 cores (Inductor compiles torchao's step in C++) for a silenced warning: `make test-all`
def test_a_low_bit_step_prints_no_torch_caching_advice(tmp_path):
    """torch's AOT autograd cache warns that torchao's state subclasses lack `_stable_hash_for_caching`; in a
    run that line lands in the progress bar, and a user can do nothing about it (a fresh process: it warns once)."""
    code = (
        "import torch\n"
        "from types import SimpleNamespace\n"
        "from llm_recipe.components.optim import build_optimizer\n"
        "m = torch.nn.Linear(64, 64)\n"
        "opt = build_optimizer({'_component_': 'torchao.optim.AdamW8bit', 'lr': 1e-2}, m.parameters(),\n"
        "                      SimpleNamespace(device=torch.device('cpu')))\n"
        "m(torch.randn(8, 64)).square().mean().backward()\n"
        "opt.step()\n"
        "print('stepped', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert proc.returncode == 0 and "stepped" in proc.stdout, proc.stderr[-3000:]
    assert "_stable_hash_for_caching" not in proc.stderr, proc.stderr[-3000:]
