"""Forward KL + CE over one chunk of logits as two Triton passes (CUDA): the fused driver's kernel for live logits.

``forward_kl_ce_chunk`` (fused.py) compiled by Inductor became five kernels per chunk on the H200: four looped
row reductions for the two log-sum-exps (a max pass and a sum pass each) and a final pass: 0.34-0.39 ms for a
chunk of 256 x 128,256 bf16 logits, where two reads and a write of each tensor take ~0.07 ms; ours 0.18-0.20 ms. Here
pass 1 reads the student's and the teacher's logits once (online max and sum of exponentials per vocabulary
slice), pass 2 reads them again and writes the gradient, with the CE and KL sums per slice; both passes split each
row into slices so a chunk fills the GPU. Same arithmetic as ``forward_kl_ce_chunk`` in fp32 (tests/test_logits_kernel.py
checks both against fp64). Liger-Kernel's fused losses do not cover CE + forward KL with temperature in one pass
(fused.py's docstring); torch has no such op.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

__all__ = ["forward_kl_ce_logits", "logits_kernel_available"]

SLICE = 8192  # vocabulary columns per program: 16 programs per row of a 128,256-word vocabulary
BLOCK = 1024  # columns per loop iteration of a program
WARPS = 4


@functools.cache
def _triton():
    """(triton, stats_kernel, grad_kernel), or None when triton does not import (CPU-only torch)."""
    try:
        import triton

        from .logits_triton import grad_kernel, stats_kernel
    except ImportError:
        return None
    return triton, stats_kernel, grad_kernel


def logits_kernel_available(s: Tensor) -> bool:
    """Whether the fused driver runs ``forward_kl_ce_logits`` for logits like ``s``: CUDA, triton importable, a 16-
    or 32-bit float."""
    return s.is_cuda and s.dtype in (torch.bfloat16, torch.float16, torch.float32) and _triton() is not None


def forward_kl_ce_logits(s: Tensor, t: Tensor | None, y: Tensor, ce_w: float, kd_w: float, temperature: float,
                         ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """``forward_kl_ce_chunk``'s (CE sum, forward-KL sum x T^2, d loss / d s) for ``s [n, v]``, ``t [n, v]`` or
    None, ``y [n]``, in two Triton passes; sums in fp32, the gradient in ``s``'s dtype."""
    triton, stats_kernel, grad_kernel = _triton()
    rows, vocab = s.shape
    if (t is not None and t.shape != s.shape) or y.shape != (rows,):
        raise ValueError(f"logits {tuple(s.shape)}, teacher {None if t is None else tuple(t.shape)} and labels "
                         f"{tuple(y.shape)} do not fit: expected s and t [n, v], y [n]")
    if s.stride(1) != 1:
        s = s.contiguous()
    if t is not None and t.stride(1) != 1:
        t = t.contiguous()
    y = y.contiguous()  # read as y[row]
    n_slices = triton.cdiv(vocab, SLICE)
    scaled = t is not None and temperature != 1.0
    stats = torch.empty(rows, n_slices, 6, device=s.device, dtype=torch.float32)
    sums = torch.empty(rows, n_slices, 2, device=s.device, dtype=torch.float32)
    grad = torch.empty_like(s, memory_format=torch.contiguous_format)
    t_arg = s if t is None else t
    inv_temp = 1.0 / temperature
    grid = (rows, n_slices)
    slices_p2 = triton.next_power_of_2(n_slices)
    with torch.cuda.device(s.device) if s.is_cuda else contextlib.nullcontext():  # Triton launches on the current one
        stats_kernel[grid](s, t_arg, stats, s.stride(0), t_arg.stride(0), vocab, inv_temp, n_slices,
                           HAS_T=t is not None, SCALED=scaled, SLICE=SLICE, BLOCK=BLOCK, num_warps=WARPS)
        grad_kernel[grid](s, t_arg, y, stats, grad, sums, s.stride(0), t_arg.stride(0), grad.stride(0), vocab,
                          inv_temp, ce_w, kd_w * temperature, ignore_index, n_slices,
                          HAS_T=t is not None, SCALED=scaled, SLICE=SLICE, BLOCK=BLOCK,
                          SLICES_P2=slices_p2, num_warps=WARPS)
    totals = sums.sum(dim=(0, 1))
    return totals[0], totals[1] * temperature**2, grad
