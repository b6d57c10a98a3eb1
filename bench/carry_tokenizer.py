"""Build and verify `.carry/tok` for bench/make_carry.py (SmolLM2's or Meta's Llama 3 tokenizer), apart to keep it short."""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import statistics
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_MODELS = "llama-models==0.3.0"          # Meta's package: llama_models/llama3/tokenizer.model (tiktoken BPE)
LLAMA3_MODEL_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
LLAMA_CPP = "llama-cpp-python==0.3.36"        # sdist: vendor/llama.cpp/models (chat templates, Llama-3 vocab + tests)
LLAMA_CPP_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
TEMPLATE = "templates/meta-llama-Llama-3.2-3B-Instruct.jinja"
VOCAB = "ggml-vocab-llama-bpe.gguf"
# Llama 3.1 / 3.2 special tokens 128000.. as HF's checkpoints name them (128004, 128008, 128010 are new in 3.1)
LLAMA31_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"] + \
                   [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]
TEST_SENTENCE = ("This is a test sentence.", [128000, 2028, 374, 264, 1296, 11914, 13])  # llama-models' tests
TEST_MESSAGE = ("<|start_header_id|>user<|end_header_id|>\n\nThis is a test sentence.<|eot_id|>",
                [128006, 882, 128007, 271, 2028, 374, 264, 1296, 11914, 13, 128009])
TOK_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SMOLLM2_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class TokError(Exception):
    """The tokenizer's sources are not the pinned ones, or the built tokenizer failed a check."""


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_smollm2_tok(d: Path, gguf_path: Path, cache: Path) -> None:
    """The embedded SmolLM2-135M-Instruct tokenizer's files, as `recipe assets` converts them from the GGUF."""
    from llm_recipe.components.models.gguf_import import convert_gguf_to_hf

    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        conv = convert_gguf_to_hf(gguf_path, Path(tmp) / "smollm2")
        for f in SMOLLM2_FILES:
            shutil.copy2(conv / f, d / f)


def llama3_sources(cache: Path, download: Callable[..., Path]) -> dict[str, Path]:
    """Meta's tokenizer.model and tokenizer.py (llama-models), llama.cpp's template, Llama-3 vocab and its tests.

    `download(spec, cache, sdist=False)`: the cached wheel (or sdist) of one pin (make_carry's download_one)."""
    src = cache / "src"
    out = {"model": src / "llama3/tokenizer.model", "meta_py": src / "llama3/tokenizer.py",
           "template": src / "llama.cpp" / TEMPLATE, "vocab": src / "llama.cpp" / VOCAB,
           "inp": src / "llama.cpp" / f"{VOCAB}.inp", "out": src / "llama.cpp" / f"{VOCAB}.out"}
    if not (out["model"].is_file() and out["meta_py"].is_file()):
        with zipfile.ZipFile(download(LLAMA_MODELS, cache)) as z:
            for key, member in (("model", "llama_models/llama3/tokenizer.model"),
                                ("meta_py", "llama_models/llama3/tokenizer.py")):
                out[key].parent.mkdir(parents=True, exist_ok=True)
                out[key].write_bytes(z.read(member))
    if not all(out[k].is_file() for k in ("template", "vocab", "inp", "out")):
        sdist = download(LLAMA_CPP, cache, sdist=True)
        wanted = {LLAMA_CPP_MODELS + str(out[k].relative_to(src / "llama.cpp")): out[k]
                  for k in ("template", "vocab", "inp", "out")}
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar:
                if member.name in wanted:
                    wanted[member.name].parent.mkdir(parents=True, exist_ok=True)
                    wanted[member.name].write_bytes(tar.extractfile(member).read())
        lost = [n for n, p in wanted.items() if not p.is_file()]
        if lost:
            raise TokError(f"{sdist.name} lacks {lost}")
    if _sha256(out["model"]) != LLAMA3_MODEL_SHA256:
        raise TokError(f"{out['model']}: sha256 {_sha256(out['model'])} is not Meta's Llama 3 tokenizer.model")
    return out


