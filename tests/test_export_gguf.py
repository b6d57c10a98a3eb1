"""GGUF export: gguf.GGUFReader reads it, transformers' GGUF loader reproduces our logits and token ids."""

import dataclasses
import logging

import gguf
import numpy as np
import pytest
import torch

from llm_recipe.components.assets import ensure_assets
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import ModelArgs, build_model, load_model
from llm_recipe.components.models.gguf_import import _unpermute_qk
from llm_recipe.components.quantization import SCHEMES, convert_qat, prepare_qat, quantize_model
from llm_recipe.components.quantization.export_gguf import (
    QTYPES,
    SCHEME_QTYPES,
    bits_per_weight,
    export_gguf,
    gguf_tensor_types,
    llama_cpp_permute,
    qtype_for_scheme,
)

transformers = pytest.importorskip("transformers")

PROMPT = "The capital of France is Paris. In 2024, 17 people<|im_end|>"


@pytest.fixture(scope="module")
def embedded():
    return ensure_assets(quiet=True)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def hf_from_gguf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def tiny(tie=True, seed=0):
    args = ModelArgs(family="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=100000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=128, tie_word_embeddings=tie, qkv_bias=False, o_bias=False)
    torch.manual_seed(seed)
    model = build_model(args, max_seq_len=128).eval()
    with torch.no_grad():  # realistic scales: the default init makes near-uniform logits that hide errors
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model, args


def gguf_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name.endswith("export_gguf") and r.levelno >= logging.WARNING]


def dequantized_reference(model, args):
    """Our model with every torchao weight replaced by codes * fp16(scale): exactly what a Q4_0/Q8_0 block holds."""
    ref = build_model(args, max_seq_len=128).eval()
    sd = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "qdata"):
            g = v.block_size[-1]
            v = v.qdata.float() * v.scale.half().float().repeat_interleave(g, dim=1)
        sd[k] = v
    ref.load_state_dict(sd)
    return ref


def test_permutation_is_the_inverse_of_import():
    w = torch.randn(6 * 16, 40)
    for heads in (6, 2):
        p = llama_cpp_permute(w, heads)
        assert not torch.equal(p, w)
        np.testing.assert_array_equal(_unpermute_qk(p.numpy(), heads), w.numpy())
    b = torch.arange(32.0)
    assert llama_cpp_permute(b, 2)[:4].tolist() == [0.0, 8.0, 1.0, 9.0]  # per head: pairs (i, i + d/2)


@pytest.mark.parametrize("qtype, tie, max_rel", [  # F32 (~16 s on 2 cores) in the slow suite
    pytest.param("F32", True, 1e-6, marks=pytest.mark.slow), ("F16", False, 2e-3)])
def test_float_types_load_in_transformers(embedded, tmp_path, qtype, tie, max_rel):
    model, args = tiny(tie)
    path = export_gguf(model, args, embedded, tmp_path / f"t-{qtype}.gguf", qtype)
    types = gguf_tensor_types(path)
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.1.ffn_down.weight"] == qtype
    assert ("output.weight" in types) == (not tie)
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 7042, 30, 2]])
    with torch.no_grad():
        ours, theirs = model(ids), hf_from_gguf(path)(ids).logits
    assert rel(theirs, ours) < max_rel


