"""kd_and_ce with a live teacher equals a direct full-vocabulary computation (tests/fixtures/kd_reference.py) on
both of its drivers, fused (a plain head weight) and checkpointed (any other head): values and gradients (fp64,
CPU), for every divergence, temperature, vocab slicing, one chunk or several, ignored tokens, frozen and tied
heads, -inf teacher logits and an inference-mode teacher; and the heads it cannot fuse take the other driver."""


import kd_reference as ref
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llm_recipe.components.losses import LiveTeacher, build_kd_loss, kd_and_ce
from llm_recipe.components.losses.fused import fusable_head_weight
from llm_recipe.components.models.builder import LoRASettings, _linear

KINDS = [(kind, ref.OPTIONS.get(kind, {})) for kind in ref.KINDS]


def _inputs(seed: int, vocab: int | None, b=2, s=7, d=16, dt=24, v=50):
    h, w, th, tw, y = ref.random_inputs(seed, b, s, d, dt, v, label_vocab=vocab)
    y[0, :3] = -100  # ignored tokens (prompt / padding)
    return h, w, th, tw, y


def _head(path: str, w: torch.Tensor):
    """The student head that makes kd_and_ce take `path`: a plain Linear fuses, a bare callable does not."""
    return ref.plain_head(w) if path == "fused" else (lambda x: x @ w.t())


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("temperature,vocab,kd_ratio,chunks", [(1.0, None, 0.5, 4), (2.0, 40, 0.7, 3),
                                                               (0.5, None, 1.0, 1)])
@pytest.mark.parametrize("path", ["fused", "checkpointed"])
def test_both_drivers_match_the_full_vocabulary_reference(kind, extra, temperature, vocab, kd_ratio, chunks, path):
    h, w, th, tw, y = _inputs(hash((kind, temperature)) % 1000, vocab)
    v = vocab or w.shape[0]
    s_ref = (h @ w.t())[..., :v].flatten(0, 1)
    ref_loss, ref_ce, ref_kd = ref.objective(kind, s_ref, y.flatten(), kd_ratio, (th @ tw.t())[..., :v].flatten(0, 1),
                                             temperature, **extra)
    ref_gh, ref_gw = torch.autograd.grad(ref_loss * 3.0, (h, w))  # a scale, as the train loop's 1/n applies

    out = kd_and_ce(h, _head(path, w), y, LiveTeacher(th, lambda x: x @ tw.t()),
                    build_kd_loss(kind, temperature, **extra), kd_ratio, num_chunks=chunks, vocab_size=vocab)
    gh, gw = torch.autograd.grad(out["loss"] * 3.0, (h, w))
    torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["ce"], ref_ce, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["kd"], ref_kd, rtol=1e-12, atol=1e-10)
    assert not out["ce"].requires_grad and not out["kd"].requires_grad
    assert int(out["n"]) == int((y != -100).sum())
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)
    if vocab is not None:  # padding rows of the head never get a gradient
        assert torch.all(gw[vocab:] == 0)


@pytest.mark.parametrize("path", ["fused", "checkpointed"])
def test_ce_alone_matches_cross_entropy_and_a_frozen_head_gets_no_grad(path):
    h, w, _, _, y = _inputs(3, None)
    want = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten(), reduction="sum")
    want_gh, want_gw = torch.autograd.grad(want * 0.75, (h, w))
    out = kd_and_ce(h, _head(path, w), y, kd_ratio=0.25, num_chunks=5)
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    torch.testing.assert_close(out["loss"], want * 0.75, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["ce"], want, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(gh, want_gh)
    torch.testing.assert_close(gw, want_gw)
    assert float(out["kd"]) == 0.0 and int(out["n"]) == int((y != -100).sum())

    out = kd_and_ce(h, _head(path, w.detach()), y, kd_ratio=0.25, num_chunks=2)
    (gh2,) = torch.autograd.grad(out["loss"], (h,))
    torch.testing.assert_close(gh2, want_gh)


@pytest.mark.parametrize("path", ["fused", "checkpointed"])
def test_ignored_everywhere_is_zero_not_nan_and_masked_teacher_logits_are_safe(path):
    h, w, th, tw, y = _inputs(5, None)
    teacher = LiveTeacher(th, lambda x: x @ tw.t())
    out = kd_and_ce(h, _head(path, w), torch.full_like(y, -100), teacher, build_kd_loss("forward_kl"), 0.5)
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    assert float(out["loss"].detach()) == 0.0 and torch.all(gh == 0) and torch.all(gw == 0)

    def masked_teacher(x):  # a teacher that rules out half the vocabulary (-inf logits)
        logits = x @ tw.t()
        logits[..., ::2] = float("-inf")
        return logits

    out = kd_and_ce(h, _head(path, w), y, LiveTeacher(th, masked_teacher), build_kd_loss("forward_kl", 2.0), 0.5,
                    num_chunks=2)
    (gh,) = torch.autograd.grad(out["loss"], (h,))
    assert torch.isfinite(out["loss"]) and torch.isfinite(gh).all()
    # the reference, written out: KL over the teacher's support only (0 log 0 = 0)
    valid = y.flatten() != -100
    pt = torch.softmax(masked_teacher(th).flatten(0, 1)[valid] / 2.0, dim=-1)
    ps = torch.softmax((h @ w.t()).flatten(0, 1)[valid] / 2.0, dim=-1)
    want = (torch.special.xlogy(pt, pt) - torch.where(pt > 0, pt * ps.log(), 0.0)).sum() * 4.0
    torch.testing.assert_close(out["kd"], want.detach())


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

    # kd_and_ce gives the reference's loss and gradients whichever driver the head sends it to.
    h, _, th, tw, y = _inputs(7, None)
    h = h.float().detach().requires_grad_(True)
    th, tw = th.float(), tw.float()
    kd = build_kd_loss("reverse_kl", 1.5)
    with torch.no_grad():
        plain.weight.copy_(lora_head.weight)  # the LoRA head starts as its base weight (B = 0)
    want, _, _ = ref.objective("reverse_kl", plain(h).flatten(0, 1), y.flatten(), 0.25,
                               (th @ tw.t()).flatten(0, 1), 1.5)
    (want_g,) = torch.autograd.grad(want, (h,))
    for head in (plain, TiedLinear(nn.Embedding.from_pretrained(plain.weight.detach())), lora_head):
        out = kd_and_ce(h, head, y, LiveTeacher(th, lambda x: x @ tw.t()), kd, 0.25, num_chunks=3)
        (g,) = torch.autograd.grad(out["loss"], (h,))
        torch.testing.assert_close(out["loss"], want)
        torch.testing.assert_close(g, want_g)


def test_inference_mode_teacher_works_on_both_drivers():
    h, _, th, tw, y = _inputs(9, None)
    head = nn.Linear(16, 50, bias=False).double()
    biased = nn.Linear(16, 50, bias=True).double()
    with torch.no_grad():
        biased.bias.zero_()
        biased.weight.copy_(head.weight)
    with torch.inference_mode():
        t_hidden = th.clone()
    want, _, _ = ref.objective("forward_kl", head(h).flatten(0, 1), y.flatten(), 0.5, (th @ tw.t()).flatten(0, 1))
    (want_g,) = torch.autograd.grad(want, (h,))
    for student_head in (head, biased):
        out = kd_and_ce(h, student_head, y, LiveTeacher(t_hidden, lambda x: x @ tw.t()), build_kd_loss("forward_kl"),
                        0.5)
        (g,) = torch.autograd.grad(out["loss"], (h,))
        torch.testing.assert_close(out["loss"], want)
        torch.testing.assert_close(g, want_g)
