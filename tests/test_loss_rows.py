"""Prompt tokens (no label) are not projected: given the labelled rows from the host (`loss_rows`), the fused loss
runs its chunks over those rows and skips whole chunks of the others, with the same values and gradients as the
full-vocabulary reference (fp64, CPU) for every divergence, a live and a cached teacher, and CE alone; the
teacher's head sees only the rows it must; `to_device` hands the recipes those rows."""


import kd_reference as ref
import pytest
import torch

from llm_recipe.components.losses import CachedTeacher, LiveTeacher, build_kd_loss, kd_and_ce
from llm_recipe.components.losses import fused as fused_module
from llm_recipe.components.losses.rows import loss_rows
from llm_recipe.components.training import LOSS_ROWS, to_device

KINDS = [(kind, ref.OPTIONS.get(kind, {})) for kind in ref.KINDS]


def _inputs(seed: int, b=2, s=16, d=8, dt=12, v=40):
    """Two rows whose first 10 and 9 tokens are a prompt (ignored): 13 of 32 positions carry a label."""
    h, w, th, tw, y = ref.random_inputs(seed, b, s, d, dt, v)
    y[0, :10] = -100
    y[1, :9] = -100
    return h, w, th, tw, y


class CountingHead:
    """A teacher head that records how many rows it projected."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w, self.rows = w, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[:-1].numel()
        return x @ self.w.t()


@pytest.mark.parametrize("kind,extra", KINDS)
def test_skipped_prompt_chunks_give_the_reference_and_the_teacher_head_sees_half_the_rows(kind, extra):
    h, w, th, tw, y = _inputs(hash(kind) % 1000)
    ref_loss, ref_ce, ref_kd = ref.objective(kind, (h @ w.t()).flatten(0, 1), y.flatten(), 0.5,
                                             (th @ tw.t()).flatten(0, 1), 1.0, **extra)
    ref_gh, ref_gw = torch.autograd.grad(ref_loss, (h, w))

    head = CountingHead(tw)
    rows = loss_rows(y, "cpu")
    assert rows.labelled == 13
    out = kd_and_ce(h, ref.plain_head(w), y, LiveTeacher(th, head), build_kd_loss(kind, 1.0, **extra), 0.5, num_chunks=8,
                    rows_with_labels=rows)
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["ce"], ref_ce, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(out["kd"], ref_kd, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)
    assert torch.all(gh.flatten(0, 1)[(y == -100).flatten()] == 0)
    # 8 chunks of 4 rows; the 13 labelled rows fill 4 of them: 16 rows projected instead of 32
    assert head.rows == 16


@pytest.mark.parametrize("kind,extra", KINDS)
def test_the_checkpointed_driver_skips_the_same_chunks_and_gives_the_reference(kind, extra):
    """A head the fused driver cannot see through (LoRA, QAT, NF4: here a plain callable) takes the checkpointed
    driver, which skips whole chunks of unlabelled rows too, in forward and in its recomputation in backward."""
    h, w, th, tw, y = _inputs(hash(kind) % 1000 + 1)
    ref_loss, ref_ce, ref_kd = ref.objective(kind, (h @ w.t()).flatten(0, 1), y.flatten(), 0.5,
                                             (th @ tw.t()).flatten(0, 1), 1.0, **extra)
    ref_gh, ref_gw = torch.autograd.grad(ref_loss, (h, w))

    student_head, teacher_head = CountingHead(w), CountingHead(tw)
    out = kd_and_ce(h, student_head, y, LiveTeacher(th, teacher_head), build_kd_loss(kind, 1.0, **extra), 0.5,
                    num_chunks=8, rows_with_labels=loss_rows(y, "cpu"))
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    for got, want in ((out["loss"], ref_loss), (out["ce"], ref_ce), (out["kd"], ref_kd)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-10, atol=1e-12)
    assert torch.all(gh.flatten(0, 1)[(y == -100).flatten()] == 0)
    # 4 chunks of 4 rows cover the 13 labelled rows: both heads project them in forward and again in the
    # checkpointed backward's recomputation, 32 rows each instead of 64
    assert (student_head.rows, teacher_head.rows) == (32, 32)


def test_the_checkpointed_driver_without_any_label_keeps_its_graph_and_gives_zero():
    h, w, th, tw, y = _inputs(5)
    y[:] = -100
    out = kd_and_ce(h, CountingHead(w), y, LiveTeacher(th, CountingHead(tw)), build_kd_loss("forward_kl"), 0.5,
                    num_chunks=8, rows_with_labels=loss_rows(y, "cpu"))
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    assert float(out["loss"].detach()) == 0.0 and not gh.any() and not gw.any()


def test_a_cached_teacher_and_ce_alone_give_the_same_with_and_without_the_rows():
    h, w, th, tw, y = _inputs(7)
    logp, ids = ref.topk_cache((th @ tw.t()).flatten(0, 1), 5, 1.0)
    cached = CachedTeacher(logp.unflatten(0, y.shape), ids.unflatten(0, y.shape))
    for teacher, kd_loss, ratio in ((cached, build_kd_loss("forward_kl"), 0.5),
                                    (cached, build_kd_loss("reverse_kl"), 0.7), (None, None, 0.0)):
        want = kd_and_ce(h, ref.plain_head(w), y, teacher, kd_loss, ratio, num_chunks=8)
        want_g = torch.autograd.grad(want["loss"], (h, w))
        got = kd_and_ce(h, ref.plain_head(w), y, teacher, kd_loss, ratio, num_chunks=8, rows_with_labels=loss_rows(y, "cpu"))
        got_g = torch.autograd.grad(got["loss"], (h, w))
        for k in ("loss", "ce", "kd"):
            torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-10)
        torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)


def test_a_micro_batch_without_labels_projects_nothing_and_gives_zero():
    h, w, th, tw, y = _inputs(3)
    y[:] = -100
    head = CountingHead(tw)
    out = kd_and_ce(h, ref.plain_head(w), y, LiveTeacher(th, head), build_kd_loss("forward_kl"), 0.5, num_chunks=8,
                    rows_with_labels=loss_rows(y, "cpu"))
    gh, gw = torch.autograd.grad(out["loss"], (h, w))
    assert float(out["loss"].detach()) == 0.0 and head.rows == 0
    assert not gh.any() and not gw.any()


def test_to_device_gives_the_labelled_rows_only_when_some_position_has_no_label():
    y = torch.tensor([[-100, -100, 5, 6], [-100, 7, 8, 9]])
    batch = to_device({"tokens": torch.zeros(2, 4, dtype=torch.long), "labels": y}, torch.device("cpu"))
    rows = batch[LOSS_ROWS]
    assert rows.labelled == 5
    assert rows.order.tolist() == [2, 3, 5, 6, 7, 0, 1, 4]  # labelled first, in order, then the others
    assert to_device(batch, torch.device("cpu"))[LOSS_ROWS] is rows  # a moved batch keeps them
    full = to_device({"tokens": torch.zeros(2, 4, dtype=torch.long), "labels": y.clamp_min(0)}, torch.device("cpu"))
    assert LOSS_ROWS not in full  # text rows: every position is labelled, nothing to skip


def test_the_sft_loss_of_a_model_passes_the_rows(tiny_model_dir, monkeypatch):
    from llm_recipe.components.models import load_model
    from llm_recipe.components.training import lm_loss_sum

    model, _ = load_model(tiny_model_dir, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, 100, (2, 32))
    labels = tokens.clone()
    labels[:, :24] = -100  # a long prompt: 16 labelled positions of 64
    batch = {"tokens": tokens, "labels": labels}
    want = kd_and_ce(*_hidden_head(model, batch), labels, num_chunks=8)["loss"]

    orders = []
    real = fused_module._FusedLinearKDCE.apply

    def spy(*args):
        orders.append(args[-1])
        return real(*args)

    monkeypatch.setattr(fused_module._FusedLinearKDCE, "apply", spy)
    got = lm_loss_sum(model, to_device(batch, torch.device("cpu")), 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert orders[-1] is not None and orders[-1].shape[0] == 16  # 2 chunks of 8 rows instead of 8


def _hidden_head(model, batch):
    from llm_recipe.components.training import hidden_states

    return hidden_states(model, batch), model.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled forward-KL kernel in bf16")
def test_on_cuda_the_compiled_bf16_loss_skips_the_same_rows_and_gives_the_same_numbers():
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    h = torch.randn(2, 512, 64, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(1000, 64, device=dev, dtype=dt, requires_grad=True)
    th = torch.randn(2, 512, 96, device=dev, dtype=dt)
    tw = torch.randn(1000, 96, device=dev, dtype=dt)
    y = torch.randint(0, 1000, (2, 512))
    y[0, :400] = -100  # prompts: 300 of 1024 positions labelled, 5 chunks of 64 instead of 16
    y[1, :324] = -100
    head = CountingHead(tw)
    kd = build_kd_loss("forward_kl")
    want = kd_and_ce(h, ref.plain_head(w), y.to(dev), LiveTeacher(th, lambda x: x @ tw.t()), kd, 0.5, num_chunks=16)
    want_g = torch.autograd.grad(want["loss"], (h, w))
    got = kd_and_ce(h, ref.plain_head(w), y.to(dev), LiveTeacher(th, head), kd, 0.5, num_chunks=16,
                    rows_with_labels=loss_rows(y, dev))
    got_g = torch.autograd.grad(got["loss"], (h, w))
    assert head.rows == 5 * 64
    for k in ("loss", "ce", "kd"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(got_g[0], want_g[0], rtol=2e-2, atol=1e-4)  # per row: the same math
    # the head's gradient sums over chunks in bf16: fewer chunks round less, so against fp32 it is no worse
    h32, w32 = (t.detach().float().requires_grad_(True) for t in (h, w))
    exact = kd_and_ce(h32, ref.plain_head(w32), y.to(dev), LiveTeacher(th.float(), lambda x: x @ tw.float().t()), kd, 0.5,
                    num_chunks=16)
    ref_gw = torch.autograd.grad(exact["loss"], w32)[0]
    err_got, err_want = ((g[1].float() - ref_gw).norm() / ref_gw.norm() for g in (got_g, want_g))
    print(f"relative error of the head's gradient: {float(err_got):.2e} with rows, {float(err_want):.2e} without")
    assert err_got <= 1.05 * err_want and err_got < 0.02


def test_rows_of_another_batch_shape_are_refused():
    h, w, _, _, y = _inputs(5)
    other = torch.full((3, 16), -100)
    other[:, -2:] = 1
    with pytest.raises(ValueError, match="rows_with_labels is for 48 positions, the hidden states have 32"):
        kd_and_ce(h, ref.plain_head(w), y, num_chunks=8, rows_with_labels=loss_rows(other, "cpu"))
