"""The sampling twin (components/sampling_twin.py) on one process: a copy of the student's structure made before
preparation, filled with its weights, computes the student's logits; `refresh` brings the trained weights' updates
into the same tensors (a recorded CUDA graph reads them there) and leaves frozen ones alone; tied weights stay
tied; an NF4 base (QLoRA) comes through as NF4; a LoRA student's twin holds its adapters merged, the same weights,
bit for bit, as one process's merged copy. Two processes (the sharded case) are in test_on_policy_recipe.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llm_recipe.components.memory import weight_bytes
from llm_recipe.components.merged_sampler import MergedSampler
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.sampling_twin import SamplingTwin, twin_structure
from llm_recipe.components.training import freeze_all_but_adapters

TOKENS = torch.tensor([[1, 40, 100, 31, 7, 90, 12, 5]])
# 256 wide: NF4 quantizes in blocks of 64 elements and its scalers in blocks of 256
ARGS = ModelArgs(family="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                 tie_word_embeddings=True, qkv_bias=False, o_bias=False)


def _student(quantize_base):
    torch.manual_seed(0)
    lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"), quantize_base=quantize_base)
    model = build_model(ARGS, lora=lora, max_seq_len=64)
    with torch.no_grad():  # adapters that change the logits (lora_b starts at zero)
        for name, p in model.named_parameters():
            if "lora_b" in name:
                p.normal_(0, 0.02)
    freeze_all_but_adapters(model)
    return model


@pytest.mark.parametrize("quantize_base", [False, "nf4"])
def test_twin_computes_the_students_logits_and_refresh_updates_in_place(quantize_base):
    student = _student(quantize_base)
    structure, nbytes, gathered = twin_structure(student)
    assert all(p.is_meta for p in structure.parameters()) and nbytes == weight_bytes(student)
    assert gathered == nbytes + 4 * sum(p.numel() for p in student.parameters() if p.requires_grad)  # + fp32 grads
    rt = setup_runtime("cpu", "fp32", 0)
    rt.prepare_model(student, activation_checkpointing=True)  # what the copy must not carry
    twin = SamplingTwin(structure, student, merge=False)  # the adapters kept: the student's numbers exactly
    assert not twin.merged
    assert twin.model.output.tied_module is twin.model.tok_embeddings  # a tied head: the twin's own table
    assert not any(p.requires_grad for p in twin.model.parameters())
    student.eval()
    with torch.no_grad():
        torch.testing.assert_close(twin.model(TOKENS), student(TOKENS), rtol=0, atol=0)
    if quantize_base:
        assert type(twin.model.layers[0].attn.q_proj.weight).__name__ == "NF4Tensor"

    trained = {n: p for n, p in student.named_parameters() if p.requires_grad}
    frozen = dict(twin.model.named_parameters())["layers.0.attn.k_proj.weight"]
    where = {n: p.data_ptr() for n, p in twin.model.named_parameters()}
    with torch.no_grad():  # an optimizer step's in-place update of the adapters
        for p in trained.values():
            p.add_(torch.randn_like(p) * 0.1)
        assert not torch.equal(twin.model(TOKENS), student(TOKENS))  # the twin keeps the weights it was given
        assert twin.refresh(student) is twin.model
        torch.testing.assert_close(twin.model(TOKENS), student(TOKENS), rtol=0, atol=0)
    assert {n: p.data_ptr() for n, p in twin.model.named_parameters()} == where  # the same tensors
    assert dict(twin.model.named_parameters())["layers.0.attn.k_proj.weight"] is frozen


def test_a_lora_twin_samples_through_its_adapters_merged_as_one_process_does():
    """The default twin of a LoRA student holds W + (alpha / r) B A in plain linears (no adapter runs in the decode
    step): in fp32 the student's logits to rounding, before and after an update (merged again in place); in bf16
    the weights one process's merged copy holds for the same seed, bit for bit (so N processes sample what one
    does), and other noise for another seed. An NF4 base (QLoRA) keeps its adapters."""
    student = _student(False)
    plan = twin_structure(student)
    rt = setup_runtime("cpu", "fp32", 0)
    rt.prepare_model(student, activation_checkpointing=True)
    twin = SamplingTwin(plan.structure, student)
    assert twin.merged and type(twin.model.layers[0].attn.q_proj) is torch.nn.Linear
    assert not any("lora" in n for n, _ in twin.model.named_parameters())
    assert type(twin.model.layers[0].attn.k_proj) is torch.nn.Linear  # not adapted: as it was
    student.eval()
    where = {n: p.data_ptr() for n, p in twin.model.named_parameters()}
    for _ in range(2):
        with torch.no_grad():
            twin.refresh(student)
            torch.testing.assert_close(twin.model(TOKENS), student(TOKENS), rtol=1e-5, atol=1e-5)
            for p in student.parameters():  # an optimizer step's in-place update of the adapters
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.1)
    assert {n: p.data_ptr() for n, p in twin.model.named_parameters()} == where

    bf16 = _student(False).to(torch.bfloat16)
    plan = twin_structure(bf16)
    twin, one = SamplingTwin(plan.structure, bf16), MergedSampler(bf16)
    twin.refresh(bf16, 7)
    copy = one.refresh(bf16, 7)
    merged = {n: w for n, w in twin.model.named_parameters() if n.endswith(("q_proj.weight", "v_proj.weight",
                                                                             "w2.weight"))}
    assert len(merged) == 6 and all(w.dtype == torch.bfloat16 for w in merged.values())
    for n, w in merged.items():
        assert torch.equal(w, copy.get_parameter(n)), n
    twin.refresh(bf16, 8)
    assert any(not torch.equal(w, copy.get_parameter(n)) for n, w in merged.items())

    qlora = _student("nf4")
    assert not SamplingTwin(twin_structure(qlora).structure, qlora).merged


def test_a_twin_that_does_not_fit_falls_back_to_eager_or_is_a_one_line_error(monkeypatch):
    """On GPUs the twin is made only where every rank's free memory holds it beside training (`twin_fits`);
    otherwise auto samples eagerly through the sharded student and says why, and `decode: compiled` stops in one
    line. One rank short of room is enough: the twin's gathers are collectives, which it would fail in."""
    from types import SimpleNamespace

    from llm_recipe.components import sampling_twin
    from llm_recipe.components.errors import RecipeError

    student = _student(False)
    plan = twin_structure(student)
    nbytes = plan.weight_bytes
    seen = []
    monkeypatch.setattr(sampling_twin, "twin_fits", lambda *a: (seen.append(a), (False, "9.0 GiB > 1.0 GiB"))[1])
    rt = SimpleNamespace(device=torch.device("cuda"), world_size=2, all_reduce_sum=lambda x: x)
    twin, why = sampling_twin.make_twin(plan, student, 4096, 2048, rt, required=False)
    assert twin is None and why == ("eager decode steps through the sharded student: an unsharded copy per GPU "
                                    "would not fit (9.0 GiB > 1.0 GiB)")
    assert seen[0][:2] == (nbytes, 4096 * 2 * 2 * 2 * 64 * 4)  # the twin's bytes; 4096 positions of K and V
    with pytest.raises(RecipeError, match=r"^kd.on_policy.decode=compiled on several GPUs .* does not fit: 9.0 GiB"):
        sampling_twin.make_twin(plan, student, 4096, 2048, rt, required=True)
    # this rank has the room, the other does not (the sum over ranks counts it): no twin on any rank
    monkeypatch.setattr(sampling_twin, "twin_fits", lambda *a: (True, "1.0 GiB <= 9.0 GiB usable free"))
    rt.all_reduce_sum = lambda x: x + 1.0
    twin, why = sampling_twin.make_twin(plan, student, 4096, 2048, rt, required=False)
    assert twin is None and why.endswith("would not fit (1.0 GiB <= 9.0 GiB usable free here; it would not fit on "
                                         "1 of 2 GPUs)"), why


