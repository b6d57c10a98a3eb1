"""Rotary position embeddings in Hugging Face's rotate-half layout, with Llama 3.x and linear scaling.

torchtune's Llama RoPE rotates interleaved pairs, which would force a Q/K row permutation at every HF boundary
(checkpoints, PEFT adapters, quantized tensors, exports). Its Qwen2 RoPE already rotates halves like HF; we
reuse it and only change how the frequencies are computed.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from .tune import import_torchtune


def rotary_embedding(dim: int, max_seq_len: int, base: float, scaling: dict | None = None) -> nn.Module:
    """Rotate-half RoPE; `scaling` is a HF `rope_scaling` dict (rope_type llama3 or linear) or None."""
    return _rotary_embedding_class()(dim, max_seq_len=max_seq_len, base=base, scaling=scaling)


@functools.cache
def _rotary_embedding_class() -> type[nn.Module]:
    # Defined on first use: the base class is torchtune's, imported through import_torchtune() (tune.py says why).
    import_torchtune()
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings

    class RotaryEmbedding(Qwen2RotaryPositionalEmbeddings):
        """torchtune's Qwen2 (rotate-half) RoPE with our frequencies: Llama 3.x or linear scaling."""

        def __init__(self, dim: int, max_seq_len: int, base: float, scaling: dict | None = None) -> None:
            self.scaling = scaling
            super().__init__(dim=dim, max_seq_len=max_seq_len, base=base)

        def rope_init(self) -> None:
            theta = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
            if self.scaling is not None:
                theta = _scale_frequencies(theta, self.scaling)
            self.register_buffer("theta", theta, persistent=False)
            self.build_rope_cache(self.max_seq_len)

    return RotaryEmbedding


def _scale_frequencies(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(s["factor"])
    if s["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3.1 frequency-dependent scaling (same formula as the reference implementation).
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