def meta_pattern(tokenizer_py: Path) -> str:
    """`Tokenizer.pat_str` of Meta's llama3/tokenizer.py (the pre-tokenizer regex), read without importing it."""
    for node in ast.walk(ast.parse(tokenizer_py.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pat_str" for t in node.targets):
            return ast.literal_eval(node.value)
    raise TokError(f"{tokenizer_py}: no pat_str")


def write_llama3_tok(d: Path, src: dict[str, Path]) -> None:
    try:
        from tokenizers import AddedToken, processors
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as e:
        raise TokError(f"the Llama-3 conversion needs tokenizers, tiktoken and transformers ({e}): run it with "
                        f"the project's venv (.venv/bin/python, `make setup` installs the dev extras)") from e
    tok = TikTokenConverter(vocab_file=str(src["model"]), pattern=meta_pattern(src["meta_py"])).converted()
    if tok.get_vocab_size() != 128000:
        raise TokError(f"{src['model']}: {tok.get_vocab_size()} BPE tokens, not 128000")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA31_SPECIALS])
    bos = LLAMA31_SPECIALS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, 128000)]),
    ])
    # Compact, with the merges as "a b" strings as HF's own Llama-3 tokenizer.json spells them (7.2 -> ~6 MB: the
    # carry sets are tight): the tokenizers library reads both spellings (verified below by reloading it).
    data = json.loads(tok.to_str(pretty=False))
    data["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (d / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")

    added = {str(128000 + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True} for i, t in enumerate(LLAMA31_SPECIALS)}
    config = {"added_tokens_decoder": added, "bos_token": bos, "chat_template": src["template"].read_text(),
              "clean_up_tokenization_spaces": True, "eos_token": "<|eot_id|>",
              "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def special(t: str) -> dict:
        return {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    (d / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": special(bos), "eos_token": special("<|eot_id|>")}, indent=2) + "\n")
    # end_of_text, eom, eot: llama-models' stop tokens
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}, indent=2) + "\n")


def tok_ok(d: Path, kind: str) -> str | None:
    """Quick check of a built .carry/tok (no downloads): files, vocab, special ids, the reference sentence."""
    files = TOK_FILES if kind == "llama3" else SMOLLM2_FILES
    if not d.is_dir() or sorted(f.name for f in d.iterdir()) != sorted(files):
        return f"not the {kind} files {list(files)}"
    try:
        from llm_recipe.components.models.tokenizer import Tokenizer
        tok = Tokenizer.from_dir(d)
    except Exception as e:  # noqa: BLE001
        return f"does not load ({e})"
    if kind == "smollm2":
        return None if tok.vocab_size == 49152 else f"vocab {tok.vocab_size}, not SmolLM2's 49152"
    checks = {"vocab 128256": tok.vocab_size == 128256, "bos 128000": tok.bos_id == 128000,
              "eos <|eot_id|> 128009": tok.eos_id == 128009 and tok.token_to_id("<|eot_id|>") == 128009,
              "reference sentence": tok.encode(TEST_SENTENCE[0]) == TEST_SENTENCE[1],
              "chat template": tok.has_chat_template}
    bad = [k for k, ok in checks.items() if not ok]
    return f"fails {bad}" if bad else None


