"""Losses vs naive full-softmax references (fp64): the divergences, build_kd_loss, chunked CE and kd_and_ce on both
of its drivers (values, gradients, masking), the memory both drivers keep, and the vocabulary checks."""

from __future__ import annotations

import json
import math
import weakref

import kd_reference as ref
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.losses import (
    KD_LOSSES,
    CachedTeacher,
    LiveTeacher,
    build_kd_loss,
    chunked_cross_entropy,
    forward_kl,
    jsd,
    kd_and_ce,
    reverse_kl,
    same_tokenizer,
    shared_vocab,
    skew_kl,
    skew_reverse_kl,
    symmetric_kl,
)

B, S, D, V = 2, 13, 16, 50
F64 = torch.float64
ALL_KINDS = ref.KINDS
KWARGS = ref.OPTIONS
reference = ref.divergence  # explicit probabilities, plain log, no masking tricks

FUNCS = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "symmetric_kl": symmetric_kl,
    "jsd": jsd,
    "skew_kl": skew_kl,
    "skew_reverse_kl": skew_reverse_kl,
}


def _inputs(n=12, v=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, v, generator=g, dtype=F64) * 2).requires_grad_(True)
    t = torch.randn(n, v, generator=g, dtype=F64) * 2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[1, 4, 5]] = -100
    return s, t, labels


# ------------------------------------------------------------------------------------------------------------
# KD divergences
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_divergence_value_and_grad_match_reference(kind, temperature):
    s, t, labels = _inputs()
    kw = KWARGS.get(kind, {})
    got = FUNCS[kind](s, t, labels, temperature=temperature, **kw)
    (g_got,) = torch.autograd.grad(got, s)
    want = reference(kind, s, t, labels, temperature, **kw)
    (g_want,) = torch.autograd.grad(want, s)
    assert got.dtype == F64
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    assert got.item() > 0
    # the divergence bound by the factory (what configs use) computes the same number
    torch.testing.assert_close(build_kd_loss(kind, temperature, **kw)(s, t, labels), want)


def test_forward_and_reverse_kl_match_torch_kl_div():
    s, t, labels = _inputs()
    valid = labels != -100
    ls, lt = F.log_softmax(s[valid], -1), F.log_softmax(t[valid], -1)
    torch.testing.assert_close(forward_kl(s, t, labels), F.kl_div(ls, lt, reduction="sum", log_target=True))
    torch.testing.assert_close(reverse_kl(s, t, labels), F.kl_div(lt, ls, reduction="sum", log_target=True))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_identical_distributions_give_zero(kind):
    s, _, labels = _inputs()
    # same distribution, different logits (softmax is shift invariant)
    loss = FUNCS[kind](s, s.detach() + 3.0, labels, temperature=1.7, **KWARGS.get(kind, {}))
    assert abs(loss.item()) < 1e-12


