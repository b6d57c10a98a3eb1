"""Row formats: turn one raw row into `{"tokens", "labels"}` (labels -100 where no loss is taken).

`text` (plain completion), `instruct` (Alpaca columns) and `chat` (`messages` or ShareGPT `conversations`).
All go through `tokenize_segments`, which tokenizes the rendered text once and maps the trained character
spans (responses) to token positions. With `prompt_only` (an on-policy prompt set, never training data) an
instruct/chat row without a response is its prompt alone: rendered up to where the response would start, no target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError

if TYPE_CHECKING:  # runtime import would pull in llm_recipe.components.models (torch) for nothing
    from ..models.tokenizer import Tokenizer

IGNORE_INDEX = -100

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool"}


class RowError(ValueError):
    """A row is malformed; `build_dataset` prefixes the row's location and raises RecipeError."""


def _segment_boundaries(tok: Tokenizer, text: str, cuts: Sequence[int], ids: list[int]) -> list[int] | None:
    """Token index of each character cut in `text`, or None if no exact mapping exists.

    First try prefix stability (encode(text[:cut]) is a prefix of encode(text)); failing that, map characters
    to tokens by decoding prefixes (valid when decode(encode(text)) == text, e.g. byte-level BPE).
    """
    bounds: list[int] = []
    stable = True
    for cut in cuts:
        prefix = tok.encode(text[:cut], add_bos=True)
        if ids[: len(prefix)] != prefix:
            stable = False
            break
        bounds.append(len(prefix))
    if stable:
        return bounds
    if tok.decode(ids, skip_special_tokens=False) != _with_bos_text(tok, ids, text):
        return None
    # Character offsets: the smallest k whose decoded prefix covers `cut` characters. A token straddling the
    # cut is counted on the side after the cut (so a response never loses its first token).
    bounds = []
    for cut in cuts:
        target = len(_with_bos_text(tok, ids, text[:cut]))
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(ids[:mid], skip_special_tokens=False)) >= target:
                hi = mid
            else:
                lo = mid + 1
        if lo > 0 and len(tok.decode(ids[:lo], skip_special_tokens=False)) > target:
            lo -= 1
        bounds.append(lo)
    return bounds


def _with_bos_text(tok: Tokenizer, ids: list[int], text: str) -> str:
    """The text decode() returns for encode(text, add_bos=True): the BOS token string when one was prepended."""
    bos = getattr(tok, "bos_token", None)
    if ids and tok.bos_id is not None and ids[0] == tok.bos_id and bos and not text.startswith(bos):
        return bos + text
    return text


def tokenize_segments(tok: Tokenizer, segments: Sequence[tuple[str, bool]], add_eos: bool = True,
                      train_on_input: bool = False) -> dict[str, list[int]]:
    """Tokens of the concatenated segments; labels = tokens on segments flagged True (all if train_on_input).

    The text is tokenized once, as a whole, so tokens equal what the model sees at inference time. EOS is
    appended unless the text already ends with it (chat templates that close turns with the EOS token).
    """
    text = "".join(s for s, _ in segments)
    eos_tok = getattr(tok, "eos_token", None)
    stripped = text.rstrip()
    ends_with_eos = bool(eos_tok) and stripped.endswith(eos_tok)
    if ends_with_eos:  # drop whitespace after a final eos so the sequence really ends on it
        text = stripped
    ids = tok.encode(text, add_bos=True)
    cuts, acc = [], 0
    for s, _ in segments:
        acc = min(acc + len(s), len(text))
        cuts.append(acc)
    bounds = _segment_boundaries(tok, text, cuts[:-1], ids)
    if bounds is None:
        # Neither prefix-stable nor reversible: tokenize segment by segment (exact labels, tokens may differ
        # slightly from whole-text tokenization at the cuts).
        ids, bounds, start = [], [], 0
        for i, cut in enumerate(cuts):
            ids += tok.encode(text[start:cut], add_bos=(i == 0))
            bounds.append(len(ids))
            start = cut
        bounds = bounds[:-1]
    labels = [IGNORE_INDEX] * len(ids)
    starts = [0, *bounds]
    ends = [*bounds, len(ids)]
    for (_, trained), lo, hi in zip(segments, starts, ends):
        if trained or train_on_input:
            labels[lo:hi] = ids[lo:hi]
    if add_eos and not ends_with_eos and (not ids or ids[-1] != tok.eos_id):
        ids.append(tok.eos_id)
        labels.append(tok.eos_id if (segments[-1][1] or train_on_input) else IGNORE_INDEX)
    return {"tokens": ids, "labels": labels}


