"""kd_and_ce with a cached teacher sample (SampledTeacher, components/losses/sampled.py), in fp64: averaged over
independent draws its gradient and KD value converge to online forward KL's (a top-k cache's gradient does not:
its bias), the closed-form (fused) and autograd (checkpointed) paths agree, the draws follow the teacher, the
stored format round-trips, and a divergence the sample cannot estimate is a one-line error."""


import kd_reference as ref
import pytest
import torch
from safetensors.torch import load, save
from torch import nn

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.logits_cache import encode_sampled, item_uniforms
from llm_recipe.components.logits_cache.manifest import bytes_per_token, decode_sampled
from llm_recipe.components.losses import CachedTeacher, LiveTeacher, SampledTeacher, build_kd_loss, kd_and_ce
from llm_recipe.components.losses.sampled import compact_draws, teacher_samples


def _inputs(seed: int, b=2, s=7, d=16, v=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, s, d, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    t = 1.5 * torch.randn(b, s, v, dtype=torch.float64, generator=g)  # teacher logits
    y = torch.randint(0, v, (b, s), generator=g)
    y[0, :3] = -100
    return h, w, t, y


def _linear(w: torch.Tensor) -> nn.Linear:
    head = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    del head.weight
    head.weight = w
    return head


class _Head(nn.Module):  # not fusable: the checkpointed driver, autograd through sampled_forward_kl
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, x):
        return x @ self.w.t()


def _sample(t: torch.Tensor, n: int, temperature: float, seed: int) -> SampledTeacher:
    """A sampled cache's targets for teacher logits t [b, s, v] (fp64, no fp16 rounding)."""
    u = torch.rand((t.shape[0] * t.shape[1], n), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logp, ids, counts = teacher_samples(t.flatten(0, 1), u, temperature)
    return SampledTeacher(*(x.unflatten(0, t.shape[:2]) for x in (logp, ids, counts)))


def _repeat(x: torch.Tensor, m: int) -> torch.Tensor:
    return x.repeat(m, *([1] * (x.dim() - 1)))


def _mean_grads(h, w, y, teacher, m: int, temperature: float, fused: bool = True):
    """Gradients (h, w) and KD value of the forward-KL loss (kd_ratio 1) against `teacher` for a batch repeated m
    times (one independent draw per copy when `teacher` is a sample of the repeated batch), divided by m."""
    hm = _repeat(h, m)
    out = kd_and_ce(hm, _linear(w) if fused else _Head(w), _repeat(y, m), teacher,
                    build_kd_loss("forward_kl", temperature), 1.0, num_chunks=4)
    gh, gw = torch.autograd.grad(out["loss"] / m, (h, w))
    return gh, gw, float(out["kd"]) / m


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_sampled_gradient_averages_to_online_forward_kl_and_top_k_does_not(temperature):
    h, w, t, y = _inputs(0)
    online_gh, online_gw, online_kd = _mean_grads(h, w, y, LiveTeacher(t, lambda x: x), 1, temperature)
    full_kd = float(ref.divergence("forward_kl", (h @ w.t()).detach().flatten(0, 1), t.flatten(0, 1), y.flatten(),
                                   temperature))
    assert online_kd == pytest.approx(full_kd, rel=1e-10)

    def err(g, want):
        return float((g - want).norm() / want.norm())

    errors = {}
    for m in (100, 3200):
        gh, gw, kd = _mean_grads(h, w, y, _sample(_repeat(t, m), 8, temperature, seed=m), m, temperature)
        errors[m] = (err(gh, online_gh), err(gw, online_gw), abs(kd - online_kd) / online_kd)
    # unbiased: the error shrinks like 1/sqrt(m) (32x the draws: ~5.7x smaller) towards 0
    assert max(errors[3200]) < 0.03, errors
    assert all(errors[3200][i] < errors[100][i] / 2.5 for i in range(2)), errors
    # a top-5 cache's gradient is exact (no draws), but the wrong one: its bias does not average away
    logp, ids = ref.topk_cache(t.flatten(0, 1), 5, temperature)
    topk = CachedTeacher(logp.unflatten(0, t.shape[:2]), ids.unflatten(0, t.shape[:2]))
    gh, gw, _ = _mean_grads(h, w, y, topk, 1, temperature)
    assert err(gh, online_gh) > 0.1 and err(gw, online_gw) > 0.1


@pytest.mark.parametrize("temperature,kd_ratio,chunks", [(1.0, 0.5, 3), (2.0, 1.0, 1), (0.7, 0.3, 2)])
def test_fused_closed_form_equals_autograd_and_the_estimate_written_out(temperature, kd_ratio, chunks):
    h, w, t, y = _inputs(5)
    teacher = _sample(t, 6, temperature, seed=1)
    kd_loss = build_kd_loss("forward_kl", temperature)
    outs = []
    for head in (_linear(w), _Head(w)):
        out = kd_and_ce(h, head, y, teacher, kd_loss, kd_ratio, num_chunks=chunks)
        outs.append((out, torch.autograd.grad(out["loss"], (h, w))))
    (a, ga), (b, gb) = outs
    for key in ("loss", "ce", "kd"):
        torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-10)
    for x, z in zip(ga, gb):
        torch.testing.assert_close(x, z, rtol=1e-8, atol=1e-10)
    # the KD value: T^2 sum_v (c_v / N) (log p_v - log q_v) over valid rows
    s = (h @ w.t()).flatten(0, 1).detach()
    log_q = torch.log_softmax(s / temperature, -1)
    log_p = torch.log_softmax(t.flatten(0, 1) / temperature, -1)
    logp, ids, counts = (x.flatten(0, 1) for x in teacher.tensors())
    per = (counts.double() / 6 * (log_p.gather(1, ids) - log_q.gather(1, ids))).sum(-1)
    want = per[y.flatten() != -100].sum() * temperature**2
    torch.testing.assert_close(a["kd"], want, rtol=1e-10, atol=1e-10)