def test_closed_form_two_token_cases():
    labels = torch.tensor([0])
    t = torch.tensor([[0.0, math.log(3.0)]], dtype=F64)  # p_T = (1/4, 3/4)
    s = torch.zeros(1, 2, dtype=F64)  # p_S = (1/2, 1/2)
    fkl = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    rkl = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    assert forward_kl(s, t, labels).item() == pytest.approx(fkl, abs=1e-12)
    assert reverse_kl(s, t, labels).item() == pytest.approx(rkl, abs=1e-12)
    assert symmetric_kl(s, t, labels, ratio=0.25).item() == pytest.approx(0.25 * fkl + 0.75 * rkl, abs=1e-12)
    # disjoint supports via -inf logits: JSD(0.5) = log 2, skew KL = log(1/alpha); no NaN/inf
    inf = -math.inf
    t = torch.tensor([[0.0, inf]], dtype=F64)
    s = torch.tensor([[inf, 0.0]], dtype=F64)
    assert jsd(s, t, labels, beta=0.5).item() == pytest.approx(math.log(2.0), abs=1e-12)
    # generalized JSD on disjoint supports: -beta log beta - (1-beta) log(1-beta)
    b = 0.2
    assert jsd(s, t, labels, beta=b).item() == pytest.approx(
        -b * math.log(b) - (1 - b) * math.log(1 - b), abs=1e-12
    )
    assert skew_kl(s, t, labels, alpha=0.1).item() == pytest.approx(math.log(10.0), abs=1e-12)
    assert skew_reverse_kl(s, t, labels, alpha=0.25).item() == pytest.approx(math.log(4.0), abs=1e-12)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_temperature_scales_logits_and_multiplies_by_t_squared(kind):
    s, t, labels = _inputs()
    kw = KWARGS.get(kind, {})
    T = 3.0
    hot = FUNCS[kind](s, t, labels, temperature=T, **kw)
    cold = FUNCS[kind](s / T, t / T, labels, temperature=1.0, **kw)
    torch.testing.assert_close(hot, cold * T**2)


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_ignored_rows_do_not_contribute(kind):
    s, t, labels = _inputs()
    kw = KWARGS.get(kind, {})
    valid = labels != -100
    kept = s.detach()[valid].requires_grad_(True)
    only_valid = FUNCS[kind](kept, t[valid], labels[valid], **kw)
    only_valid.backward()
    s2, t2 = s.detach().clone(), t.clone()
    s2[~valid] = float("nan")  # garbage in ignored rows must not leak in, in the value or the gradient
    t2[~valid] = 1e6
    s2.requires_grad_(True)
    got = FUNCS[kind](s2, t2, labels, **kw)
    got.backward()
    torch.testing.assert_close(got, only_valid)
    torch.testing.assert_close(s2.grad[valid], kept.grad)
    assert torch.equal(s2.grad[~valid], torch.zeros_like(s2.grad[~valid]))
    all_ignored = torch.full_like(labels, -100)
    assert FUNCS[kind](s, t, all_ignored, **kw).item() == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: whether a divergence waits for the GPU")
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_divergences_never_wait_for_the_gpu(kind):
    """No device-to-host sync in a divergence's value or gradient (on-policy KD runs one per loss chunk: a sync
    leaves the GPU idle while the host queues the next kernels)."""
    s, t, labels = (x.cuda() for x in _inputs())
    s = s.detach().float().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        FUNCS[kind](s, t.float(), labels, **KWARGS.get(kind, {})).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_masked_vocab_with_neg_inf_logits_gives_finite_value_and_grad(kind):
    s, t, labels = _inputs()
    labels = labels.clamp(max=V - 6)
    kw = KWARGS.get(kind, {})
    keep = V - 5
    s_inf = torch.cat([s[:, :keep], torch.full((s.shape[0], 5), -math.inf, dtype=F64)], dim=1).detach()
    s_inf.requires_grad_(True)
    t_inf = torch.cat([t[:, :keep], torch.full((t.shape[0], 5), -math.inf, dtype=F64)], dim=1)
    loss = FUNCS[kind](s_inf, t_inf, labels, **kw)
    (grad,) = torch.autograd.grad(loss, s_inf)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    s_small = s[:, :keep].detach().requires_grad_(True)
    want = reference(kind, s_small, t[:, :keep], labels, **kw)
    (g_want,) = torch.autograd.grad(want, s_small)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad[:, :keep], g_want)
    assert (grad[:, keep:] == 0).all()


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_bf16_inputs_are_computed_in_fp32(kind):
    s, t, labels = _inputs()
    sb, tb = s.detach().bfloat16(), t.bfloat16()
    loss = FUNCS[kind](sb, tb, labels, **KWARGS.get(kind, {}))
    assert loss.dtype == torch.float32
    want = reference(kind, sb.double(), tb.double(), labels, **KWARGS.get(kind, {}))
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)


def test_factory_errors_name_the_culprit():
    with pytest.raises(RecipeError, match="valid kinds: forward_kl, reverse_kl, symmetric_kl, jsd, skew_kl"):
        build_kd_loss("kl")
    with pytest.raises(RecipeError, match="does not take alpha; its options are: beta"):
        build_kd_loss("jsd", alpha=0.3)
    for beta in (0.0, 1.0):
        with pytest.raises(RecipeError, match=r"kd jsd beta must be in \(0, 1\), got .*forward_kl.*reverse_kl"):
            build_kd_loss("jsd", beta=beta)
    with pytest.raises(RecipeError, match="temperature"):
        build_kd_loss("forward_kl", temperature=0.0)
    with pytest.raises(RecipeError, match=r"kd skew_reverse_kl alpha must be in \[0, 1\), got 1.0"):
        build_kd_loss("skew_reverse_kl", alpha=1.0)
    with pytest.raises(RecipeError, match=r"kd symmetric_kl ratio must be in \[0, 1\]"):
        build_kd_loss("symmetric_kl", ratio=-0.1)
    assert set(KD_LOSSES) == set(ALL_KINDS)
    assert build_kd_loss("skew_kl", alpha=0.0)(*_inputs()).item() == pytest.approx(
        forward_kl(*_inputs()).item()
    )


