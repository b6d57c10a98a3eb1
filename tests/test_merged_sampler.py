"""On-policy KD's merged sampling copy of a LoRA student (components/merged_sampler.py): the copy computes the
student's logits, shares every tensor but the merged weights, follows the student's updates in place, samples what
the student samples, and rounds a bf16 merge without bias; which adapters it takes and where it is made."""

from __future__ import annotations

import pytest
import torch

from llm_recipe.components.merged_sampler import (
    MergedSampler,
    make_merged,
    mergeable,
    merged_bytes,
    round_to_bf16_stochastically,
)
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.on_policy_sampling import sample_completions

ARGS = ModelArgs(family="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                 tie_word_embeddings=False, qkv_bias=False, o_bias=False)
LORA = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
PROMPTS = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 2, 6]]


def _student(seed: int = 0, lora: LoRASettings = LORA, dtype: torch.dtype = torch.float64,
             args: ModelArgs = ARGS) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(args, lora=lora).to(dtype)
    with torch.no_grad():
        model.output.weight.mul_(4.0)  # peaked next-token distributions
        for name, p in model.named_parameters():
            if "lora_b" in name:  # B starts at zero: make the adapters count
                p.normal_(0, 0.3)
    return model.eval()


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def test_the_copy_computes_the_students_logits_and_shares_its_other_tensors():
    student = _student()
    merged = MergedSampler(student)
    copy = merged.refresh(student)
    tokens = torch.tensor([[1, 5, 9, 4, 7, 2]])
    torch.testing.assert_close(_logits(copy, tokens), _logits(student, tokens), rtol=1e-10, atol=1e-10)
    # the adapters are gone from the copy: 2 layers x 6 projections became plain linears with weights of their own
    assert not any("lora" in name for name, _ in copy.named_parameters())
    assert len(mergeable(student)) == 12 and merged_bytes(mergeable(student)) == sum(
        w.numel() * w.element_size() for _, w in merged._pairs) == sum(
        m.weight.numel() * 8 for m in mergeable(student).values())  # what make_merged weighs is what it allocates
    own = {p.data_ptr() for p in student.parameters()}
    names = dict(copy.named_parameters())
    merged_names = {f"{n}.weight" for n in mergeable(student)}
    assert merged_names < set(names)  # the merged weights and the shared rest (embeddings, norms, k_proj, head)
    for name, p in names.items():
        assert (p.data_ptr() in own) == (name not in merged_names), name  # merged weights alone are new memory
    # the student is untouched: still LoRA modules, no compiled entries or caches borrowed from the copy
    assert len(mergeable(student)) == 12
    assert type(student.layers[0].attn.q_proj).__name__ == "LoRALinear"


