"""The Triton forward-KL + CE kernel (components/losses/logits_kernel.py) gives the closed-form chunk's numbers:
CE and KL sums and the gradient w.r.t. the student's logits, against fp64, for temperatures 1 and 2, CE alone,
ignored labels, a teacher with -inf entries and a vocabulary that ends inside a slice. On CUDA the compiled kernel
runs, also at the real vocabulary, and the fused loss takes it; on the CPU the same tests run in Triton's
interpreter, in a process of their own (it must be chosen before triton is imported)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from llm_recipe.components.losses import fused as fused_module
from llm_recipe.components.losses import logits_kernel as lk
from llm_recipe.components.losses.divergences import IGNORE_INDEX

pytest.importorskip("triton", reason="the kernel needs triton (the dev extra; CUDA builds of torch bring it)")
CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
kernel_runs = pytest.mark.skipif(not (CUDA or INTERPRETER), reason="CUDA, or the interpreter's process (below)")


@pytest.mark.skipif(CUDA or INTERPRETER, reason="CUDA runs the kernel tests directly")
def test_the_kernel_tests_pass_in_triton_s_interpreter():
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "not interpreter and not fused_loss"], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    passed = re.search(r"(\d+) passed", run.stdout)
    assert run.returncode == 0 and passed and int(passed.group(1)) >= 8, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.fixture
def kernel(monkeypatch):
    """The kernel as this machine runs it; in the interpreter with small slices, so that small vocabularies still
    span several slices and loop iterations."""
    if not CUDA:
        monkeypatch.setattr(lk, "SLICE", 64)
        monkeypatch.setattr(lk, "BLOCK", 16)
    return lk.forward_kl_ce_logits


def _case(seed: int, rows: int, vocab: int, dtype: torch.dtype, device: str, teacher_inf: bool = False):
    g = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    t = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    if teacher_inf:
        t[:, 1::7] = float("-inf")  # a teacher restricted to part of the vocabulary
    y = torch.randint(0, vocab, (rows,), generator=g)
    y[1::3] = IGNORE_INDEX
    return s.to(device), t.to(device), y.to(device)


def _reference(s, t, y, ce_w, kd_w, temperature):
    return fused_module.forward_kl_ce_chunk(s.double().cpu(), None if t is None else t.double().cpu(), y.cpu(),
                                            ce_w, kd_w, temperature, IGNORE_INDEX)


@kernel_runs
@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("teacher", ["logits", "logits with -inf", None])
def test_the_kernel_gives_the_closed_form_in_fp64(kernel, temperature, teacher):
    with_teacher, teacher_inf = teacher is not None, teacher == "logits with -inf"
    device = "cuda" if CUDA else "cpu"
    vocab = 40_000 if CUDA else 203  # ends inside a slice (and inside a block)
    s, t, y = _case(int(temperature) * 10 + with_teacher + 2 * teacher_inf, 7, vocab, torch.float32, device,
                    teacher_inf)
    t = t if with_teacher else None
    ce, kd, grad = kernel(s, t, y, 0.3, 0.7, temperature, IGNORE_INDEX)
    ce_ref, kd_ref, grad_ref = _reference(s, t, y, 0.3, 0.7, temperature)
    assert grad.dtype == s.dtype and grad.shape == s.shape
    torch.testing.assert_close(ce.double().cpu(), ce_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kd.double().cpu(), kd_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double().cpu(), grad_ref, rtol=1e-4, atol=1e-7)
    assert grad[1::3].abs().max() == 0  # ignored rows: no gradient
    if with_teacher:
        assert kd_ref > 0


@kernel_runs
def test_bf16_logits_give_the_reference_to_a_bf16_step(kernel):
    device = "cuda" if CUDA else "cpu"
    vocab = 128_256 if CUDA else 300
    s, t, y = _case(3, 9, vocab, torch.bfloat16, device)
    ce, kd, grad = kernel(s, t, y, 0.5, 0.5, 1.0, IGNORE_INDEX)
    ce_ref, kd_ref, grad_ref = _reference(s, t, y, 0.5, 0.5, 1.0)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(ce.double().cpu(), ce_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(kd.double().cpu(), kd_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad.double().cpu(), grad_ref.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-6)


@kernel_runs
def test_labels_of_a_strided_view_are_read_at_their_stride_and_a_teacher_of_another_width_is_refused(kernel):
    device = "cuda" if CUDA else "cpu"
    s, t, _ = _case(11, 6, 203, torch.float32, device)
    pairs = torch.randint(0, 203, (6, 2), generator=torch.Generator().manual_seed(2)).to(device)
    y = pairs[:, 0]  # every other element of the storage
    assert y.stride(0) == 2
    ce, kd, grad = kernel(s, t, y, 0.4, 0.6, 1.0, IGNORE_INDEX)
    ce_ref, kd_ref, grad_ref = _reference(s, t, y, 0.4, 0.6, 1.0)
    torch.testing.assert_close(ce.double().cpu(), ce_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double().cpu(), grad_ref, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="do not fit"):
        kernel(s, t[:, :150], y, 0.4, 0.6, 1.0, IGNORE_INDEX)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_the_fused_loss_runs_the_kernel_on_cuda_and_gives_the_fp64_loss_and_gradients(monkeypatch):
    from llm_recipe.components.losses import LiveTeacher, build_kd_loss, kd_and_ce

    calls = []
    real = lk.forward_kl_ce_logits
    monkeypatch.setattr(fused_module, "forward_kl_ce_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 64, 256, generator=g, dtype=torch.float64)
    w = torch.randn(32_000, 256, generator=g, dtype=torch.float64) / 16
    th = torch.randn(2, 64, 128, generator=g, dtype=torch.float64)
    tw = torch.randn(32_000, 128, generator=g, dtype=torch.float64) / 11
    y = torch.randint(0, 32_000, (2, 64), generator=g)
    y[:, :20] = IGNORE_INDEX
    kd = build_kd_loss("forward_kl", temperature=2.0)

    def run(dtype, device):
        head = torch.nn.Linear(256, 32_000, bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            head.weight.copy_(w)
        hidden = h.to(device, dtype).requires_grad_(True)
        t_w = tw.to(device, dtype)
        out = kd_and_ce(hidden, head, y.to(device), LiveTeacher(th.to(device, dtype), lambda x: x @ t_w.t()), kd,
                        kd_ratio=0.5, num_chunks=4)
        out["loss"].backward()
        return out["loss"].double().cpu(), hidden.grad.double().cpu(), head.weight.grad.double().cpu()

    loss, grad_h, grad_w = run(torch.float32, "cuda")
    assert calls, "the fused loss did not take the Triton kernel on CUDA"
    loss_ref, grad_h_ref, grad_w_ref = run(torch.float64, "cpu")
    torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad_h, grad_h_ref, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(grad_w, grad_w_ref, rtol=1e-3, atol=1e-5)