# ------------------------------------------------------------------------------------------------------------
# Chunked CE and KD+CE vs full-logit references
# ------------------------------------------------------------------------------------------------------------


def _model_inputs(seed=0, v_head=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=g, dtype=F64, requires_grad=True)
    t_hidden = torch.randn(B, S, D, generator=g, dtype=F64, requires_grad=True)
    student = torch.nn.Linear(D, v_head, bias=False, dtype=F64)
    teacher = torch.nn.Linear(D, v_head + 7, bias=False, dtype=F64)  # padded teacher head
    with torch.no_grad():
        student.weight.copy_(torch.randn(v_head, D, generator=g, dtype=F64))
        teacher.weight.copy_(torch.randn(v_head + 7, D, generator=g, dtype=F64))
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, -1] = -100
    labels[0, :4] = -100  # a "prompt"
    return hidden, t_hidden, student, teacher, labels


@pytest.mark.parametrize("num_chunks", [1, 3, 8, 13, 40])
def test_chunked_cross_entropy_matches_full_logits(num_chunks):
    hidden, _, student, _, labels = _model_inputs()
    loss, n = chunked_cross_entropy(hidden, student, labels, num_chunks=num_chunks)
    g_h, g_w = torch.autograd.grad(loss, (hidden, student.weight))
    ref = F.cross_entropy(student(hidden).reshape(-1, V), labels.reshape(-1), reduction="sum")
    r_h, r_w = torch.autograd.grad(ref, (hidden, student.weight))
    assert n.item() == int((labels != -100).sum())
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g_h, r_h)
    torch.testing.assert_close(g_w, r_w)


def test_chunked_cross_entropy_plain_callable_and_vocab_slice():
    # a tied head (plain callable over an embedding weight) with 6 padding rows, trimmed back to V
    hidden, _, _, _, labels = _model_inputs()
    emb = torch.nn.Embedding(V + 6, D, dtype=F64)
    loss, _ = chunked_cross_entropy(
        hidden, lambda h: F.linear(h, emb.weight), labels, num_chunks=4, vocab_size=V
    )
    (g,) = torch.autograd.grad(loss, emb.weight)
    ref = F.cross_entropy(
        F.linear(hidden, emb.weight)[..., :V].reshape(-1, V), labels.reshape(-1), reduction="sum"
    )
    (rg,) = torch.autograd.grad(ref, emb.weight)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, rg)
    assert (g[V:] == 0).all()
    with torch.no_grad():
        torch.testing.assert_close(
            chunked_cross_entropy(hidden, lambda h: F.linear(h, emb.weight), labels, 3, V)[0], ref
        )


def _driver_head(driver: str, head: torch.nn.Linear):
    """`head` itself sends kd_and_ce to the fused driver; wrapped in a bare callable, to the checkpointed one."""
    return head if driver == "fused" else (lambda h: head(h))


