"""When FSDP2 gathers a trained model once per optimizer step instead of per micro-batch (components/fsdp.py), and
gradient clipping on FSDP2's shards. The schedule itself is covered end to end by tests/test_distributed_recipes.py
(2 processes vs 1, 2 micro-batches)."""

import os
import subprocess
import sys
import textwrap

from torch import nn

from llm_recipe.components.fsdp import GATHER_SHARE, gather_per_step


def lora_like() -> nn.Module:
    """A frozen 64x64 base and a trained 64x64 layer, fp32: 32 KiB of weights, 16 KiB of gradients."""
    m = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    m[0].requires_grad_(False)
    return m


def test_a_trained_model_gathers_once_only_while_weights_and_gradients_fit_the_share_of_free_memory():
    need = 3 * 64 * 64 * 4  # both weights, and the gradient of the trained one only
    keep, why = gather_per_step(lora_like(), free_bytes=need / GATHER_SHARE)
    assert keep and why.startswith("once:")
    keep, why = gather_per_step(lora_like(), free_bytes=need / GATHER_SHARE - 8)
    assert not keep and why.startswith("per micro-batch:")


def test_a_frozen_model_is_never_gathered_for_a_step():
    """A sharded teacher is sharded to save memory and never runs backward: it keeps per-layer gathers."""
    m = lora_like().requires_grad_(False)
    assert gather_per_step(m, free_bytes=1e15) == (False, "frozen")


CLIP_CHECK = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard
    from llm_recipe.components.training import clip_gradients
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    shapes = [(5, 3), (1, 4), (64, 16), (7,)]  # uneven shards, and one rank with an empty shard
    def model(sharded):
        m, g = nn.Module(), torch.Generator().manual_seed(1)
        m.ps = nn.ParameterList()
        for shape in shapes:
            w, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            p = nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]) if sharded else w)
            p.grad = distribute_tensor(grad, mesh, [Shard(0)]) if sharded else grad
            m.ps.append(p)
        return m
    for max_norm in (1.0, 1e6):  # clipped, and left alone
        plain, sharded = model(False), model(True)
        a, b = clip_gradients(plain, max_norm), clip_gradients(sharded, max_norm)
        torch.testing.assert_close(b, a)
        for p, q in zip(plain.parameters(), sharded.parameters()):
            torch.testing.assert_close(q.grad.full_tensor(), p.grad)
    if dist.get_rank() == 0:
        print("clip ok", float(a))
    dist.destroy_process_group()
""")


def test_clipping_fsdp_gradients_on_their_shards_equals_clipping_the_whole_tensors(tmp_path):
    """clip_gradients computes the norm of FSDP2 gradients from each rank's shards (components/training.py): the
    norm and the clipped gradients equal torch's clip_grad_norm_ on the unsharded tensors, empty shards included."""
    script = tmp_path / "clip_check.py"
    script.write_text(CLIP_CHECK)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "clip ok" in proc.stdout
