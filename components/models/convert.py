"""State-dict key mapping between torchtune module names and Hugging Face names (renaming only: our RoPE uses
HF's rotate-half layout, so no Q/K permutation is needed)."""

from __future__ import annotations

import re

import torch

_LAYER_MAP = {
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.output_proj": "self_attn.o_proj",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w2": "mlp.down_proj",
    "mlp.w3": "mlp.up_proj",
    "sa_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
            "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def tune_to_hf_key(key: str) -> str:
    if key in _TOP_MAP:
        return _TOP_MAP[key]
    m = _LAYER_RE.match(key)
    if m:
        idx, rest = m.groups()
        for tune, hf in _LAYER_MAP.items():
            if rest == tune or rest.startswith(tune + "."):
                return f"model.layers.{idx}.{hf}{rest[len(tune):]}"
    raise KeyError(f"no Hugging Face name for parameter {key!r}")


def hf_to_tune_key(key: str) -> str:
    for tune, hf in _TOP_MAP.items():
        if key == hf:
            return tune
    m = _HF_LAYER_RE.match(key)
    if m:
        idx, rest = m.groups()
        for tune, hf in _LAYER_MAP.items():
            if rest == hf or rest.startswith(hf + "."):
                return f"layers.{idx}.{tune}{rest[len(hf):]}"
    raise KeyError(f"unexpected tensor {key!r} in a Llama-family checkpoint")


def tune_to_hf_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {tune_to_hf_key(k): v for k, v in sd.items()}


def hf_to_tune_names(sd: dict[str, torch.Tensor], tied: bool = False) -> dict[str, torch.Tensor]:
    """Rename HF keys; drops `lm_head.weight` for tied models and rotary buffers some checkpoints carry."""
    out = {}
    for k, v in sd.items():
        if k.endswith("rotary_emb.inv_freq") or (tied and k == "lm_head.weight"):
            continue
        out[hf_to_tune_key(k)] = v
    return out