SHARDED_MERGE_CHECK = textwrap.dedent("""
    import torch, torch.distributed as dist
    from llm_recipe.components import fsdp
    from llm_recipe.components.merged_sampler import MergedSampler, mergeable
    from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
    from llm_recipe.components.sampling_twin import SamplingTwin, twin_structure
    from llm_recipe.components.training import freeze_all_but_adapters
    dist.init_process_group("gloo")
    args = ModelArgs(family="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=True, o_bias=False)
    def student():  # the same bf16 model on both ranks: adapters that count (B nonzero), biases, an adapted head
        torch.manual_seed(0)
        lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj", "lm_head"))
        m = build_model(args, lora=lora, max_seq_len=64).to(torch.bfloat16)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_b" in n:
                    p.normal_(0, 0.02)
                if n.endswith("bias"):
                    p.normal_(0, 0.5)
        freeze_all_but_adapters(m)
        return m
    whole = student()
    one = MergedSampler(whole)  # one process's merged copy
    sharded = student()
    plan = twin_structure(sharded)
    fsdp.shard(sharded, sharded.layers, "cpu", 2, per_step=False)
    assert len(mergeable(sharded)) == 7, mergeable(sharded)  # FSDP2's shards of plain weights merge
    twin = SamplingTwin(plan.structure, sharded)
    assert twin.merged
    tokens = torch.tensor([[1, 40, 100, 31, 7, 90, 12, 5]])
    for seed in (3, 4):
        twin.refresh(sharded, seed)
        copy = one.refresh(whole, seed)
        differ = [n for n, w in twin.model.named_parameters() if not torch.equal(w, copy.get_parameter(n))]
        assert not differ, (seed, differ)
        with torch.no_grad():
            assert torch.equal(twin.model(tokens), copy(tokens))
    if dist.get_rank() == 0:
        print("sharded merge ok")
    dist.destroy_process_group()
""")


def test_a_sharded_lora_twin_merges_bit_for_bit_as_one_process_merged_copy(tmp_path):
    """2 CPU processes (gloo) with the student sharded by FSDP2: each rank's twin gathers W, A and B and merges them
    into the same bf16 weights, bit for bit, as one process's merged copy of the unsharded student for the same
    seed (biases and an adapted output head included), so N processes sample what one does."""
    script = tmp_path / "sharded_merge.py"
    script.write_text(SHARDED_MERGE_CHECK)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded merge ok" in proc.stdout
