"""Build Llama-family decoders (Llama 3.x, SmolLM2, Mistral, Qwen2/2.5) from `ModelArgs` with torchtune modules.

One builder serves every family and optionally swaps chosen linears for torchtune's LoRA/DoRA layers
(NF4-quantized base for QLoRA). Module names follow torchtune; `convert.py` maps them to HF names.

torchtune is imported when a model is built, not when this module is imported (tune.py says why), so our
subclasses of its layers are defined on first use, in `tune_layers()`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RecipeError
from ..schema import Choice, ListOf, Range
from ..settings import check_fields, setting
from .args import ModelArgs
from .rope import rotary_embedding
from .tune import import_torchtune

if TYPE_CHECKING:
    from torchtune.modules import TransformerDecoder

# LoRA targets use PEFT/HF module names, so adapter configs read the same in both tools.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
# lora.quantize_base values -> the stored form (`true` is the older spelling of nf4, kept working)
QUANTIZE_BASE = {False: False, True: "nf4", "nf4": "nf4", "fp8": "fp8"}


@dataclass(frozen=True, kw_only=True)
class LoRASettings:
    """The `lora:` section: which linears get low-rank adapters, and how (null: every weight trains)."""

    rank: int = setting(8, Range(int, ge=1), "adapter rank r")
    alpha: float = setting(16.0, Range(float, gt=0), "scaling = alpha / rank")
    dropout: float = setting(0.0, Range(float, ge=0, lt=1), "dropout on the adapter input")
    targets: tuple[str, ...] = setting(("q_proj", "v_proj"), ListOf(Choice(*LORA_TARGETS), min_len=1, unique=True),
                                       "the linears that get adapters (PEFT module names)")
    use_dora: bool = setting(False, bool, "DoRA: learn a per-row magnitude too")
    quantize_base: bool | str = setting(False, Choice(False, True, "nf4", "fp8"),
                                        "frozen base: false (run dtype), nf4 (QLoRA; true = nf4) or fp8 (e4m3 rows)")

    def __post_init__(self) -> None:
        check_fields(self, "lora.")  # built directly by library code too, not only from a checked config
        object.__setattr__(self, "quantize_base", QUANTIZE_BASE[self.quantize_base])
        if self.quantize_base == "fp8" and self.use_dora:
            raise RecipeError("lora.quantize_base=fp8 does not support DoRA; set lora.use_dora: false or use nf4")


@functools.cache
def tune_layers() -> SimpleNamespace:
    """Our subclasses of torchtune layers, `Decoder`, `RMSNorm`, `Attention` and `DoRA`, defined on the first call
    (their base classes come from torchtune, imported here through `import_torchtune()`); the same classes on every
    call."""
    import_torchtune()
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from torchtune.modules import KVCache, MultiHeadAttention, TransformerDecoder
    from torchtune.modules import RMSNorm as TuneRMSNorm
    from torchtune.modules.peft import DoRALinear

    class Decoder(TransformerDecoder):
        """torchtune's decoder plus `skip_output`: return normed final hidden states so losses can chunk the
        output projection themselves (full logits of two models are never alive at once)."""

        skip_output: bool = False

        def unembed(self, h: torch.Tensor) -> torch.Tensor:
            if self.skip_output:
                return self.norm(h)
            return super().unembed(h)

    class RMSNorm(TuneRMSNorm):
        """torchtune's RMSNorm (same `scale` parameter) without its fp32 upcast of the input when input and weight
        share a dtype: torch's fused rms_norm kernel accumulates in fp32 itself, while torchtune's fp32 input with a
        bf16 weight misses that kernel ("Mismatch dtype ... Cannot dispatch to fused implementation")."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != self.scale.dtype:
                return super().forward(x)
            return F.rms_norm(x, self.normalized_shape, self.scale, self.eps)

    class Attention(MultiHeadAttention):
        """torchtune's attention, except for packed rows (a flex-attention BlockMask) inside a compiled layer: there
        flex attention is called in the layer's own graph with grouped-query heads as they are (`enable_gqa`).
        torchtune copies k and v out to every query head first (4x their memory, saved for backward, for Llama
        3.2 1B) and calls a separately compiled flex attention behind a graph break. With torchtune's KV cache,
        `_cached_attention` (no copy of the cache either, no sync). Everything else (dense masks, eager training
        runs, the ExecuTorch export's static cache) is torchtune's forward."""

        def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, mask=None,
                    input_pos: torch.Tensor | None = None) -> torch.Tensor:
            if (isinstance(self.kv_cache, KVCache) and self.cache_enabled and y is not None  # not an export's cache
                    and not isinstance(mask, BlockMask) and self.q_norm is None and self.k_norm is None):
                return self._cached_attention(x, y, mask, input_pos)
            if (not isinstance(mask, BlockMask) or not torch.compiler.is_compiling() or y is None
                    or self.q_norm is not None or self.k_norm is not None
                    or (self.kv_cache is not None and self.cache_enabled)):
                return super().forward(x, y, mask=mask, input_pos=input_pos)
            b, s, _ = x.shape
            q, k, v = self._projected(x, y, input_pos)
            # BACKEND "TRITON": flex's main kernel, which "AUTO" takes too for rows of 128 tokens or more. For
            # shorter rows without grad (a teacher's forward) "AUTO" takes Inductor's decoding kernel, which
            # found no valid config in fp32 or bf16 on an H200 (NoValidChoicesError at compile, torch 2.11).
            out = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                                 enable_gqa=self.num_heads != self.num_kv_heads,
                                 kernel_options={"BACKEND": "TRITON"})
            return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))

        def _projected(self, x: torch.Tensor, y: torch.Tensor,
                       input_pos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """q [b, s, heads, d] from x; k and v [b, s, kv heads, d] from y; rope on q and k."""
            b, s, _ = x.shape
            q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
            k = self.k_proj(y).view(b, s, self.num_kv_heads, self.head_dim)
            v = self.v_proj(y).view(b, s, self.num_kv_heads, self.head_dim)
            if self.pos_embeddings is not None:
                q = self.pos_embeddings(q, input_pos=input_pos)
                k = self.pos_embeddings(k, input_pos=input_pos)
            return q, k, v

        def _cached_attention(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
                              input_pos: torch.Tensor | None) -> torch.Tensor:
            """torchtune's KV-cache forward (prefill and decode) without copying the whole cache out to every query
            head at every step: the g query heads of a KV head attend as g x s query rows of that head (query head
            i uses KV head i // g, as torchtune expands), the mask repeated for each. The same scores; on one H200
            (Llama-3.2-1B student, a decode batch of 64) the copies took 0.48 ms of every decode step. The cache is
            written as torchtune's `KVCache.update` writes it, less its assert on a device value (a sync per layer
            and token in an eager decode; a position past the cache fails in the index instead)."""
            b, s, _ = x.shape
            n_kv, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
            q, k, v = self._projected(x, y, input_pos)
            cache = self.kv_cache
            if b > cache.k_cache.shape[0]:
                raise ValueError(f"a KV cache for {cache.k_cache.shape[0]} rows got {b}")
            at = cache.cache_pos[:s]
            cache.k_cache[:, :, at] = k.transpose(1, 2)
            cache.v_cache[:, :, at] = v.transpose(1, 2)
            cache.cache_pos.add_(s)
            k, v = cache.k_cache, cache.v_cache  # [b, n_kv, cache length, d]
            q = q.view(b, s, n_kv, g, d).permute(0, 2, 3, 1, 4).reshape(b, n_kv, g * s, d)
            if mask is not None:  # [b, s, L] -> [b, 1, g * s, L]: row j * s + t is query t's
                mask = mask[:, None].expand(b, g, s, mask.shape[-1]).reshape(b, 1, g * s, mask.shape[-1])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 dropout_p=self.attn_dropout if self.training else 0.0)
            out = out.view(b, n_kv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, self.num_heads * d)
            return self.output_proj(out)

    class DoRA(DoRALinear):
        """torchtune's DoRA with the bias added after the magnitude rescaling, as in the DoRA paper and PEFT
        (torchtune rescales the bias too, which its own merge and PEFT do not reproduce)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = self.weight.to(x.dtype)  # dequantizes an NF4 base
            base = F.linear(x, weight)
            if not self.disabled:
                lora = self.lora_b(self.lora_a(self.dropout(x)))
                # The adapter's dense weight through the modules themselves, so FSDP hooks still fire.
                eye = torch.eye(self.lora_a.weight.shape[1], device=x.device, dtype=x.dtype)
                lora_weight = self.lora_b(self.lora_a(eye)).T
                norm = self._get_weight_norm(weight, lora_weight.detach()).detach()
                base = (self.magnitude / norm).view(1, -1) * (base + self.scaling * lora)
            return base if self.bias is None else base + self.bias

    return SimpleNamespace(Decoder=Decoder, RMSNorm=RMSNorm, Attention=Attention, DoRA=DoRA)


def _linear(name: str, d_in: int, d_out: int, bias: bool, lora: LoRASettings | None) -> nn.Module:
    if lora is None or name not in lora.targets:
        return nn.Linear(d_in, d_out, bias=bias)
    import_torchtune()
    from torchtune.modules.peft import LoRALinear

    cls = tune_layers().DoRA if lora.use_dora else LoRALinear
    nf4 = lora.quantize_base == "nf4"
    extra = _nf4_block_sizes(d_in * d_out) if nf4 else {}
    layer = cls(d_in, d_out, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, use_bias=bias,
                quantize_base=nf4, **extra)
    if lora.quantize_base == "fp8" and name != "lm_head":  # the head stays in the run dtype, as the fp8 teacher's
        # built in the run dtype so the checkpoint loads as usual; Runtime.prepare_model stores it in fp8 on the GPU
        # (components/quantization/fp8_base.py)
        layer.fp8_base_pending = True
    return layer


def _nf4_block_sizes(numel: int) -> dict:
    """NF4 block sizes that tile this weight: blocks of 64 values, scalers grouped in the largest of
    256/128/.../1 blocks that divides evenly (torchao's default 256 rejects e.g. SmolLM2's 576x576)."""
    if numel % 64:
        raise RecipeError(f"lora.quantize_base: a weight of {numel} elements is not a multiple of 64 (NF4 blocks)")
    blocks = numel // 64
    scaler = next(s for s in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % s == 0)
    return {"block_size": 64, "scaler_block_size": scaler}


def build_model(args: ModelArgs, lora: LoRASettings | None = None,
                max_seq_len: int | None = None) -> TransformerDecoder:
    """Instantiate the decoder, a `tune_layers().Decoder` (parameters in the current default dtype and device)."""
    import_torchtune()
    from torchtune.modules import FeedForward, TiedLinear, TransformerSelfAttentionLayer

    ours = tune_layers()
    max_seq_len = max_seq_len or min(args.max_position_embeddings, 8192)
    d, hd = args.hidden_size, args.head_dim
    rope = rotary_embedding(hd, max_seq_len=max_seq_len, base=args.rope_theta, scaling=args.rope_scaling)
    layers = []
    for _ in range(args.num_layers):
        attn = ours.Attention(
            embed_dim=d,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=hd,
            q_proj=_linear("q_proj", d, args.num_heads * hd, args.qkv_bias, lora),
            k_proj=_linear("k_proj", d, args.num_kv_heads * hd, args.qkv_bias, lora),
            v_proj=_linear("v_proj", d, args.num_kv_heads * hd, args.qkv_bias, lora),
            output_proj=_linear("o_proj", args.num_heads * hd, d, args.o_bias, lora),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=_linear("gate_proj", d, args.intermediate_size, False, lora),
            down_proj=_linear("down_proj", args.intermediate_size, d, False, lora),
            up_proj=_linear("up_proj", d, args.intermediate_size, False, lora),
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=mlp,
                sa_norm=ours.RMSNorm(d, eps=args.rms_norm_eps),
                mlp_norm=ours.RMSNorm(d, eps=args.rms_norm_eps),
            )
        )
    embed = nn.Embedding(args.vocab_size, d)
    if args.tie_word_embeddings:
        if lora is not None and "lm_head" in lora.targets:
            raise RecipeError("lora.targets: lm_head cannot take LoRA when embeddings are tied")
        output = TiedLinear(embed)
    else:
        output = _linear("lm_head", d, args.vocab_size, False, lora)
    return ours.Decoder(
        tok_embeddings=embed,
        layers=nn.ModuleList(layers),
        max_seq_len=max_seq_len,
        num_heads=args.num_heads,
        head_dim=hd,
        norm=ours.RMSNorm(d, eps=args.rms_norm_eps),
        output=output,
    )


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards any part of `model` (its parameters are DTensor shards, not whole tensors)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def output_weight(model: TransformerDecoder) -> torch.Tensor:
    """The output projection's weight (the embedding when tied)."""
    import_torchtune()
    from torchtune.modules import TiedLinear

    out = model.output
    return out.tied_module.weight if isinstance(out, TiedLinear) else out.weight
