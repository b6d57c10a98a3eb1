"""The fused linear CE+KD loss equals the checkpointed chunked path: values and gradients (fp64, CPU), for every
divergence, temperature, vocab slicing, ignored tokens, frozen and tied heads; and it falls back for heads it
cannot fuse."""

import pytest
import torch
from torch import nn

from llm_recipe.components.losses import (
    build_kd_loss,
    chunked_cross_entropy,
    chunked_kd_and_ce,
    fusable_head_weight,
    fused_linear_kd_and_ce,
    kd_and_ce,
)
from llm_recipe.components.models.builder import LoRASettings, _linear

KINDS = [("forward_kl", {}), ("reverse_kl", {}), ("symmetric_kl", {"ratio": 0.3}), ("jsd", {"beta": 0.3}),
         ("skew_kl", {"alpha": 0.2}), ("skew_reverse_kl", {"alpha": 0.2})]


def _inputs(seed: int, vocab: int | None, b=2, s=7, d=16, dt=24, v=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    th = torch.randn(b, s, dt, dtype=torch.float64, generator=g)
    tw = torch.randn(v, dt, dtype=torch.float64, generator=g)
    y = torch.randint(0, vocab or v, (b, s), generator=g)
    y[0, :3] = -100  # ignored tokens (prompt / padding)
    return h, w, th, tw, y


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("temperature,vocab,kd_ratio,chunks", [(1.0, None, 0.5, 4), (2.0, 40, 0.7, 3),
                                                               (0.5, None, 1.0, 1)])
def test_fused_matches_chunked_values_and_gradients(kind, extra, temperature, vocab, kd_ratio, chunks):
    h, w, th, tw, y = _inputs(hash((kind, temperature)) % 1000, vocab)
    kd = build_kd_loss(kind, temperature, **extra)
    ref = chunked_kd_and_ce(h, lambda x: x @ w.t(), th, lambda x: x @ tw.t(), y, kd, num_chunks=2,
                            vocab_size=vocab)
    ref_loss = (1 - kd_ratio) * ref["ce"] + kd_ratio * ref["kd"]
    ref_gh, ref_gw = torch.autograd.grad(ref_loss * 3.0, (h, w))  # a scale, as the train loop's 1/n applies

    out = fused_linear_kd_and_ce(h, w, y, th, lambda x: x @ tw.t(), kd, kd_ratio, num_chunks=chunks,
                                 vocab_size=vocab)
    gh, gw = torch.autograd.grad(out["loss"] * 3.0, (h, w))
    torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["ce"], ref["ce"], rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["kd"], ref["kd"], rtol=1e-12, atol=1e-10)
    assert int(out["n"]) == int(ref["n"]) == int((y != -100).sum())
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)
    if vocab is not None:  # padding rows of the head never get a gradient
        assert torch.all(gw[vocab:] == 0)


def test_fused_ce_only_matches_chunked_cross_entropy_and_frozen_head_gets_no_grad():
    h, w, _, _, y = _inputs(3, None)
    ref, n = chunked_cross_entropy(h, lambda x: x @ w.t(), y, num_chunks=3)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    out = fused_linear_kd_and_ce(h, w, y, num_chunks=5)
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    torch.testing.assert_close(out["loss"], ref, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(gh, ref_gh)
    torch.testing.assert_close(gw, ref_gw)
    assert float(out["kd"]) == 0.0 and int(out["n"]) == int(n)

    frozen = w.detach()
    out = fused_linear_kd_and_ce(h, frozen, y, num_chunks=2)
    (gh2,) = torch.autograd.grad(out["loss"], (h,))
    torch.testing.assert_close(gh2, ref_gh)


def test_ignored_everywhere_is_zero_not_nan_and_masked_teacher_logits_are_safe():
    h, w, th, tw, y = _inputs(5, None)
    y_all = torch.full_like(y, -100)
    out = fused_linear_kd_and_ce(h, w, y_all, th, lambda x: x @ tw.t(), build_kd_loss("forward_kl"), 0.5)
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    assert float(out["loss"].detach()) == 0.0 and torch.all(gh == 0) and torch.all(gw == 0)

    def masked_teacher(x):  # a teacher that rules out half the vocabulary (-inf logits)
        logits = x @ tw.t()
        logits[..., ::2] = float("-inf")
        return logits

    kd = build_kd_loss("forward_kl", 2.0)
    ref = chunked_kd_and_ce(h, lambda x: x @ w.t(), th, masked_teacher, y, kd, num_chunks=2)
    out = fused_linear_kd_and_ce(h, w, y, th, masked_teacher, kd, 0.5, num_chunks=2)
    assert torch.isfinite(out["loss"])
    torch.testing.assert_close(out["kd"], ref["kd"])
    (gh,) = torch.autograd.grad(out["loss"], (h,))
    assert torch.isfinite(gh).all()


def test_tied_and_plain_heads_fuse_lora_and_biased_heads_fall_back():
    torch.manual_seed(0)
    embed = nn.Embedding(50, 16)
    from llm_recipe.components.models.tune import import_torchtune

    import_torchtune()
    from torchtune.modules import TiedLinear

    assert fusable_head_weight(TiedLinear(embed)) is embed.weight
    plain = nn.Linear(16, 50, bias=False)
    assert fusable_head_weight(plain) is plain.weight
    assert fusable_head_weight(nn.Linear(16, 50, bias=True)) is None
    lora_head = _linear("lm_head", 16, 50, False, LoRASettings(rank=4, targets=("lm_head",)))
    assert fusable_head_weight(lora_head) is None

    # kd_and_ce gives the same loss and gradients whichever path it takes.
    h, _, th, tw, y = _inputs(7, None)
    h = h.float().detach().requires_grad_(True)
    th, tw = th.float(), tw.float()
    kd = build_kd_loss("reverse_kl", 1.5)
    with torch.no_grad():
        plain.weight.copy_(lora_head.weight)
    fused = kd_and_ce(h, plain, y, th, lambda x: x @ tw.t(), kd, 0.25, num_chunks=3)
    (g_fused,) = torch.autograd.grad(fused["loss"], (h,))
    fallback = kd_and_ce(h, lora_head, y, th, lambda x: x @ tw.t(), kd, 0.25, num_chunks=3)
    (g_fallback,) = torch.autograd.grad(fallback["loss"], (h,))
    torch.testing.assert_close(fused["loss"], fallback["loss"])
    torch.testing.assert_close(g_fused, g_fallback)


def test_inference_mode_teacher_works_on_both_paths():
    h, _, th, tw, y = _inputs(9, None)
    head = nn.Linear(16, 50, bias=False).double()
    biased = nn.Linear(16, 50, bias=True).double()
    with torch.inference_mode():
        t_hidden = th.clone()
    kd = build_kd_loss("forward_kl")
    for student_head in (head, biased):
        out = kd_and_ce(h, student_head, y, t_hidden, lambda x: x @ tw.t(), kd, 0.5)
        out["loss"].backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