def prompt_only_row(tok: Tokenizer, prompt: str) -> dict[str, list[int]]:
    """A prompt-only row: the rendered prompt's tokens (BOS first, as a training row's; no EOS: the response
    follows) and no target, so its prompt is all of it."""
    ids = tok.encode(prompt, add_bos=True)
    return {"tokens": ids, "labels": [IGNORE_INDEX] * len(ids)}


def _column(row: Mapping, column_map: Mapping[str, str], key: str, required: bool = True) -> Any:
    col = column_map.get(key, key)
    if col not in row or row[col] is None:
        if required:
            mapped = f" (mapped from '{key}')" if col != key else ""
            if col in row:  # a table's empty cell (parquet, a HF dataset) or a JSON null
                raise RowError(f"column '{col}'{mapped} has no value")
            raise RowError(f"missing column '{col}'{mapped}; row has {', '.join(map(str, row)) or 'no columns'}")
        return None
    return row[col]


def _string(row: Mapping, column_map: Mapping[str, str], key: str, required: bool = True) -> str:
    v = _column(row, column_map, key, required)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise RowError(f"column '{column_map.get(key, key)}' must be a string, got {type(v).__name__}")
    return v


class TextFormat:
    """Plain completion from a `text` column; loss on every token."""

    def __init__(self, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None) -> None:
        self.tok = tokenizer
        self.column_map = dict(column_map or {})

    def __call__(self, row: Mapping) -> dict[str, list[int]]:
        """Tokenize one row."""
        text = _string(row, self.column_map, "text")
        if not text.strip():
            raise RowError(f"column '{self.column_map.get('text', 'text')}' is empty")
        return tokenize_segments(self.tok, [(text, True)])


class InstructFormat:
    """Alpaca-style `instruction` / `input` (optional) / `output`; loss on the output unless train_on_input.
    `prompt_only`: a row with no output (missing, null or blank) is its prompt alone (`prompt_only_row`)."""

    def __init__(self, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None,
                 train_on_input: bool = False, use_chat_template: bool = False, prompt_only: bool = False) -> None:
        self.tok = tokenizer
        self.column_map = dict(column_map or {})
        self.train_on_input = train_on_input
        self.use_chat_template = use_chat_template
        self.prompt_only = prompt_only

    def __call__(self, row: Mapping) -> dict[str, list[int]]:
        """Tokenize one row."""
        instruction = _string(row, self.column_map, "instruction")
        inp = _string(row, self.column_map, "input", required=False)
        output = _string(row, self.column_map, "output", required=not self.prompt_only)
        if not instruction.strip():
            raise RowError(f"column '{self.column_map.get('instruction', 'instruction')}' is empty")
        if not output.strip() and not self.prompt_only:
            raise RowError(f"column '{self.column_map.get('output', 'output')}' is empty")
        if self.use_chat_template:
            user = instruction + ("\n\n" + inp if inp.strip() else "")
            if not output.strip():
                return prompt_only_row(self.tok, self.tok.apply_chat_template([{"role": "user", "content": user}],
                                                                              add_generation_prompt=True, fixed_date=True))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            segments = chat_segments(self.tok, messages)
        else:
            tmpl = ALPACA_PROMPT if inp.strip() else ALPACA_PROMPT_NO_INPUT
            if not output.strip():
                return prompt_only_row(self.tok, tmpl.format(instruction=instruction, input=inp))
            segments = [(tmpl.format(instruction=instruction, input=inp), False), (output, True)]
        return tokenize_segments(self.tok, segments, train_on_input=self.train_on_input)


def normalize_messages(raw: Any, column: str, need_assistant: bool = True) -> list[dict[str, str]]:
    """`messages` ({role, content}) or ShareGPT ({from, value}) turns -> list of {role, content}; without an
    assistant turn an error unless `need_assistant` is false (a prompt)."""
    if not isinstance(raw, list) or not raw:
        raise RowError(f"column '{column}' must be a non-empty list of turns, got {type(raw).__name__}"
                       + (" (empty)" if isinstance(raw, list) else ""))
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, Mapping):
            raise RowError(f"{column}[{i}] must be an object with role/content, got {type(turn).__name__}")
        if "role" in turn:
            role, content = turn.get("role"), turn.get("content")
        elif "from" in turn:
            role, content = SHAREGPT_ROLES.get(str(turn.get("from"))), turn.get("value")
            if role is None:
                raise RowError(f"{column}[{i}].from is '{turn.get('from')}'; expected one of "
                               + ", ".join(SHAREGPT_ROLES))
        else:
            raise RowError(f"{column}[{i}] has neither role/content nor from/value keys")
        if role not in ("system", "user", "assistant", "tool"):
            raise RowError(f"{column}[{i}].role is '{role}'; expected system, user, assistant or tool")
        if not isinstance(content, str):
            raise RowError(f"{column}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise RowError(f"column '{column}' has no assistant turn to train on")
    return out


def chat_segments(tok: Tokenizer, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """Split the rendered conversation into (text, is_assistant) pieces by rendering growing prefixes.

    For each assistant turn i: render(messages[:i], generation prompt) ends the prompt part, render(messages[:i+1])
    ends the assistant part. Templates whose renders are not prefixes of each other are rejected.
    """
    full = tok.apply_chat_template(messages, fixed_date=True)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], add_generation_prompt=True, fixed_date=True) if i else ""
        upto = tok.apply_chat_template(messages[: i + 1], fixed_date=True)
        if not (full.startswith(upto) and upto.startswith(before) and len(before) >= pos):
            raise RowError("the chat template does not render conversations prefix-consistently (turn "
                           f"{i}); assistant spans cannot be located, use train_on_input: true or another model")
        if len(before) > pos:
            segments.append((full[pos:len(before)], False))
        segments.append((full[len(before):len(upto)], True))
        pos = len(upto)
    if pos < len(full):
        segments.append((full[pos:], False))
    return segments