def test_biases_and_row_blocks_merge_alike(monkeypatch):
    """A student with q/k/v biases (Qwen2's layout): the copy keeps them (shared); and a merge in row blocks (as a
    large head is merged) gives the same weights as one block."""
    from dataclasses import replace

    import llm_recipe.components.merged_sampler as ms

    student = _student(args=replace(ARGS, qkv_bias=True))
    with torch.no_grad():
        for name, p in student.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    tokens = torch.tensor([[1, 5, 9, 4, 7, 2]])
    whole = MergedSampler(student)
    copy = whole.refresh(student)
    torch.testing.assert_close(_logits(copy, tokens), _logits(student, tokens), rtol=1e-10, atol=1e-10)
    monkeypatch.setattr(ms, "BLOCK_ELEMENTS", 40)  # blocks of one row of 32 (and 64) inputs
    blocks = MergedSampler(student)
    blocks.refresh(student)
    for (_, a), (_, b) in zip(whole._pairs, blocks._pairs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_copy_decodes_with_its_own_layers_under_activation_checkpointing():
    """Runtime's activation checkpointing wraps each layer's forward on the instance (a closure over the student's
    layer): the copy still runs its own merged linears and KV caches. Sampled through StaticDecode (the on-policy
    path, Dynamo's guards without Inductor) across a training step and a refresh: the student's samples, and the
    student's attention never holds the copy's caches."""
    from llm_recipe.components.models.generation import StaticDecode
    from llm_recipe.components.runtime import _checkpoint_forward

    student, twin = _student(5), _student(5)
    for layer in student.layers:
        _checkpoint_forward(layer)
    merged = MergedSampler(student)
    static = StaticDecode(4, mode="default", backend="eager")
    seen = []
    attn = student.layers[0].attn
    original = static.caches

    def caches(model, total, rows=None):  # look at the student while the copy holds its caches
        cm = original(model, total, rows)
        seen.append(attn.kv_cache)
        return cm

    static.caches = caches
    kw = dict(max_new_tokens=10, temperature=1.0, pad_id=0, stop_ids=[], seed=11, rows=range(3), width=3)
    opts = [torch.optim.SGD([p for n, p in m.named_parameters() if "lora" in n], lr=0.5) for m in (student, twin)]
    for step in range(2):
        copy = merged.refresh(student, step)
        assert sample_completions(copy, PROMPTS, static=static, **kw) == sample_completions(twin, PROMPTS, **kw)
        for m, opt in zip((student, twin), opts, strict=True):
            m.train()
            m(torch.tensor([[1, 2, 3, 4, 5]])).logsumexp(-1).sum().backward()
            opt.step()
            m.eval()
    assert seen and all(c is None for c in seen)
    with torch.no_grad():  # the copy's merged weights zeroed: what it samples changes (it runs its own linears)
        for _, w in merged._pairs:
            w.zero_()
    assert sample_completions(merged.model, PROMPTS, static=static, **kw) != sample_completions(twin, PROMPTS, **kw)


def test_refresh_follows_the_students_updates_in_place():
    student = _student()
    merged = MergedSampler(student)
    copy = merged.refresh(student)
    weight = copy.layers[1].mlp.w2.weight
    before, address = weight.clone(), weight.data_ptr()
    opt = torch.optim.SGD([p for n, p in student.named_parameters() if "lora" in n], lr=0.5)
    student.train()
    student(torch.tensor([[1, 2, 3, 4, 5]])).logsumexp(-1).sum().backward()
    opt.step()
    student.eval()
    merged.refresh(student)
    assert weight.data_ptr() == address and not torch.equal(weight, before)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    torch.testing.assert_close(_logits(copy, tokens), _logits(student, tokens), rtol=1e-10, atol=1e-10)
    student.layers[1].mlp.w2.disabled = True  # torchtune's switch: that adapter off, the base alone
    merged.refresh(student)
    torch.testing.assert_close(_logits(copy, tokens), _logits(student, tokens), rtol=1e-10, atol=1e-10)


def test_the_copy_samples_what_the_student_samples():
    student = _student(3)
    copy = MergedSampler(student).refresh(student)
    kw = dict(max_new_tokens=12, temperature=1.0, pad_id=0, stop_ids=[], seed=7, rows=range(3), width=3)
    got = sample_completions(copy, PROMPTS, **kw)
    assert got == sample_completions(student, PROMPTS, **kw)
    assert got != sample_completions(_student(4), PROMPTS, **kw)  # (another model samples otherwise)
    assert all(m.kv_cache is None for m in (student.layers[0].attn, copy.layers[0].attn))  # caches went


def test_bf16_rounding_is_unbiased_and_seeded():
    """Values between two bf16 neighbours round to one of them, with a mean over seeds at the value: an update
    below half a bf16 step survives on average (round-to-nearest would drop it every time); one seed, one result."""
    base = torch.full((4096,), 0.02, dtype=torch.bfloat16).float()
    step = torch.finfo(torch.bfloat16).eps * 2.0**-6  # bf16's step just above 0.02 (in [2^-6, 2^-5))
    x = base + 0.3 * step
    rounded = torch.stack([round_to_bf16_stochastically(x.clone(), torch.Generator().manual_seed(s)).float()
                           for s in range(8)])
    assert set(rounded.unique().tolist()) <= {base[0].item(), (base + step)[0].item()}
    assert abs(rounded.mean().item() - x[0].item()) < 0.02 * step
    assert x.to(torch.bfloat16).float().eq(base).all()  # round-to-nearest: the update is gone
    again = round_to_bf16_stochastically(x.clone(), torch.Generator().manual_seed(0)).float()
    assert torch.equal(again, rounded[0])
    negative = round_to_bf16_stochastically(-x.clone(), torch.Generator().manual_seed(1)).float()
    assert abs(negative.mean().item() + x[0].item()) < 0.05 * step


def test_a_bf16_copy_keeps_small_updates_on_average():
    student = _student(dtype=torch.bfloat16)
    with torch.no_grad():  # B so small that W + s B A rounds back to W at round-to-nearest
        for name, p in student.named_parameters():
            if "lora_b" in name:
                p.mul_(1e-4)
    merged = MergedSampler(student)
    lora = student.layers[0].mlp.w3
    exact = lora.weight.float() + (lora.alpha / lora.rank) * lora.lora_b.weight.float() @ lora.lora_a.weight.float()
    mean = torch.stack([merged.refresh(student, seed).layers[0].mlp.w3.weight.float().clone()
                        for seed in range(64)]).mean(0)
    delta, nearest = exact - lora.weight.float(), exact.to(torch.bfloat16).float() - lora.weight.float()
    assert nearest.abs().sum() < 0.2 * delta.abs().sum()  # round-to-nearest keeps almost none of it
    got = mean - lora.weight.float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), delta.flatten(), dim=0) > 0.5


def test_which_adapters_merge_and_where_a_copy_is_made():
    assert mergeable(_student(lora=LoRASettings(rank=4, alpha=8.0, targets=("q_proj",), use_dora=True))) == {}
    assert mergeable(build_model(ARGS)) == {}
    fp8 = LoRASettings(rank=4, alpha=8.0, targets=("q_proj",), quantize_base="fp8")  # its forward quantizes x too
    assert mergeable(build_model(ARGS, lora=fp8)) == {}
    from llm_recipe.components.quantization.qat import prepare_qat

    qat = _student(dtype=torch.float32)
    prepare_qat(qat, "8da4w", group_size=32)  # KD-QAT with LoRA: the merged weight is fake-quantized in training
    assert mergeable(qat) == {}
    with pytest.raises(ValueError, match="no LoRA linears"):
        MergedSampler(build_model(ARGS))
    assert make_merged(_student(), 1024, 256, torch.device("cpu")) == (None, None)  # the CUDA-graph path only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: free memory and a bf16 GPU copy")
def test_on_a_gpu_the_copy_is_made_where_it_fits_and_matches_the_student():
    student = _student(dtype=torch.bfloat16).cuda()
    merged, why = make_merged(student, 4096, 1024, torch.device("cuda"))
    assert merged is not None and why.startswith("the LoRA adapters merged into a copy")
    tokens = torch.tensor([[1, 5, 9, 4, 7, 2]], device="cuda")
    copy = merged.refresh(student, 0)
    diff = (_logits(copy, tokens).float() - _logits(student, tokens).float()).abs().max()
    assert diff < 0.05 * _logits(student, tokens).float().abs().max()
