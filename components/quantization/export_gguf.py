"""Export our model (or a HF state dict) as a llama.cpp GGUF file with the `gguf` package's `GGUFWriter`.

Tensors get llama.cpp names, and for the `llama` architecture (Llama, Mistral) Q/K rows are permuted into
llama.cpp's order: its RoPE rotates interleaved pairs, ours and HF's rotate halves. Qwen2 uses NEOX RoPE in
llama.cpp (halves, like HF) and is written unpermuted. Norms stay F32.

Quantized types: F32, F16, BF16, Q8_0, Q4_0 (`qtype_for_scheme` picks the one that matches a torchao scheme:
Q4_0 for int4 weights, Q8_0 for int8 and float8 ones, GGUF having no float8 type). In a Q4_0 file the token
embedding (and an untied output) are Q8_0, as llama.cpp's own quantizer keeps the embedding at higher precision.
Weights that torchao already quantized (8da4w int4, int8 weight-only) are packed *exactly*: Q4_0/Q8_0 store one
fp16 scale per 32 values and the integer codes, so a torchao group whose size is a multiple of 32 maps onto GGUF
blocks code for code (`gguf.quants.quantize` would re-derive scales from the float weights and lose what QAT
learned). Only the scale is rounded to fp16. Other torchao weights are requantized from their dequantized
values, with one warning per kind (a count and the first tensor), not one line per tensor.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..checkpoint.atomic import honour_umask, write_failure
from ..errors import RecipeError
from ..models import ModelArgs, lora_modules, merged_state_dict, tune_to_hf_names
from ..models.tokenizer import Tokenizer
from .schemes import _is_torchao_tensor

log = logging.getLogger(__name__)

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
AUTO = "auto"  # the recipe's `gguf_qtype: auto`: the type `qtype_for_scheme` gives for the scheme
# torchao scheme -> the GGUF type that holds its weights: int4 codes pack exactly into Q4_0 blocks, int8 codes into
# Q8_0; float8 has no GGUF type, and Q8_0 (8 bits + an fp16 scale per 32 values) is the closest 8-bit one.
SCHEME_QTYPES = {"8da4w": "Q4_0", "int4_weight_only": "Q4_0", "int8_weight_only": "Q8_0",
                 "float8_weight_only": "Q8_0", "float8_dynamic": "Q8_0"}
_BLOCK = 32  # values per Q4_0 / Q8_0 block

# HF Llama-family names -> gguf MODEL_TENSOR members (llama.cpp names come from gguf.TENSOR_NAMES).
_LAYER_TENSORS = {
    "input_layernorm": "ATTN_NORM",
    "self_attn.q_proj": "ATTN_Q",
    "self_attn.k_proj": "ATTN_K",
    "self_attn.v_proj": "ATTN_V",
    "self_attn.o_proj": "ATTN_OUT",
    "post_attention_layernorm": "FFN_NORM",
    "mlp.gate_proj": "FFN_GATE",
    "mlp.up_proj": "FFN_UP",
    "mlp.down_proj": "FFN_DOWN",
}
_GLOBAL_TENSORS = {"model.embed_tokens": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def qtype_for_scheme(scheme: str) -> str:
    """The GGUF type matching a quantization scheme's weights (see SCHEME_QTYPES), so that a user who asked for
    int8 gets an 8-bit file and one who asked for int4 a 4-bit one."""
    if scheme not in SCHEME_QTYPES:
        raise RecipeError(f"scheme {scheme!r} has no GGUF type; choose gguf_qtype from {list(QTYPES)}")
    return SCHEME_QTYPES[scheme]


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp interleaved order, per head (rows: n_head * head_dim).

    Within each head the first half of the rows (rotated with the second half in HF) become the even rows.
    Works on weights [rows, in] and biases [rows]; the inverse of the un-permute applied on GGUF import.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise RecipeError(f"cannot permute {rows} rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_name(hf_key: str) -> tuple[str, str]:
    """(llama.cpp tensor name, HF module key) for a HF parameter key."""
    import gguf

    module, _, kind = hf_key.rpartition(".")
    if module in _GLOBAL_TENSORS:
        base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[_GLOBAL_TENSORS[module]]]
        return f"{base}.{kind}", module
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_TENSORS:
        base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[_LAYER_TENSORS[parts[3]]]].format(bid=int(parts[2]))
        return f"{base}.{kind}", parts[3]
    raise RecipeError(f"no llama.cpp name for tensor {hf_key!r}")


def _hf_state_dict(source: nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(source, nn.Module):
        sd = merged_state_dict(source) if lora_modules(source) else dict(source.state_dict())
        return tune_to_hf_names({k: v.detach().cpu() for k, v in sd.items()})
    if not source:
        raise RecipeError("export_gguf: the state dict is empty")
    if any(k.startswith("model.") for k in source):
        return {k: v.detach().cpu() for k, v in source.items() if not k.endswith("rotary_emb.inv_freq")}
    return tune_to_hf_names({k: v.detach().cpu() for k, v in source.items()})


def _integer_grid(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype] | None:
    """(codes int8 [out, in], scale fp32 [out, in/32], code dtype: torch.int4 or int8) when a torchao weight is a symmetric integer
    grid whose scale is constant over each run of 32 inputs; None otherwise (then we requantize floats)."""
    qdata, scale = getattr(t, "qdata", None), getattr(t, "scale", None)
    block = getattr(t, "block_size", None)
    if qdata is None or scale is None or block is None or qdata.dtype != torch.int8 or qdata.dim() != 2:
        return None
    zp = getattr(t, "zero_point", None)
    if zp is not None and bool((zp != 0).any()):
        return None
    group = int(block[-1])
    if tuple(block[:-1]) != (1,) or group % _BLOCK or qdata.shape[1] % group:
        return None
    per_block = scale.float().reshape(qdata.shape[0], -1).repeat_interleave(group // _BLOCK, dim=1)
    if per_block.shape[1] * _BLOCK != qdata.shape[1]:
        return None
    return qdata, per_block, getattr(t, "target_dtype", torch.int8)


def _pack_blocks(codes: torch.Tensor, scale: torch.Tensor, qtype: str) -> np.ndarray:
    """Lay out integer codes and per-block scales as GGUF Q4_0 / Q8_0 bytes (rows x bytes-per-row).

    Block layout (ggml): fp16 scale d, then Q8_0: 32 int8 codes; Q4_0: 16 bytes, byte j = (c[j]+8) | (c[j+16]+8) << 4.
    """
    rows, cols = codes.shape
    c = codes.reshape(rows, cols // _BLOCK, _BLOCK).numpy()
    d = scale.numpy().astype(np.float16).reshape(rows, cols // _BLOCK, 1).view(np.uint8)
    if qtype == "Q8_0":
        q = c.astype(np.int8).view(np.uint8)
    else:
        u = (c.astype(np.int16) + 8).astype(np.uint8)
        q = u[..., : _BLOCK // 2] | (u[..., _BLOCK // 2:] << np.uint8(4))
    return np.concatenate([d, q], axis=-1).reshape(rows, -1)


def _tensor_type(gguf_name: str, tensor: torch.Tensor, qtype: str) -> str:
    """The GGUF type of one tensor under file type `qtype` (llama.cpp's convention)."""
    if tensor.dim() < 2 or qtype == "F32":
        return "F32"
    if qtype in ("F16", "BF16"):
        return qtype
    if tensor.shape[-1] % _BLOCK:
        return "F16"  # rows that do not split into 32-blocks cannot be block-quantized
    if qtype == "Q4_0" and gguf_name.split(".")[0] in ("token_embd", "output"):
        return "Q8_0"
    return qtype


def _why_requantized(t: torch.Tensor, ttype: str) -> str:
    """Why a torchao weight cannot be packed code for code into `ttype` blocks (for the one-line warning)."""
    grid = _integer_grid(t)
    if grid is not None and grid[2] != torch.int4 and ttype == "Q4_0":
        return "int8 codes pack exactly into Q8_0 blocks, not Q4_0"
    qdata = getattr(t, "qdata", None)
    if qdata is not None and qdata.dtype.is_floating_point:
        return f"GGUF has no float8 type; {ttype} is the closest"
    return "exact packing needs symmetric int4/int8 codes in groups of a multiple of 32"


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    """A torchao weight's values. torchao 0.18's int4 tinygemm weight (Int4TilePackedTo4dTensor, int4_weight_only)
    has no dequantize and its layout is the CUDA kernel's own: its values are what that kernel gives for the
    identity, `linear(I, W) = W^T`, each a single product summed in fp32 and rounded once to bf16."""
    try:
        return t.dequantize()
    except NotImplementedError:
        if t.dim() != 2 or not torch.cuda.is_available():
            raise RecipeError(f"a {type(t).__name__} weight of shape {tuple(t.shape)} can be read back only through "
                              "its CUDA kernel, and this machine has no CUDA GPU") from None
        w = t.to("cuda")
        eye = torch.eye(w.shape[1], dtype=torch.bfloat16, device="cuda")
        return torch.nn.functional.linear(eye, w).t()


def _encode(name: str, t: torch.Tensor, ttype: str, permute_heads: int | None,
            requantized: dict[tuple[str, str, str], list[str]] | None = None) -> tuple[np.ndarray, object]:
    """Return (array, raw_dtype or None) ready for GGUFWriter.add_tensor. A torchao weight that cannot be
    packed exactly is recorded in `requantized` ({(torchao type, GGUF type, reason): [tensor names]})."""
    import gguf

    grid = _integer_grid(t) if _is_torchao_tensor(t) else None
    if grid is not None and ttype in ("Q4_0", "Q8_0") and (ttype == "Q8_0" or grid[2] == torch.int4):
        codes, scale, _ = grid
        if permute_heads:
            codes, scale = llama_cpp_permute(codes, permute_heads), llama_cpp_permute(scale, permute_heads)
        return _pack_blocks(codes, scale, ttype), gguf.GGMLQuantizationType[ttype]
    if _is_torchao_tensor(t) and ttype in ("Q4_0", "Q8_0") and requantized is not None:
        requantized.setdefault((type(t).__name__, ttype, _why_requantized(t, ttype)), []).append(name)
    w = _dequantized(t) if _is_torchao_tensor(t) else t
    w = w.float().cpu()
    if permute_heads:
        w = llama_cpp_permute(w, permute_heads)
    arr = w.contiguous().numpy()
    if ttype == "F32":
        return arr.astype(np.float32), None
    if ttype == "F16":
        return arr.astype(np.float16), None
    qt = gguf.GGMLQuantizationType[ttype]
    return gguf.quants.quantize(arr, qt), qt


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: not found (the GGUF needs the tokenizer files)") from None
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def _pre_tokenizer_name(tok: dict, path: Path) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer (the splits we know how to name)."""
    from ..models.gguf_import import _LLAMA3_SPLIT, _QWEN2_SPLIT

    pre = tok.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"  # digits one by one, then GPT-2 splitting (SmolLM, StarCoder)
    if kinds[:1] == ["Split"]:
        regex = (parts[0].get("pattern") or {}).get("Regex")
        if regex == _LLAMA3_SPLIT:
            return "llama-bpe"
        if regex == _QWEN2_SPLIT:
            return "qwen2"
    raise RecipeError(f"{path}: pre_tokenizer {kinds} has no llama.cpp name we know (smollm, llama-bpe, qwen2, "
                      "gpt-2), so llama.cpp could not split text as this tokenizer does; use formats [hf] or [pte] "
                      "(export_gguf takes tokenizer_pre= to name it)")


def check_gguf_tokenizer(tokenizer_dir: str | os.PathLike, tokenizer_pre: str | None = None) -> str:
    """The llama.cpp pre-tokenizer name for the folder's tokenizer.json (`tokenizer_pre` when given), or a one-line
    RecipeError when it cannot go into a GGUF: we write `tokenizer.ggml.model = gpt2`, which is right only for
    byte-level BPE (Llama 3, Qwen2, SmolLM); a SentencePiece-style BPE (Mistral's, Llama 2's: byte fallback, `▁`
    for spaces) would be tokenized wrongly by llama.cpp. The quantize recipe calls it before any weights load."""
    return _checked_tokenizer(Path(tokenizer_dir), tokenizer_pre)[1]


def _checked_tokenizer(tokenizer_dir: Path, tokenizer_pre: str | None) -> tuple[dict, str]:
    # tokenizer.json parsed once (Llama 3's is ~9 MB) for the check and the writer, and its llama.cpp name
    path = tokenizer_dir / "tokenizer.json"
    tok = _read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise RecipeError(f"{path}: only byte-level BPE tokenizers can go into a GGUF (found model type "
                          f"{model.get('type')!r}); use formats [hf] or [pte]")
    decoder = tok.get("decoder") or {}
    decoders = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    if model.get("byte_fallback") or "ByteLevel" not in [d.get("type") for d in decoders]:
        raise RecipeError(f"{path}: a SentencePiece-style BPE (byte fallback, no byte-level decoder: Mistral's or "
                          "Llama 2's kind), which the GGUF export does not write (it writes byte-level BPE: "
                          "Llama 3, Qwen2, SmolLM); use formats [hf] or [pte]")
    return tok, tokenizer_pre or _pre_tokenizer_name(tok, path)


def _add_tokenizer(writer, tokenizer_dir: Path, vocab_size: int, tokenizer_pre: str | None) -> None:
    import gguf

    tok, pre = _checked_tokenizer(tokenizer_dir, tokenizer_pre)
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
    model = tok["model"]
    ids = dict(model["vocab"])
    types: dict[int, int] = {}
    for added in tok.get("added_tokens", []):
        ids[added["content"]] = added["id"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    n = max(ids.values()) + 1
    if n > vocab_size:
        raise RecipeError(f"tokenizer has {n} tokens but the model's vocab_size is {vocab_size}")
    tokens: list[str | None] = [None] * vocab_size
    for text, i in ids.items():
        tokens[i] = text
    token_types = [types.get(i, gguf.TokenType.NORMAL) for i in range(vocab_size)]
    for i, text in enumerate(tokens):  # embedding rows the tokenizer never emits (vocab padded for speed)
        if text is None:
            tokens[i] = f"[PAD{i}]"
            token_types[i] = gguf.TokenType.UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)

    def special(key: str) -> int | None:
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return ids.get(value) if value is not None else None

    for key, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                     ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        idx = special(key)
        if idx is not None:
            add(idx)
    # What our tokenizer (and transformers) does: tokenizer_config's flag, else its post-processor's BOS. Llama 3's
    # config has no flag; an explicit false would turn off llama.cpp's BOS for it.
    writer.add_add_bos_token(Tokenizer.from_dir(tokenizer_dir).add_bos_token)
    writer.add_add_eos_token(bool(cfg.get("add_eos_token", False)))
    template = cfg.get("chat_template")
    if template is None and (tokenizer_dir / "chat_template.jinja").is_file():
        template = (tokenizer_dir / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _rope_freq_factors(args: ModelArgs) -> torch.Tensor:
    """Llama 3.x RoPE scaling as llama.cpp stores it: per-frequency divisors in a `rope_freqs` tensor."""
    from ..models.rope import _scale_frequencies

    inv = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim))
    return (inv / _scale_frequencies(inv, args.rope_scaling)).float()


def _file_type(qtype: str) -> int:
    import gguf

    return {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
            "BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype]


def export_gguf(
    source: nn.Module | dict[str, torch.Tensor],
    args: ModelArgs,
    tokenizer_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    qtype: str = "Q8_0",
    tokenizer_pre: str | None = None,
    name: str | None = None,
) -> Path:
    """Write a GGUF (atomically) from our model (LoRA merged, torchao weights packed exactly where possible)
    or a state dict with HF or torchtune names. `tokenizer_pre` overrides the detected llama.cpp pre-tokenizer."""
    import gguf

    if qtype not in QTYPES:
        raise RecipeError(f"gguf qtype {qtype!r} is not supported; choose one of {list(QTYPES)}")
    if args.family not in _ARCH:
        raise RecipeError(f"model family {args.family!r} cannot be exported to GGUF (llama, mistral, qwen2)")
    arch = _ARCH[args.family]
    sd = _hf_state_dict(source)
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_path.parent.glob(f".{glob.escape(out_path.name)}.*.tmp"):  # a killed export's leftover
        stale.unlink(missing_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    honour_umask(fd)
    os.close(fd)
    requantized: dict[tuple[str, str, str], list[str]] = {}
    try:
        writer = gguf.GGUFWriter(tmp_name, arch)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or args.hf_config.get("_name_or_path") or f"{args.family}-{args.num_layers}L")
        writer.add_context_length(args.max_position_embeddings)
        writer.add_embedding_length(args.hidden_size)
        writer.add_block_count(args.num_layers)
        writer.add_feed_forward_length(args.intermediate_size)
        writer.add_head_count(args.num_heads)
        writer.add_head_count_kv(args.num_kv_heads)
        writer.add_rope_freq_base(args.rope_theta)
        writer.add_rope_dimension_count(args.head_dim)
        if args.head_dim * args.num_heads != args.hidden_size:
            writer.add_key_length(args.head_dim)
            writer.add_value_length(args.head_dim)
        writer.add_layer_norm_rms_eps(args.rms_norm_eps)
        writer.add_vocab_size(args.vocab_size)
        writer.add_file_type(_file_type(qtype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        rope = args.rope_scaling
        if rope is not None and rope["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        _add_tokenizer(writer, Path(tokenizer_dir), args.vocab_size, tokenizer_pre)

        if rope is not None and rope["rope_type"] == "llama3":
            writer.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                              _rope_freq_factors(args).numpy())
        for key in sorted(sd, key=_tensor_order):
            t = sd[key]
            gname, module = _gguf_name(key)
            heads = None
            if arch == "llama" and module == "self_attn.q_proj":
                heads = args.num_heads
            elif arch == "llama" and module == "self_attn.k_proj":
                heads = args.num_kv_heads
            arr, raw = _encode(gname, t, _tensor_type(gname, t, qtype), heads, requantized)
            writer.add_tensor(gname, arr, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_name, out_path)
    except BaseException as e:
        Path(tmp_name).unlink(missing_ok=True)
        reason = write_failure(e)
        if reason is not None:  # disk full, quota, permission: one line, the previous file untouched
            raise RecipeError(f"cannot write {out_path}: {reason}; nothing under that name was changed") from e
        raise
    for (kind, ttype, why), names in requantized.items():  # one line per kind of weight, not one per tensor
        first = names[0] + (", ..." if len(names) > 1 else "")
        log.warning("%s: %d torchao %s weight%s (%s) requantized to %s from dequantized values, not packed code "
                    "for code: %s", out_path.name, len(names), kind, "s" * (len(names) > 1), first, ttype, why)
    return out_path


def _tensor_order(hf_key: str) -> tuple[int, int, str]:
    """token_embd first, then blocks in numeric order, then output norm/output (llama.cpp's usual order)."""
    if hf_key.startswith("model.embed_tokens"):
        return (0, 0, hf_key)
    if hf_key.startswith("model.layers."):
        return (1, int(hf_key.split(".")[2]), hf_key)
    return (2, 0, hf_key)


def gguf_tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """{tensor name: GGML type name} of a GGUF file (for reports and tests)."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def bits_per_weight(path: str | os.PathLike) -> float:
    """Average stored bits per parameter of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    n = sum(math.prod(int(d) for d in t.shape) for t in reader.tensors)
    return 8 * sum(int(t.n_bytes) for t in reader.tensors) / n