def verify_llama3_tok(d: Path, src: dict[str, Path]) -> list[str]:
    """Full verification against independent references; returns the report lines, raises TokError on a mismatch."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import Tokenizer as HFTok

    from llm_recipe.components.models.tokenizer import Tokenizer

    report: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            raise TokError(f".carry/tok verification failed: {what}")
        report.append(f"ok  {what}")

    ours = Tokenizer.from_dir(d)
    raw = HFTok.from_file(str(d / "tokenizer.json"))
    check(ours.vocab_size == 128256, f"vocab size {ours.vocab_size} = 128256")
    check((ours.bos_id, ours.token_to_id("<|begin_of_text|>")) == (128000, 128000), "<|begin_of_text|> = 128000 = bos")
    check((ours.eos_id, ours.token_to_id("<|eot_id|>")) == (128009, 128009), "<|eot_id|> = 128009 = eos")
    check(all(ours.token_to_id(t) == 128000 + i for i, t in enumerate(LLAMA31_SPECIALS)),
          "special tokens 128000-128255 (Llama 3.1 names: 128004 finetune_right_pad_id, 128008 eom_id, 128010 "
          "python_tag)")
    check({128001, 128008, 128009} <= set(ours.stop_ids), f"stop ids {ours.stop_ids} include 128001, 128008, 128009")
    # Meta's own tests (llama_models/llama3/tests/api/test_tokenizer.py)
    check(ours.encode(TEST_SENTENCE[0]) == TEST_SENTENCE[1], f"{TEST_SENTENCE[0]!r} -> {TEST_SENTENCE[1]} (Meta's test)")
    check(ours.decode(TEST_SENTENCE[1], skip_special_tokens=False) == "<|begin_of_text|>" + TEST_SENTENCE[0],
          "decode of it")
    check(raw.encode(TEST_MESSAGE[0], add_special_tokens=False).ids == TEST_MESSAGE[1],
          "a user message with header/eot markers -> Meta's ids")

    # tiktoken with Meta's ranks, pattern and special tokens (llama-models' Tokenizer) on the shipped transfer sets
    ranks = load_tiktoken_bpe(str(src["model"]))
    enc = tiktoken.Encoding(name="llama3", pat_str=meta_pattern(src["meta_py"]), mergeable_ranks=ranks,
                            special_tokens={t: 128000 + i for i, t in enumerate(LLAMA31_SPECIALS)})
    data = ROOT / "components/data/transfer"
    passages = [json.loads(line)["text"] for line in (data / "passages.jsonl").read_text().splitlines() if line]
    chats = [json.loads(line)["messages"] for line in (data / "chat.jsonl").read_text().splitlines() if line]
    texts = passages + [m["content"] for c in chats for m in c]
    got = raw.encode_batch(texts, add_special_tokens=False)
    bad = sum(g.ids != enc.encode(t, disallowed_special=()) for g, t in zip(got, texts))
    check(bad == 0, f"= tiktoken (Meta's BPE, pattern) on all {len(passages)} transfer passages and "
                    f"{len(texts) - len(passages)} chat messages")
    prompts = [ours.apply_chat_template(c, add_generation_prompt=False) for c in chats[:200]]
    bad = sum(raw.encode(p, add_special_tokens=False).ids != enc.encode(p, allowed_special="all") for p in prompts)
    check(bad == 0, "= tiktoken on 200 rendered chat prompts (special markers included)")
    first = raw.encode(prompts[0], add_special_tokens=False).ids
    check(first[:4] == [128000, 128006, 9125, 128007] and first[-1] == 128009,
          "chat template renders <|begin_of_text|><|start_header_id|>system<|end_header_id|>...<|eot_id|>")

    # llama.cpp's Llama-3 vocabulary (converted from HF's Meta-Llama-3 tokenizer.json) and its reference encodings
    import gguf
    reader = gguf.GGUFReader(str(src["vocab"]))
    field = lambda k: reader.fields[k].contents()  # noqa: E731
    vtokens, vmerges = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges")
    vocab = raw.get_vocab(with_added_tokens=True)
    inv = {i: t for t, i in vocab.items()}
    check(all(inv.get(i) == t for i, t in enumerate(vtokens[:128000])), "all 128000 BPE tokens = llama.cpp's "
          "Llama-3 vocabulary, id for id")
    merges = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    check(merges == list(vmerges), f"all {len(merges)} merges = llama.cpp's, in order")
    check(all(vtokens[i] == inv[i] for i in (128000, 128001, 128006, 128007, 128009)),
          "the specials Llama 3.0 and 3.1 share have llama.cpp's names")
    inputs = src["inp"].read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    outputs = src["out"].read_text(encoding="utf-8").split("\n")[: len(inputs)]
    want = [[int(x) for x in line.split()] for line in outputs]
    got = [raw.encode(t, add_special_tokens=False).ids for t in inputs]
    check(len(inputs) > 30 and got == want, f"llama.cpp's {len(inputs)} reference encodings (made with HF's "
                                            "tokenizer) reproduced")

    # transformers' AutoTokenizer (the oracle of tests/test_tokenizer.py) on the folder
    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(str(d))
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEST_SENTENCE[0]}]
        ids = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, date_string="26 Jul 2024")
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        mine = ours.encode(ours.apply_chat_template(chat, add_generation_prompt=True, date_string="26 Jul 2024"),
                           add_bos=False)
        check(hf(TEST_SENTENCE[0])["input_ids"] == TEST_SENTENCE[1] and list(ids) == mine,
              "transformers' AutoTokenizer on the folder: same ids, same chat prompt ids")
    except ImportError:
        report.append("--  transformers not importable: AutoTokenizer check skipped")

    lengths = sorted(len(g.ids) for g in raw.encode_batch(passages, add_special_tokens=False))
    q = statistics.quantiles(lengths, n=10)
    report.append(f"--  transfer passages: mean {statistics.mean(lengths):.0f} tokens, 10th-90th percentile "
                  f"{q[0]:.0f}-{q[-1]:.0f} (the SmolLM2 tokenizer: 254, 126-381)")
    return report