def test_draws_follow_the_teacher_and_never_pick_a_zero_probability_id():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 30, dtype=torch.float64, generator=g)
    logits[:, ::3] = float("-inf")
    n = 20000
    logp, ids, counts = teacher_samples(logits, torch.rand(4, n, generator=g, dtype=torch.float64), 1.5)
    assert torch.all(counts.sum(-1) == n)
    freq = torch.zeros(4, 30, dtype=torch.float64).scatter_add_(1, ids, counts.double()) / n
    p = torch.softmax(logits / 1.5, -1)
    assert torch.all(freq[:, ::3] == 0)
    assert float((freq - p).abs().max()) < 4 * (0.25 / n) ** 0.5
    kept = counts > 0
    torch.testing.assert_close(logp[kept], torch.log_softmax(logits / 1.5, -1).gather(1, ids)[kept])
    d, c = compact_draws(torch.tensor([[7, 2, 7, 7, 0], [3, 3, 3, 3, 3]]))
    assert d.tolist() == [[0, 2, 7, 0, 0], [3, 0, 0, 0, 0]] and c.tolist() == [[1, 1, 3, 0, 0], [5, 0, 0, 0, 0]]


def test_stored_format_round_trips_and_draws_are_reproducible():
    _, _, t, _ = _inputs(9, v=70000)  # ids above 2^16: all three id bytes in use
    u = torch.cat([item_uniforms(0, item, 7, 32) for item in (4, 5)])
    assert torch.equal(u, torch.cat([item_uniforms(0, item, 7, 32) for item in (4, 5)]))
    assert not torch.equal(u[:7], item_uniforms(1, 4, 7, 32))  # another seed, other draws
    logp, ids, counts = teacher_samples(t.flatten(0, 1), u, 1.0)
    tensors = load(save(encode_sampled(logp, ids, counts)))
    width = (counts > 0).sum(-1)
    payload = sum(x.numel() * x.element_size() for x in tensors.values())
    assert payload == int(width.sum()) * 6 + logp.shape[0] and payload <= logp.shape[0] * bytes_per_token(32, "sampled")
    back = decode_sampled(tensors["widths"], tensors["ids"], tensors["counts"], tensors["logprobs"], 32)
    assert torch.equal(back[1], ids) and torch.equal(back[2], counts)
    torch.testing.assert_close(back[0].double(), logp.to(torch.float16).double())
    # a range of rows decodes alone (the reader slices a shard by item)
    e = torch.cat([width.new_zeros(1), width.cumsum(0)])
    a, b = 3, 9
    part = decode_sampled(tensors["widths"][a:b], tensors["ids"][3 * e[a]:3 * e[b]], tensors["counts"][e[a]:e[b]],
                          tensors["logprobs"][e[a]:e[b]], 32)
    assert torch.equal(part[1], ids[a:b]) and torch.equal(part[2], counts[a:b])


@pytest.mark.parametrize("fused", [True, False])
def test_other_divergences_are_a_one_line_error_naming_kd_loss_and_the_cache(fused):
    h, w, t, y = _inputs(2)
    with pytest.raises(RecipeError) as e:
        kd_and_ce(h, _linear(w) if fused else _Head(w), y, _sample(t, 4, 1.0, 0), build_kd_loss("jsd", beta=0.3),
                  0.5)
    msg = str(e.value)
    assert "\n" not in msg and "kd.loss=jsd" in msg and "teacher.logits_dir" in msg and "forward_kl" in msg
    assert "cache.mode=sampled" in msg and "rebuild the cache with `recipe run kd_logits ... cache.mode=topk`" in msg