def test_add_bos_follows_the_tokenizer_as_transformers_does(embedded, tmp_path):
    """Llama 3's tokenizer_config.json has no add_bos_token: its post-processor prepends BOS. The GGUF says so
    (it said false, which turns llama.cpp's BOS off); an explicit flag still wins."""
    import json
    import shutil

    def add_bos_of(tokenizer_dir):
        model, args = tiny()
        path = export_gguf(model, args, tokenizer_dir, tmp_path / f"{tokenizer_dir.name}.gguf", "F16")
        return bool(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.add_bos_token"].parts[-1][0])

    llama3_like = tmp_path / "llama3_like"
    shutil.copytree(embedded, llama3_like, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((llama3_like / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"]
    (llama3_like / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = json.loads((llama3_like / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tok["post_processor"]["single"].insert(0, bos)
    tok["post_processor"]["special_tokens"] = {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                "tokens": ["<|im_start|>"]}}
    (llama3_like / "tokenizer.json").write_text(json.dumps(tok))
    assert add_bos_of(llama3_like) is True
    assert add_bos_of(embedded) is False  # SmolLM2: add_bos_token false


def test_bf16_tensors_round_trip_through_gguf_reader(embedded, tmp_path):
    model, args = tiny()
    path = export_gguf(model, args, embedded, tmp_path / "t-bf16.gguf", "BF16")
    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.1.attn_k.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType.BF16
    got = _unpermute_qk(gguf.quants.dequantize(t.data, t.tensor_type), args.num_kv_heads)
    want = model.layers[1].attn.k_proj.weight.detach().bfloat16().float().numpy()
    np.testing.assert_array_equal(got, want)


def test_qat_model_exports_q4_0_code_for_code(embedded, tmp_path):
    model, args = tiny(tie=False)
    prepare_qat(model, "8da4w", group_size=64)  # any multiple of 32 maps onto Q4_0 blocks
    convert_qat(model, "8da4w", group_size=64)
    path = export_gguf(model, args, embedded, tmp_path / "qat.gguf", "Q4_0")
    types = gguf_tensor_types(path)
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types["blk.1.ffn_up.weight"] == "Q4_0"
    assert types["token_embd.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"  # llama.cpp keeps these 8-bit
    reference = dequantized_reference(model, args)
    ids = torch.tensor([[1, 504, 3575, 282, 4649, 314, 7042, 30, 2]])
    with torch.no_grad():
        theirs, want = hf_from_gguf(path)(ids).logits, reference(ids)
    # Only the embedding/output (Q8_0 from float) add error; the int4 blocks are torchao's codes and scales.
    assert rel(theirs, want) < 0.01


def test_real_model_q8_0_metadata_tokenizer_and_logits(embedded, tmp_path):
    model, args = load_model(embedded)
    model.eval()
    path = export_gguf(model, args, embedded, tmp_path / "smol-q8.gguf", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "llama" and meta["general.file_type"] == 7
    assert meta["llama.block_count"] == 30 and meta["llama.attention.head_count_kv"] == 3
    assert meta["llama.embedding_length"] == 576 and meta["llama.feed_forward_length"] == 1536
    assert meta["llama.rope.freq_base"] == pytest.approx(100000.0) and meta["llama.vocab_size"] == 49152
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "smollm"
    assert meta["tokenizer.ggml.eos_token_id"] == 2 and "<|im_start|>" in meta["tokenizer.chat_template"]
    assert len(reader.tensors) == 2 + 9 * 30 and 8.4 < bits_per_weight(path) < 8.6

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    src_tok = transformers.AutoTokenizer.from_pretrained(embedded)
    ids = src_tok(PROMPT, return_tensors="pt").input_ids
    assert hf_tok(PROMPT).input_ids == ids[0].tolist()
    with torch.no_grad():
        ours, theirs = model(ids), hf_from_gguf(path)(ids).logits
    # Measured: relative L2 0.028, KL 0.0014 nats/token, same argmax everywhere.
    assert rel(theirs, ours) < 0.05
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() > 0.9


def test_real_model_8da4w_blocks_are_torchao_codes(embedded, tmp_path):
    model, args = load_model(embedded)
    quantize_model(model, "8da4w", group_size=32)
    path = export_gguf(model, args, embedded, tmp_path / "smol-q4.gguf", "Q4_0")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, module, heads in [("blk.0.attn_q.weight", model.layers[0].attn.q_proj, 9),
                                ("blk.7.attn_k.weight", model.layers[7].attn.k_proj, 3),
                                ("blk.29.ffn_down.weight", model.layers[29].mlp.w2, None)]:
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        if heads:
            got = _unpermute_qk(got, heads)
        w = module.weight
        want = (w.qdata.float() * w.scale.half().float().repeat_interleave(32, dim=1)).numpy()
        np.testing.assert_array_equal(got, want)


def test_errors(embedded, tmp_path):
    model, args = tiny()
    with pytest.raises(RecipeError, match="qtype 'Q5_K'.*Q4_0"):
        export_gguf(model, args, embedded, tmp_path / "x.gguf", "Q5_K")
    with pytest.raises(RecipeError, match="tokenizer.json: not found"):
        export_gguf(model, args, tmp_path, tmp_path / "x.gguf", "F16")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))  # nothing half-written
    small = dataclasses.replace(args, vocab_size=100)
    with pytest.raises(RecipeError, match="49152 tokens but the model's vocab_size is 100"):
        export_gguf(build_model(small).state_dict(), small, embedded, tmp_path / "x.gguf", "F16")


def test_a_sentencepiece_style_tokenizer_is_refused_before_the_weights_load(tiny_model_dir, tmp_path, capsys):
    """Mistral's / Llama 2's BPE (byte fallback, `▁` for spaces) written as a gpt2 vocabulary would be tokenized
    wrongly by llama.cpp: `recipe run quantize formats=[gguf]` refuses it in one line naming the file, before any
    weights load (it failed after both perplexity passes and the hf export, naming a key the recipe does not have)."""
    import json
    import shutil

    from recipes_common import cli_captured, one_error

    model_dir = tmp_path / "spm_like"
    shutil.copytree(tiny_model_dir, model_dir)
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok["model"]["byte_fallback"] = True
    tok["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}
    tok["decoder"] = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"},
                                                        "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    (model_dir / "tokenizer.json").write_text(json.dumps(tok))
    code, _, err = cli_captured(capsys, ["run", "quantize", "--config", "quantize/smollm2_8da4w",
                                         f"model.checkpoint_dir={model_dir}", f"output_dir={tmp_path}/out",
                                         "formats=[hf,gguf]"])
    assert code == 1
    assert one_error(err) == (f"recipe: error: {model_dir}/tokenizer.json: a SentencePiece-style BPE (byte fallback, "
                              "no byte-level decoder: Mistral's or Llama 2's kind), which the GGUF export does not "
                              "write (it writes byte-level BPE: Llama 3, Qwen2, SmolLM); use formats [hf] or [pte]")
    assert "perplexity" not in err and not (tmp_path / "out" / "hf").exists()


def test_qtype_follows_the_scheme():
    assert set(SCHEME_QTYPES) == set(SCHEMES) and set(SCHEME_QTYPES.values()) <= set(QTYPES)
    assert [qtype_for_scheme(s) for s in ("8da4w", "int4_weight_only")] == ["Q4_0", "Q4_0"]
    assert [qtype_for_scheme(s) for s in ("int8_weight_only", "float8_weight_only", "float8_dynamic")] == ["Q8_0"] * 3
    with pytest.raises(RecipeError, match="scheme 'int3'"):
        qtype_for_scheme("int3")


def test_int8_weight_only_packs_code_for_code_into_q8_0(embedded, tmp_path, caplog):
    model, args = tiny(tie=False)
    quantize_model(model, "int8_weight_only")
    path = export_gguf(model, args, embedded, tmp_path / "int8.gguf", qtype_for_scheme("int8_weight_only"))
    types = gguf_tensor_types(path)
    assert {t for n, t in types.items() if not n.endswith("norm.weight")} == {"Q8_0"}  # every matrix 8-bit
    assert gguf_warnings(caplog) == []  # nothing requantized
    t = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}["blk.1.ffn_down.weight"]
    w = model.layers[1].mlp.w2.weight
    want = (w.qdata.float() * w.scale.half().float()).numpy()  # one scale per row: every block of the row shares it
    np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type), want)


@pytest.mark.parametrize("scheme, qtype, why", [
    ("int8_weight_only", "Q4_0", "int8 codes pack exactly into Q8_0 blocks, not Q4_0"),
    ("float8_weight_only", "Q8_0", "GGUF has no float8 type; Q8_0 is the closest"),
])
def test_requantized_weights_warn_once_with_a_count(embedded, tmp_path, caplog, scheme, qtype, why):
    model, args = tiny()
    quantize_model(model, scheme)
    path = export_gguf(model, args, embedded, tmp_path / "x.gguf", qtype)
    kind = type(model.layers[0].attn.q_proj.weight).__name__
    (line,) = gguf_warnings(caplog)  # one line for the 14 block matrices, not one per tensor
    assert line == (f"x.gguf: 14 torchao {kind} weights (blk.0.ffn_down.weight, ...) requantized to {qtype} from "
                    f"dequantized values, not packed code for code: {why}")
    assert set(gguf_tensor_types(path).values()) == {"F32", qtype, "Q8_0"}  # norms, block matrices, embedding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_tinygemm_weights_read_back_as_their_kernel_computes():
    """torchao 0.18's Int4TilePackedTo4dTensor has no dequantize: the GGUF reads it back through its own kernel,
    and a matmul with the values read back gives the kernel's output."""
    from llm_recipe.components.quantization.export_gguf import _dequantized

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=False).to("cuda", torch.bfloat16)
    w = linear.weight.detach().clone()
    quantize_model(torch.nn.ModuleDict({"layers": torch.nn.ModuleList([linear])}), "int4_weight_only", group_size=32)
    q = linear.weight
    assert type(q).__name__ == "Int4TilePackedTo4dTensor"
    values = _dequantized(q.cpu())  # as the GGUF export holds it: moved to the host first
    assert values.shape == w.shape and ((values.float() - w.float()).norm() / w.float().norm()).item() < 0.15
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(x @ values.t(), linear(x), rtol=2e-2, atol=2e-2)
