"""kd_and_ce with a cached top-k teacher (CachedTeacher, components/losses/topk.py) equals the k + 1 bucket
divergence written out (tests/fixtures/kd_reference.py): values and gradients, fp64, fused and checkpointed
drivers, every divergence, k < vocab and k = vocab (where it IS the full-vocabulary loss), a student head with
padding rows; the bucket KL is a lower bound of the full KL, and a student equal to the teacher scores 0."""


import kd_reference as ref
import pytest
import torch
from torch import nn

from llm_recipe.components.losses import CachedTeacher, build_kd_loss, kd_and_ce
from llm_recipe.components.losses.topk import teacher_topk

KINDS = [(kind, ref.OPTIONS.get(kind, {})) for kind in ref.KINDS]


def _inputs(seed: int, b=2, s=7, d=16, dt=24, v=50):
    h, w, th, tw, y = ref.random_inputs(seed, b, s, d, dt, v)
    y[0, :3] = -100
    return h, w, th, tw, y


def _targets(th: torch.Tensor, tw: torch.Tensor, k: int, temperature: float):
    """What the cache stores (here in fp64, without the fp16 rounding): [b, s, k + 1] log-probs and [b, s, k] ids."""
    logp, ids = ref.topk_cache((th @ tw.t()).flatten(0, 1), k, temperature)
    return logp.unflatten(0, th.shape[:2]), ids.unflatten(0, th.shape[:2])


class _Head(nn.Module):  # not fusable: goes through the checkpointed chunks
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return x @ self.w.t()


def test_teacher_topk_is_what_a_cache_stores():
    _, _, th, tw, _ = _inputs(1)
    t = (th @ tw.t()).flatten(0, 1)
    for k, temperature in ((5, 1.0), (50, 2.0)):
        values, ids, tail = teacher_topk(t, k, temperature)
        want_logp, want_ids = ref.topk_cache(t, k, temperature)
        torch.testing.assert_close(ids, want_ids)
        torch.testing.assert_close(torch.cat([values, tail[:, None]], dim=1), want_logp)


@pytest.mark.parametrize("kind,extra", KINDS)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("temperature,kd_ratio,k,chunks", [(1.0, 0.5, 50, 3), (2.0, 1.0, 50, 1), (1.0, 0.6, 5, 3),
                                                           (0.7, 0.3, 1, 1)])
def test_cached_loss_matches_the_bucket_reference(kind, extra, fused, temperature, kd_ratio, k, chunks):
    h, w, th, tw, y = _inputs(hash((kind, temperature)) % 1000)
    logp, ids = _targets(th, tw, k, temperature)
    s_ref = (h @ w.t()).flatten(0, 1)
    ref_loss, ref_ce, ref_kd = ref.objective(kind, s_ref, y.flatten(), kd_ratio,
                                             (logp.flatten(0, 1), ids.flatten(0, 1)), temperature, **extra)
    ref_gh, ref_gw = torch.autograd.grad(ref_loss * 3.0, (h, w))

    head = ref.plain_head(w) if fused else _Head(w)
    out = kd_and_ce(h, head, y, CachedTeacher(logp, ids), build_kd_loss(kind, temperature, **extra), kd_ratio,
                    num_chunks=chunks)
    gh, gw = torch.autograd.grad(out["loss"] * 3.0, (h, w))
    torch.testing.assert_close(out["kd"], ref_kd, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out["ce"], ref_ce, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-8, atol=1e-10)
    if k == w.shape[0]:  # no tail bucket: the full-vocabulary loss
        full = ref.divergence(kind, s_ref, (th @ tw.t()).flatten(0, 1), y.flatten(), temperature, **extra)
        torch.testing.assert_close(out["kd"], full, rtol=1e-10, atol=1e-10)
    elif kind == "forward_kl":  # coarse-graining never increases a KL (data processing)
        full = ref.divergence(kind, s_ref, (th @ tw.t()).flatten(0, 1), y.flatten(), temperature)
        assert 0 < float(out["kd"]) < float(full.detach())


def test_student_equal_to_teacher_scores_zero_and_gets_no_kd_gradient():
    h, w, _, _, y = _inputs(3)
    with torch.no_grad():
        logp, ids = _targets(h.detach(), w.detach(), k=4, temperature=1.5)
    head = ref.plain_head(w)
    out = kd_and_ce(h, head, y, CachedTeacher(logp, ids), build_kd_loss("forward_kl", 1.5), 1.0)
    assert abs(float(out["kd"])) < 1e-10
    (gh,) = torch.autograd.grad(out["loss"], (h,))
    assert float(gh.abs().max()) < 1e-10


@pytest.mark.parametrize("fused", [True, False])
def test_student_head_padding_rows_are_sliced_to_the_cache_vocabulary(fused):
    h, w, th, tw, y = _inputs(11)
    padded = torch.cat([w.detach(), torch.randn(6, w.shape[1], dtype=w.dtype)]).requires_grad_(True)
    logp, ids = _targets(th, tw, 5, 1.0)
    want, _, _ = ref.objective("jsd", (h @ w.t()).flatten(0, 1), y.flatten(), 0.5,
                               (logp.flatten(0, 1), ids.flatten(0, 1)), 1.0, beta=0.3)
    want_gh, want_gw = torch.autograd.grad(want, (h, w))
    out = kd_and_ce(h, ref.plain_head(padded) if fused else _Head(padded), y, CachedTeacher(logp, ids),
                    build_kd_loss("jsd", beta=0.3), 0.5, num_chunks=2, vocab_size=w.shape[0])
    gh, gw = torch.autograd.grad(out["loss"], (h, padded))
    torch.testing.assert_close(out["loss"], want)
    torch.testing.assert_close(gh, want_gh)
    torch.testing.assert_close(gw[: w.shape[0]], want_gw)
    assert torch.all(gw[w.shape[0]:] == 0)
