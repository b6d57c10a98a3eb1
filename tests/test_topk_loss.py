"""The cached top-k KD loss (components/losses/topk.py): with k = vocab it IS the full-vocabulary loss (values and
gradients, fp64, fused and checkpointed paths, every divergence); with k < vocab the closed-form forward-KL
gradient equals autograd's, the bucket KL is a lower bound of the full KL, and a student equal to the teacher
scores 0."""

import pytest
import torch
from torch import nn

from llm_recipe.components.losses import build_kd_loss, chunked_kd_and_ce
from llm_recipe.components.losses.topk import cached_kd_and_ce, teacher_topk

KINDS = [("forward_kl", {}), ("reverse_kl", {}), ("symmetric_kl", {"ratio": 0.3}), ("jsd", {"beta": 0.3}),
         ("skew_kl", {"alpha": 0.2}), ("skew_reverse_kl", {"alpha": 0.2})]


def _inputs(seed: int, b=2, s=7, d=16, dt=24, v=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    th = torch.randn(b, s, dt, dtype=torch.float64, generator=g)
    tw = torch.randn(v, dt, dtype=torch.float64, generator=g)
    y = torch.randint(0, v, (b, s), generator=g)
    y[0, :3] = -100
    return h, w, th, tw, y


def _targets(th: torch.Tensor, tw: torch.Tensor, k: int, temperature: float):
    """What the cache stores (here in fp64, without the fp16 rounding): [b, s, k + 1] log-probs and [b, s, k] ids."""
    values, ids, tail = teacher_topk((th @ tw.t()).flatten(0, 1), k, temperature)
    logp = torch.cat([values, tail[:, None]], dim=1)
    return logp.unflatten(0, th.shape[:2]), ids.unflatten(0, th.shape[:2])


def _linear(w: torch.Tensor) -> nn.Linear:
    """A plain bias-free Linear (the fused path) whose weight is the test's leaf tensor `w`."""
    head = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    del head.weight
    head.weight = w
    return head


class _Head(nn.Module):  # not fusable: goes through the checkpointed chunks
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return x @ self.w.t()


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature,kd_ratio", [(1.0, 0.5), (2.0, 1.0)])
def test_k_equal_vocab_is_the_full_vocabulary_loss(kind, extra, fused, temperature, kd_ratio):
    h, w, th, tw, y = _inputs(hash((kind, temperature)) % 1000)
    kd = build_kd_loss(kind, temperature, **extra)
    ref = chunked_kd_and_ce(h, lambda x: x @ w.t(), th, lambda x: x @ tw.t(), y, kd, num_chunks=2)
    ref_loss = (1 - kd_ratio) * ref["ce"] + kd_ratio * ref["kd"]
    ref_gh, ref_gw = torch.autograd.grad(ref_loss * 3.0, (h, w))

    logp, ids = _targets(th, tw, k=w.shape[0], temperature=temperature)
    head = _linear(w) if fused else _Head(w)
    out = cached_kd_and_ce(h, head, y, logp, ids, kd, kd_ratio, num_chunks=3)
    gh, gw = torch.autograd.grad(out["loss"] * 3.0, (h, w))
    torch.testing.assert_close(out["kd"], ref["kd"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["ce"], ref["ce"], rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("temperature,k", [(1.0, 5), (2.0, 1), (0.7, 40)])
def test_closed_form_topk_forward_kl_matches_autograd_and_bounds_the_full_kl(temperature, k):
    h, w, th, tw, y = _inputs(7)
    kd = build_kd_loss("forward_kl", temperature)
    logp, ids = _targets(th, tw, k, temperature)
    head = _linear(w)
    fused = cached_kd_and_ce(h, head, y, logp, ids, kd, 0.6, num_chunks=2)
    g_fused = torch.autograd.grad(fused["loss"], (h, w))
    chunked = cached_kd_and_ce(h, _Head(w), y, logp, ids, kd, 0.6, num_chunks=4)  # autograd through buckets
    g_chunked = torch.autograd.grad(chunked["loss"], (h, w))
    torch.testing.assert_close(fused["kd"], chunked["kd"], rtol=1e-10, atol=1e-10)
    for a, b in zip(g_fused, g_chunked):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    full = chunked_kd_and_ce(h, lambda x: x @ w.t(), th, lambda x: x @ tw.t(), y, kd)["kd"]
    assert 0 < float(fused["kd"]) < float(full.detach())  # coarse-graining never increases a KL (data processing)


def test_student_equal_to_teacher_scores_zero_and_gets_no_kd_gradient():
    h, w, _, _, y = _inputs(3)
    with torch.no_grad():
        logp, ids = _targets(h.detach(), w.detach(), k=4, temperature=1.5)
    head = _linear(w)
    out = cached_kd_and_ce(h, head, y, logp, ids, build_kd_loss("forward_kl", 1.5), 1.0)
    assert abs(float(out["kd"])) < 1e-10
    (gh,) = torch.autograd.grad(out["loss"], (h,))
    assert float(gh.abs().max()) < 1e-10
