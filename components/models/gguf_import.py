"""Convert a llama.cpp GGUF file (Llama architecture) into a Hugging Face folder with fp32 safetensors.

The file is read with the `gguf` package; every tensor is dequantized to fp32, renamed to HF Llama names,
and q/k rows are un-permuted (llama.cpp's converter reorders them for its interleaved RoPE; our RoPE and HF's
are rotate-half). The tokenizer is rebuilt as a byte-level BPE `tokenizer.json` from the GGUF vocabulary.
Checked against transformers' own GGUF loader in tests/test_gguf_import.py.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from ..checkpoint import atomic_directory
from ..errors import RecipeError

# llama.cpp tensor names -> Hugging Face Llama names. `{}` is the layer index.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added, not special).
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, the same regexes llama.cpp applies for these names.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"}
_PLAIN_GPT2 = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"}
_REGEX_PRE = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

MARKER = ".gguf_import_complete"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row order (per head: all even rotary rows, then all odd) back to HF rotate-half.

    llama.cpp's convert_hf_to_gguf does `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`; this swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise RecipeError(f"q/k weight with {rows} rows is not divisible into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost-first
    return np.array(arr.reshape(shape), dtype=np.float32)  # a writable copy (F32 tensors are memory-mapped)


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    return None


def _model_config(reader: Any, arch: str, has_output: bool, n_vocab: int) -> dict:
    def key(name: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{name}", default)
        if value is None:
            raise RecipeError(f"GGUF metadata lacks '{arch}.{name}'; the file is not a complete llama model")
        return value

    hidden, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": n_vocab,
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        # Weights are dequantized to fp32 and saved as fp32: no precision is invented or thrown away.
        "torch_dtype": "float32",
    }
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise RecipeError(f"GGUF rope.dimension_count={rope_dims} != head_dim={head_dim}: partial RoPE is not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise RecipeError(f"GGUF '{arch}.rope.scaling.type'={scaling!r} is not supported (only linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return cfg


def _byte_level_tokenizer(reader: Any) -> tuple[Any, dict]:
    """Rebuild a `tokenizers.Tokenizer` (byte-level BPE) and the tokenizer_config dict from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise RecipeError(f"GGUF tokenizer.ggml.model={model!r}: only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    pre = _field(reader, "tokenizer.ggml.pre", "default")

    # Byte-level vocabularies spell every byte with a printable character (GPT-2's bytes_to_unicode):
    # printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 onwards, in byte order.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise RecipeError("GGUF tokenizer.ggml.tokens has duplicate entries; cannot build a vocabulary")

    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama3", "llama-bpe", "llama-v3"))
    tok = Tokenizer(bpe)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _REGEX_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        if pre not in _PLAIN_GPT2:
            warnings.warn(f"GGUF tokenizer.ggml.pre={pre!r} is not known here; using GPT-2 splitting", stacklevel=3)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()

    # Control tokens are special (kept whole, skipped on decode); user-defined ones are plain added tokens.
    # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel of a normal token: skip it.
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet
    ])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    def token_of(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if idx is None else tokens[int(idx)]

    bos, eos = token_of("bos"), token_of("eos")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t is not None]
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_of("unknown"),
        "pad_token": token_of("padding") or eos,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 2048)),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tok, config


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write `out_dir` (atomically) as an HF Llama folder: fp32 safetensors, config, generation and tokenizer files."""
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise RecipeError(f"GGUF file not found: {gguf_path}")
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader raises ValueError/struct errors on truncated or foreign files
        raise RecipeError(f"{gguf_path}: not a readable GGUF file ({e})") from e
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise RecipeError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (only 'llama')")

    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise RecipeError(f"{gguf_path}: tensor {tensor.name!r} has no Hugging Face Llama equivalent")
        w = _dequantize(tensor)
        if ".attn_q." in tensor.name:
            w = _unpermute_qk(w, n_head)
        elif ".attn_k." in tensor.name:
            w = _unpermute_qk(w, n_kv)
        state[name] = torch.from_numpy(w)

    has_output = "lm_head.weight" in state
    n_vocab = int(state["model.embed_tokens.weight"].shape[0])
    config = _model_config(reader, arch, has_output, n_vocab)
    expected = {f"model.layers.{i}.{v}.weight" for i in range(config["num_hidden_layers"]) for v in _LAYER_NAMES.values()}
    missing = sorted(expected - state.keys())
    if missing:
        raise RecipeError(f"{gguf_path}: missing tensors for {missing[:3]}...; the file is incomplete")

    tokenizer, tok_config = _byte_level_tokenizer(reader)
    if tokenizer.get_vocab_size(with_added_tokens=True) != n_vocab:
        raise RecipeError(
            f"{gguf_path}: tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the "
            f"embedding has {n_vocab} rows"
        )
    gen_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    gen_config = {k: v for k, v in gen_config.items() if v is not None}

    with atomic_directory(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
        # Written last: a folder with this marker was converted completely (used by llm_recipe.components.assets).
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf_path), "size": gguf_path.stat().st_size}) + "\n")
    return out_dir
