"""When FSDP2 gathers a trained model once per optimizer step instead of per micro-batch (components/fsdp.py),
gradient clipping on FSDP2's shards, and a gathered NF4 weight. The schedule itself is covered end to end by
tests/test_distributed_recipes.py (2 processes vs 1, 2 micro-batches)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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
    proc = _two_processes(tmp_path / "clip_check.py", CLIP_CHECK)
    assert "clip ok" in proc.stdout


def _two_processes(script: Path, text: str) -> subprocess.CompletedProcess:
    """`text` as a script run by torchrun on 2 CPU processes (gloo), which must exit 0."""
    script.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


GATHER_NF4_CHECK = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from llm_recipe.components import fsdp
    from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
    from llm_recipe.components.training import freeze_all_but_adapters
    dist.init_process_group("gloo")
    args = ModelArgs(family="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, o_bias=False)
    torch.manual_seed(0)  # the same model on both ranks
    model = build_model(args, lora=LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "down_proj"),
                                                quantize_base="nf4"), max_seq_len=64)
    freeze_all_but_adapters(model)
    whole = {n: p.get_original_weight().clone() for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"}
    fsdp.shard(model, model.layers, "cpu", 2, per_step=False)
    for name, p in model.named_parameters():
        if name not in whole:
            continue
        g = fsdp.gather(p)
        names, _ = g.__tensor_flatten__()
        inner = {n: type(getattr(g, n)).__name__ for n in names}
        assert type(g).__name__ == "NF4Tensor" and set(inner.values()) == {"Tensor"}, (name, inner)
        assert torch.equal(g.get_original_weight(), whole[name]), name
    if dist.get_rank() == 0:
        print("gathered", len(whole))
    dist.destroy_process_group()
""")


def test_a_gathered_nf4_weight_is_whole_with_plain_inner_tensors(tmp_path):
    """fsdp.gather of a sharded NF4 base (QLoRA on 2 processes) gives the unsharded NF4 weight with each inner tensor
    a plain tensor, its collective waited: on-policy KD's sampling twin keeps that tensor, and a compiled decode step
    reading an AsyncCollectiveTensor would wait on it at every replay; torch warns of unwaited collectives at exit
    when a rank drops one unwaited."""
    proc = _two_processes(tmp_path / "gather_nf4_check.py", GATHER_NF4_CHECK)
    assert "gathered 4" in proc.stdout
    assert "unwaited" not in proc.stderr, proc.stderr[-3000:]
