"""One recipe file serves one process or many: a 2-process FSDP2 run (gloo, CPU) through `recipe run
--nproc-per-node 2` trains the same weights as one process with the same global batch."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file


def _run(tmp_path, tiny_model_dir, name, torchrun, batch_size):
    out = tmp_path / name
    cmd = [sys.executable, "-m", "llm_recipe.cli.main", "run", *torchrun, "full", "--config", "full/smollm2",
           f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={out}", "device=cpu", "dtype=fp32", "max_steps=2",
           f"batch_size={batch_size}", "gradient_accumulation_steps=1", "dataset.limit=32", "dataset.max_seq_len=64",
           "dataset.shuffle=false", "max_grad_norm=null", "save_every_n_steps=null",
           "optimizer={_component_: torch.optim.SGD, lr: 0.5}", "lr_scheduler.warmup_steps=0",
           "lr_scheduler.name=constant"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(out / "model" / "model.safetensors")


def test_two_process_fsdp_matches_one_process(tmp_path, tiny_model_dir):
    one = _run(tmp_path, tiny_model_dir, "one", [], batch_size=4)
    two = _run(tmp_path, tiny_model_dir, "two", ["--nproc-per-node", "2", "--standalone"], batch_size=2)
    base = load_file(tiny_model_dir / "model.safetensors")
    assert one.keys() == two.keys()
    moved = 0
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
        moved += int(not torch.equal(one[k], base[k]))
    assert moved > len(one) // 2  # training really changed the weights
