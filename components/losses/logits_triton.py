"""The Triton kernels of logits_kernel.py: imported only where triton is (CUDA builds of torch), never at import
time of the losses."""

import triton
import triton.language as tl

__all__ = ["grad_kernel", "stats_kernel"]


@triton.jit
def _online(m, d, x):
    # one block folded into a running (max, sum of exp(x - max)); -inf everywhere leaves (-inf, 0)
    m_new = tl.maximum(m, tl.max(x, axis=0))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, d * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), axis=0)


@triton.jit
def stats_kernel(s_ptr, t_ptr, stats_ptr, stride_s, stride_t, vocab, inv_temp, n_slices,
                 HAS_T: tl.constexpr, SCALED: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    # stats[row, slice] = (max, sum exp) of s, of t / T and (SCALED) of s / T over the slice's columns
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    m_s = float("-inf")
    d_s = 0.0
    m_q = float("-inf")
    d_q = 0.0
    m_t = float("-inf")
    d_t = 0.0
    for start in range(part * SLICE, part * SLICE + SLICE, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(s_ptr + row * stride_s + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m_s, d_s = _online(m_s, d_s, s)
        if SCALED:
            m_q, d_q = _online(m_q, d_q, s * inv_temp)
        if HAS_T:
            t = tl.load(t_ptr + row * stride_t + cols, mask=inside, other=float("-inf")).to(tl.float32)
            m_t, d_t = _online(m_t, d_t, t * inv_temp)
    out = stats_ptr + (row * n_slices + part) * 6
    tl.store(out + 0, m_s)
    tl.store(out + 1, d_s)
    tl.store(out + 2, m_q)
    tl.store(out + 3, d_q)
    tl.store(out + 4, m_t)
    tl.store(out + 5, d_t)


@triton.jit
def _lse(stats_row, which, n_slices, SLICES_P2: tl.constexpr):
    # log-sum-exp of a whole row from its slices' (max, sum exp)
    k = tl.arange(0, SLICES_P2)
    m = tl.load(stats_row + k * 6 + which, mask=k < n_slices, other=float("-inf"))
    d = tl.load(stats_row + k * 6 + which + 1, mask=k < n_slices, other=0.0)
    top = tl.max(m, axis=0)
    ref = tl.where(top == float("-inf"), 0.0, top)
    return ref + tl.log(tl.sum(d * tl.exp(m - ref), axis=0))


@triton.jit
def grad_kernel(s_ptr, t_ptr, y_ptr, stats_ptr, grad_ptr, sums_ptr, stride_s, stride_t, stride_g, vocab,
                inv_temp, ce_w, kd_w_t, ignore_index, n_slices,
                HAS_T: tl.constexpr, SCALED: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr,
                SLICES_P2: tl.constexpr):
    # grad = ce_w (softmax(s) - onehot(y)) + kd_w T (softmax(s/T) - softmax(t/T)); sums[row, slice] = (CE, KL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    stats_row = stats_ptr + row * n_slices * 6
    lse_s = _lse(stats_row, 0, n_slices, SLICES_P2)
    lse_q = lse_s
    if SCALED:
        lse_q = _lse(stats_row, 2, n_slices, SLICES_P2)
    lse_t = 0.0
    if HAS_T:
        lse_t = _lse(stats_row, 4, n_slices, SLICES_P2)
    y = tl.load(y_ptr + row)
    valid = y != ignore_index
    ce = 0.0
    kl = 0.0
    for start in range(part * SLICE, part * SLICE + SLICE, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < vocab
        s = tl.load(s_ptr + row * stride_s + cols, mask=inside, other=0.0).to(tl.float32)
        log_ps = s - lse_s
        hit = cols == y
        ce += tl.sum(tl.where(hit & inside, -log_ps, 0.0), axis=0)
        g = ce_w * (tl.exp(log_ps) - tl.where(hit, 1.0, 0.0))
        if HAS_T:
            log_qs = log_ps
            if SCALED:
                log_qs = s * inv_temp - lse_q
            t = tl.load(t_ptr + row * stride_t + cols, mask=inside, other=float("-inf")).to(tl.float32)
            log_pt = t * inv_temp - lse_t
            pt = tl.exp(log_pt)
            # 0 * log 0 := 0: teacher entries at -inf (and the masked tail) contribute nothing
            kl += tl.sum(tl.where(pt > 0, pt * (log_pt - tl.where(pt > 0, log_qs, 0.0)), 0.0), axis=0)
            g += kd_w_t * (tl.exp(log_qs) - pt)
        g = tl.where(valid, g, 0.0)
        tl.store(grad_ptr + row * stride_g + cols, g.to(grad_ptr.dtype.element_ty), mask=inside)
    out = sums_ptr + (row * n_slices + part) * 2
    tl.store(out + 0, tl.where(valid, ce, 0.0))
    tl.store(out + 1, tl.where(valid, kl, 0.0))