@pytest.mark.parametrize("kind", ["forward_kl", "jsd", "skew_reverse_kl"])
@pytest.mark.parametrize("num_chunks", [1, 5, 40])
@pytest.mark.parametrize("driver", ["fused", "checkpointed"])
def test_kd_and_ce_matches_full_logits(kind, num_chunks, driver):
    hidden, t_hidden, student, teacher, labels = _model_inputs()
    # the student head has 3 padding rows too, so both heads are sliced to the shared V
    student_padded = torch.nn.Linear(D, V + 3, bias=False, dtype=F64)
    with torch.no_grad():
        student_padded.weight[:V] = student.weight
    kd = build_kd_loss(kind, temperature=2.0, **KWARGS.get(kind, {}))
    parts = kd_and_ce(hidden, _driver_head(driver, student_padded), labels, LiveTeacher(t_hidden, teacher), kd, 0.7,
                      num_chunks, vocab_size=V)
    n = int((labels != -100).sum())
    loss = parts["loss"] / n
    loss.backward()

    h_ref = hidden.detach().clone().requires_grad_(True)
    s_logits = student(h_ref).reshape(-1, V)
    with torch.no_grad():
        t_logits = teacher(t_hidden)[..., :V].reshape(-1, V)
    flat = labels.reshape(-1)
    ce_ref = F.cross_entropy(s_logits, flat, reduction="sum")
    kd_ref = reference(kind, s_logits, t_logits, flat, 2.0, **KWARGS.get(kind, {}))
    ref = 0.3 * ce_ref / n + 0.7 * kd_ref / n
    ref.backward()

    assert parts["n"].item() == n
    torch.testing.assert_close(parts["ce"], ce_ref)
    torch.testing.assert_close(parts["kd"], kd_ref)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, h_ref.grad)
    torch.testing.assert_close(student_padded.weight.grad[:V], student.weight.grad)
    assert (student_padded.weight.grad[V:] == 0).all()
    # the teacher gets no gradient at all
    assert teacher.weight.grad is None and t_hidden.grad is None


def test_argument_errors():
    hidden, t_hidden, student, teacher, labels = _model_inputs()
    live = LiveTeacher(t_hidden, teacher)
    with pytest.raises(RecipeError, match=r"kd_ratio must be in \[0, 1\], got 1.5"):
        kd_and_ce(hidden, student, labels, live, build_kd_loss("forward_kl"), 1.5)
    with pytest.raises(ValueError, match="a teacher needs a kd_loss"):
        kd_and_ce(hidden, student, labels, live, None, 0.5)
    with pytest.raises(ValueError, match="must share batch and sequence dims"):
        kd_and_ce(hidden, student, labels, LiveTeacher(t_hidden[:, 1:], teacher), build_kd_loss("forward_kl"), 0.5)
    with pytest.raises(ValueError, match=r"expected logp \[b, s, k \+ 1\] and ids \[b, s, k\]"):
        CachedTeacher(torch.zeros(B, S, 4), torch.zeros(B, S, 4, dtype=torch.long))
    for fn in (kd_and_ce, chunked_cross_entropy):
        with pytest.raises(RecipeError, match="num_chunks"):
            fn(hidden, student, labels, num_chunks=0)
    with pytest.raises(RecipeError, match="vocab_size=60 exceeds the output head's 50"):
        chunked_cross_entropy(hidden, student, labels, num_chunks=2, vocab_size=60)
    with pytest.raises(RecipeError, match="vocab_size=60 exceeds the output head's 50"):
        kd_and_ce(hidden, student, labels, num_chunks=2, vocab_size=60)


# ------------------------------------------------------------------------------------------------------------
# Memory: neither driver ever holds full [b, s, v] logits
# ------------------------------------------------------------------------------------------------------------


# odd hidden size: projection weights/grads ([17, v]) are told apart from logits ([2*c, v], even rows)
D_MEM = 17


class _LogitsTracker(TorchDispatchMode):
    """Records every non-view logits-like tensor (last dim v) created in forward AND backward, and their live peak."""

    def __init__(self, v: int):
        super().__init__()
        self.v, self.live, self.peak, self.largest = v, 0, 0, 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dim() > 0
                and t.shape[-1] == self.v
                and D_MEM not in t.shape
                and not t._is_view()
            ):
                n = t.numel()
                self.live += n
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, n)
                weakref.finalize(t, self._free, n)
        return out


def _kd_step(num_chunks: int, s: int, driver: str | None) -> _LogitsTracker:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, s, D_MEM, generator=g, dtype=F64, requires_grad=True)
    t_hidden = torch.randn(B, s, D_MEM, generator=g, dtype=F64)
    student = torch.nn.Linear(D_MEM, V, bias=False, dtype=F64)
    teacher = torch.nn.Linear(D_MEM, V, bias=False, dtype=F64)
    labels = torch.randint(0, V, (B, s), generator=g)
    kd = build_kd_loss("jsd")
    with _LogitsTracker(V) as tracker:
        if driver is not None:
            head = _driver_head(driver, student)
            loss = kd_and_ce(hidden, head, labels, LiveTeacher(t_hidden, teacher), kd, 0.5, num_chunks)["loss"]
        else:
            s_logits = student(hidden).reshape(-1, V)
            with torch.no_grad():
                t_logits = teacher(t_hidden).reshape(-1, V)
            ce = F.cross_entropy(s_logits, labels.reshape(-1), reduction="sum")
            loss = 0.5 * ce + 0.5 * kd(s_logits, t_logits, labels.reshape(-1))
        (loss / labels.numel()).backward()
    return tracker


