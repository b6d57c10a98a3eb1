"""Model hyper-parameters read from (and written back to) a Hugging Face `config.json`."""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import RecipeError, read_utf8

# model_type -> family. All are Llama-style decoders; they differ in biases and RoPE details.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArgs:
    """The subset of a HF config that decides the module graph; `hf_config` keeps the rest for round trips."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    rope_scaling: dict | None = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise RecipeError(
                f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if cfg.get("mlp_bias"):
            raise RecipeError(f"{source}: mlp_bias=true is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise RecipeError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        try:
            heads = int(cfg["num_attention_heads"])
            # transformers >= 5 writes `rope_parameters` (theta + scaling); hub configs use rope_theta/rope_scaling.
            rope = cfg.get("rope_parameters") or {}
            hidden = int(cfg["hidden_size"])
            attention_bias = bool(cfg.get("attention_bias", False))
            return cls(
                family=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 has biases on q/k/v only; Llama's attention_bias covers q/k/v and o.
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type == "qwen2" else attention_bias,
                rope_scaling=_rope_scaling(cfg, source),
                hf_config=copy.deepcopy(cfg),
            )
        except KeyError as e:
            raise RecipeError(f"{source}: missing key {e.args[0]!r}") from None

    def to_hf_config(self, dtype: str | None = None) -> dict[str, Any]:
        """The HF config for this model (layer count and vocab reflect pruning/trimming)."""
        cfg = copy.deepcopy(self.hf_config)
        cfg.update(
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if "rope_parameters" in cfg:
            cfg["rope_parameters"]["rope_theta"] = self.rope_theta
        else:
            cfg["rope_theta"] = self.rope_theta
        cfg.setdefault("architectures", [_ARCH[self.family]])
        cfg.pop("quantization_config", None)
        if dtype is not None:
            cfg["torch_dtype"] = dtype
            cfg.pop("dtype", None)
        return cfg

    def with_layers(self, keep: Sequence[int]) -> ModelArgs:
        """The args of a student made of the layers `keep` of this model: the layer count, and the HF config's
        per-layer lists (`layer_types`, which transformers checks against the layer count) cut to those layers."""
        cfg = copy.deepcopy(self.hf_config)
        for key in _PER_LAYER_KEYS:
            if isinstance(cfg.get(key), list) and len(cfg[key]) == self.num_layers:
                cfg[key] = [cfg[key][i] for i in keep]
        return replace(self, num_layers=len(keep), hf_config=cfg)


_PER_LAYER_KEYS = ("layer_types",)  # HF config entries with one value per decoder layer
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _rope_scaling(cfg: dict, source: str) -> dict | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise RecipeError(f"{source}: rope_scaling type {kind!r} is not supported (llama3, linear)")
    return dict(rs, rope_type=kind)


def read_model_args(ckpt_dir: str | Path) -> ModelArgs:
    """Read `<ckpt_dir>/config.json`; a clear error when the folder is not a HF model folder."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise RecipeError(f"{ckpt_dir}: no config.json (expected a Hugging Face model folder)")
    try:
        cfg = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    return ModelArgs.from_hf_config(cfg, source=str(path))


def local_model_args(folder: str | Path | None) -> ModelArgs | None:
    """`read_model_args` of a model folder on this machine, for the checks a config runs at load (`recipe validate`
    too); None for a folder not here or a config.json it cannot read: the model loader says what is wrong."""
    if folder is None or not (Path(folder).expanduser() / "config.json").is_file():
        return None
    try:
        return read_model_args(Path(folder).expanduser())
    except RecipeError:
        return None


def check_context(max_seq_len: int, folder: str | Path | None, where: str) -> None:
    """RecipeError when `max_seq_len` (set at `where`) is longer than the context of the model in `folder`
    (config.json's max_position_embeddings; a folder not here is checked by the run). Unchecked, a typo of a few
    zeros built a rotary table of gigabytes and ended out of memory, or trained past the model's context silently."""
    args = local_model_args(folder)
    context = args.hf_config.get("max_position_embeddings") if args is not None else None
    if isinstance(context, int) and max_seq_len > context:
        raise RecipeError(f"{where}: key 'dataset.max_seq_len' is {max_seq_len}, longer than the model's context in "
                          f"{folder} ({context} tokens: config.json's max_position_embeddings)")


def expected_shapes(args: ModelArgs, hf_name: str) -> list[tuple[str, int]] | None:
    """What config.json says the shape of the HF tensor `hf_name` is, one `(config key(s), size)` per dimension,
    or None for a tensor it says nothing about."""
    hidden, heads = ("hidden_size", args.hidden_size), ("num_attention_heads x head_dim", args.num_heads * args.head_dim)
    kv, inter = ("num_key_value_heads x head_dim", args.num_kv_heads * args.head_dim), \
        ("intermediate_size", args.intermediate_size)
    vocab = ("vocab_size", args.vocab_size)
    top = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden],
           "model.norm.weight": [hidden]}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    per_layer = {"self_attn.q_proj.weight": [heads, hidden], "self_attn.k_proj.weight": [kv, hidden],
                 "self_attn.v_proj.weight": [kv, hidden], "self_attn.o_proj.weight": [hidden, heads],
                 "self_attn.q_proj.bias": [heads], "self_attn.k_proj.bias": [kv], "self_attn.v_proj.bias": [kv],
                 "self_attn.o_proj.bias": [hidden], "mlp.gate_proj.weight": [inter, hidden],
                 "mlp.up_proj.weight": [inter, hidden], "mlp.down_proj.weight": [hidden, inter],
                 "input_layernorm.weight": [hidden], "post_attention_layernorm.weight": [hidden]}
    return per_layer.get(".".join(parts[3:]))


def check_weight_shapes(ckpt_dir: str | Path, args: ModelArgs | None = None) -> None:
    """Compare every tensor's shape in the safetensors headers with what `config.json` says, before anything is
    built or read: a RecipeError names the tensor, the config key and both shapes (a config.json copied from
    another model size, a vocab_size edited by hand). Layers past num_hidden_layers are errors too."""
    from .hf_io import safetensors_shapes

    args = args or read_model_args(ckpt_dir)
    shapes = safetensors_shapes(ckpt_dir)
    if not shapes or args.hf_config.get("quantization_config"):
        return  # no headers to read (loading reports it), or quantized tensors laid out by their scheme
    config = Path(ckpt_dir) / "config.json"
    for name, (file, shape) in shapes.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() \
                and int(parts[2]) >= args.num_layers:
            raise RecipeError(f"{file}: tensor '{name}' is in layer {parts[2]}, but {config} has num_hidden_layers="
                              f"{args.num_layers}: the config does not describe these weights")
        want = expected_shapes(args, name)
        if want is None:
            continue
        sizes = [n for _, n in want]
        if list(shape) != sizes:
            differ = [(k, n) for (k, n), got in zip(want, shape) if got != n] if len(shape) == len(want) else want
            keys = [f"{k}={n}" for k, n in differ]
            raise RecipeError(f"{file}: tensor '{name}' has shape {list(shape)} but {config} gives {sizes} "
                              f"({', '.join(keys)}): the config does not describe these weights")
