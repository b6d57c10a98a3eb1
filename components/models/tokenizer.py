"""Tokenizer for a Hugging Face checkpoint folder, without transformers at runtime.

Reads `tokenizer.json` with the `tokenizers` library, the special tokens, BOS policy and chat template from
`tokenizer_config.json` (and `chat_template.jinja`), and end-of-sequence ids from `generation_config.json`.
Ids and chat-template text match `transformers.AutoTokenizer` on the same folder (see tests/test_tokenizer.py).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from ..errors import RecipeError, read_utf8

# End-of-turn markers of the common chat formats (ChatML, Llama 3, Phi-3, Gemma). Generation stops on any
# of them that exists in the vocabulary, besides the eos ids the checkpoint declares.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON ({e}); re-export the tokenizer files") from e


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` blocks (used by some HF templates); render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like HF: jinja's own tojson HTML-escapes, which would change prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# The date training data renders with (`apply_chat_template(fixed_date=True)`): the one Llama 3.x templates print
# when no clock is given.
FIXED_DATE = datetime(2024, 7, 26)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment settings as transformers so that templates render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode/decode text and render chat prompts for one checkpoint folder."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict, generation_config: dict | None = None,
                 chat_template: str | None = None, source: str = "<memory>") -> None:
        self._tok = tokenizer
        self._config = config
        self._source = source
        self._chat_template_src = chat_template
        self._chat_template: jinja2.Template | None = None

        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))

        gen_eos = (generation_config or {}).get("eos_token_id")
        gen_eos_ids = [gen_eos] if isinstance(gen_eos, int) else [int(i) for i in (gen_eos or [])]

        self.bos_id: int | None = self._id_of(self.bos_token)
        eos_id = self._id_of(self.eos_token)
        if eos_id is None and gen_eos_ids:
            eos_id = gen_eos_ids[0]
            self.eos_token = tokenizer.id_to_token(eos_id)
        if eos_id is None:
            raise RecipeError(f"{source}: no eos_token in tokenizer_config.json or generation_config.json; add one")
        self.eos_id: int = eos_id
        pad_id = self._id_of(self.pad_token)
        self.pad_id: int = self.eos_id if pad_id is None else pad_id

        stops = [self.eos_id, *gen_eos_ids]
        stops += [i for i in (tokenizer.token_to_id(t) for t in _END_OF_TURN_TOKENS) if i is not None]
        self.stop_ids: list[int] = list(dict.fromkeys(stops))

        self.add_bos_token: bool = self._resolve_add_bos()
        self.add_eos_token: bool = bool(config.get("add_eos_token", False))
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, `generation_config.json`)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise RecipeError(f"{tok_file}: missing; the model folder needs a fast-tokenizer tokenizer.json")
        try:
            tokenizer = _HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise RecipeError(f"{tok_file}: cannot be parsed by the tokenizers library ({e})") from e
        cfg_file = path / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else None
        template = None
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = read_utf8(jinja_file)
        else:
            template = config.get("chat_template")
            if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default") or next(iter(named.values()), None)
        return cls(tokenizer, config, gen, template, source=str(path))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _resolve_add_bos(self) -> bool:
        """Whether `encode(add_bos=True)` prepends BOS: tokenizer_config's flag, else what the post-processor does."""
        flag = self._config.get("add_bos_token")
        if flag is not None:
            return bool(flag) and self.bos_id is not None
        if self.bos_id is None:
            return False
        probe = "a"
        with_special = self._tok.encode(probe, add_special_tokens=True).ids
        without = self._tok.encode(probe, add_special_tokens=False).ids
        return len(with_special) > len(without) and with_special[0] == self.bos_id

    # ------------------------------------------------------------------ API
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`. BOS is prepended only if the model uses one (and not twice); EOS if asked."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.add_bos_token and not (ids and ids[0] == self.bos_id):
            ids.insert(0, self.bos_id)  # type: ignore[arg-type]
        if add_eos and not (ids and ids[-1] == self.eos_id):
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (eos, chat markers) are dropped unless `skip_special_tokens=False`."""
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            # HF's clean_up_tokenization (only when the checkpoint asks for it).
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (None when absent)."""
        return self._tok.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return bool(self._chat_template_src)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            fixed_date: bool = False, **kwargs: Any) -> str:
        """Render `messages` with the checkpoint's jinja chat template, exactly as HF's `tokenize=False` does.
        `fixed_date`: templates that print today's date (Llama 3.x: "Today Date: ..." via `strftime_now`) print
        `FIXED_DATE` instead, so that training data tokenizes the same on every day (a logits cache, a resumed run,
        a kill-and-rerun build all compare the tokenized data)."""
        if not self._chat_template_src:
            raise RecipeError(
                f"{self._source}: the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja);"
                " use a chat model or a dataset format without a chat template"
            )
        if self._chat_template is None:
            self._chat_template = _compile_template(self._chat_template_src)
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        if fixed_date:
            variables["strftime_now"] = FIXED_DATE.strftime
        variables.update(kwargs)
        return self._chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          **variables)


def check_tokenizer_fits(model_dir: str | os.PathLike, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
    """A model whose embedding has fewer rows (config.json `vocab_size`) than its tokenizer has ids cannot read the
    tokens it is given: say so before any forward pass (it would end in an IndexError deep in the model)."""
    if vocab_size is None:
        from .args import read_model_args

        vocab_size = read_model_args(model_dir).vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise RecipeError(f"{model_dir}/config.json: vocab_size={vocab_size} is smaller than its tokenizer's "
                          f"vocabulary ({tokenizer.vocab_size} in tokenizer.json): the model cannot read the tokens "
                          "its tokenizer makes")