class ChatFormat:
    """Conversations rendered with the model's chat template; loss only on assistant turns by default.
    `prompt_only`: a conversation that does not end in an assistant turn (GKD's prompt-only input) is its prompt
    alone: all of it, rendered with the generation prompt (`prompt_only_row`)."""

    def __init__(self, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None,
                 train_on_input: bool = False, prompt_only: bool = False) -> None:
        self.tok = tokenizer
        self.column_map = dict(column_map or {})
        self.train_on_input = train_on_input
        self.prompt_only = prompt_only

    def __call__(self, row: Mapping) -> dict[str, list[int]]:
        """Tokenize one row."""
        if "messages" in self.column_map or "messages" in row:
            col = self.column_map.get("messages", "messages")
        else:
            col = self.column_map.get("conversations", "conversations")
        if col not in row:
            raise RowError(f"missing column '{col}' (expected 'messages' or ShareGPT 'conversations'); "
                           f"row has {', '.join(map(str, row)) or 'no columns'}")
        messages = normalize_messages(row[col], col, need_assistant=not self.prompt_only)
        if any(not m["content"].strip() for m in messages if m["role"] == "assistant"):
            raise RowError(f"column '{col}' has an empty assistant turn")
        if self.prompt_only and messages[-1]["role"] != "assistant":
            if not messages[-1]["content"].strip():
                raise RowError(f"column '{col}' ends in an empty {messages[-1]['role']} turn: no prompt to answer")
            return prompt_only_row(self.tok, self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                                  fixed_date=True))
        segments = chat_segments(self.tok, messages)
        if not any(trained and text.strip() for text, trained in segments):
            raise RowError(f"column '{col}' is empty after applying the chat template")
        return tokenize_segments(self.tok, segments, train_on_input=self.train_on_input)


FORMATS = ("text", "instruct", "chat")


# The columns each format reads: the keys a `column_map` may name (format's name -> the user's column)
FORMAT_COLUMNS = {"text": ("text",), "instruct": ("instruction", "input", "output"),
                  "chat": ("messages", "conversations")}


def column_map_problem(format: str, column_map: Mapping[str, str] | None) -> str | None:
    """Why `column_map` cannot be meant for `format`, or None: a key the format does not read (a reversed mapping,
    `{response: output}`, was ignored and the run then failed on a missing 'output' column)."""
    reads = FORMAT_COLUMNS.get(format)
    unknown = [k for k in (column_map or {}) if reads is not None and k not in reads]
    if not unknown:
        return None
    key, value = unknown[0], column_map[unknown[0]]
    hint = f"; reversed? {{{value}: {key}}}" if value in reads else ""
    return (f"'{key}' is not a column the {format} format reads ({', '.join(reads)}): column_map maps the "
            f"format's name to your column's ({{{reads[-1]}: my_column}} reads '{reads[-1]}' from column "
            f"'my_column'){hint}")


def make_format(format: str, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None,
                train_on_input: bool = False, use_chat_template: bool = False, prompt_only: bool = False) -> Any:
    """The row -> tokens callable for a format name (`prompt_only`: instruct/chat rows may lack a response)."""
    problem = column_map_problem(format, column_map)
    if problem is not None:
        raise RecipeError(f"dataset.column_map: {problem}")
    if format == "text":
        return TextFormat(tokenizer, column_map)
    if format == "instruct":
        return InstructFormat(tokenizer, column_map, train_on_input, use_chat_template, prompt_only)
    if format == "chat":
        return ChatFormat(tokenizer, column_map, train_on_input, prompt_only)
    raise RecipeError(f"dataset.format '{format}' is not one of {', '.join(FORMATS)}")