@pytest.mark.parametrize("driver", ["fused", "checkpointed"])
def test_no_driver_creates_or_keeps_full_logits(driver):
    s, k = 32, 16  # chunks of 2 positions
    full = B * s * V
    naive = _kd_step(1, s, None)
    assert naive.largest >= full
    one_chunk = _kd_step(1, s, driver)
    chunked = _kd_step(k, s, driver)
    half_seq = _kd_step(k // 2, s // 2, driver)  # same chunk length, half the sequence
    # no logits-like tensor is ever bigger than one chunk [b, s/k, v] (x2: JSD stacks teacher and student)
    assert chunked.largest <= 2 * B * (s // k) * V < full
    # live logits-sized memory, forward and backward together, is set by the chunk length, not the sequence length
    assert chunked.peak == half_seq.peak
    # the fused driver also holds the previous chunk's logits gradient until the next one replaces it
    slack = B * (s // k) * V if driver == "fused" else 0
    assert chunked.peak <= one_chunk.peak * (s // k) / s + slack


@pytest.mark.parametrize("fn", ["ce", "kd"])
def test_no_logits_saved_for_backward_outside_the_current_chunk(fn):
    """The checkpointed driver keeps only hidden-state chunks for backward (the fused driver keeps only the
    gradients it computed in forward: test_no_driver_creates_or_keeps_full_logits)."""
    hidden, t_hidden, student, teacher, labels = _model_inputs()
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if fn == "ce":
            loss = chunked_cross_entropy(hidden, student, labels, num_chunks=4)[0]
        else:
            head = _driver_head("checkpointed", student)
            loss = kd_and_ce(hidden, head, labels, LiveTeacher(t_hidden, teacher), build_kd_loss("reverse_kl"), 0.5,
                             4, V)["loss"]
    assert sum(saved) < B * S * V, saved
    loss.backward()

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(student(hidden).reshape(-1, V), labels.reshape(-1), reduction="sum")
    assert max(saved) >= B * S * V  # the naive path does keep full logits: the probe sees them


# ------------------------------------------------------------------------------------------------------------
# Vocabulary compatibility
# ------------------------------------------------------------------------------------------------------------


def test_shared_vocab_trims_padding_and_refuses_real_mismatch():
    assert shared_vocab(49152, 49152, 49152) == (49152, None)
    size, msg = shared_vocab(151936, 152064, 151665)
    assert size == 151665 and "151936" in msg and "152064" in msg and "151665" in msg
    with pytest.raises(
        RecipeError, match=r"student output vocab \(32000\) is smaller than the tokenizer vocab"
    ):
        shared_vocab(32000, 49152, 49152)
    with pytest.raises(RecipeError, match="teacher output vocab"):
        shared_vocab(49152, 32000, 49152)
    with pytest.raises(RecipeError, match="tokenizers differ"):
        shared_vocab(49152, 49152, 49152, tokenizers_match=False)


def test_same_tokenizer_compares_vocab_and_added_tokens(tmp_path):
    def write(name, vocab, added):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(
            json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added, "normalizer": name})
        )
        return d

    a = write("a", {"x": 0, "y": 1}, [{"id": 2, "content": "<eos>"}])
    b = write("b", {"x": 0, "y": 1}, [{"id": 2, "content": "<eos>"}])
    c = write("c", {"x": 1, "y": 0}, [{"id": 2, "content": "<eos>"}])
    d = write("d", {"x": 0, "y": 1}, [{"id": 2, "content": "</s>"}])
    assert same_tokenizer(a, b)
    assert not same_tokenizer(a, c)
    assert not same_tokenizer(a, d)
    with pytest.raises(RecipeError, match="tokenizer.json not found"):
        same_tokenizer(a, tmp_path)
