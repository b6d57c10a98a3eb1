"""Row formats: turn one raw row into `{"tokens", "labels"}` (labels -100 where no loss is taken).

`text` (plain completion), `instruct` (Alpaca columns) and `chat` (`messages` or ShareGPT `conversations`).
All go through `tokenize_segments`, which tokenizes the rendered text once and maps the trained character
spans (responses) to token positions. With `prompt_only` (an on-policy prompt set, never training data) an
instruct/chat row without a response is its prompt alone: rendered up to where the response would start, no target.

With `max_tokens` (the dataset's max_seq_len) a row far longer than that is not tokenized whole: only a character
prefix a little past the cut is (`_prefix_tokens`), the kept tokens and labels are those the whole text gives, and
the row says an estimate of the target tokens past the cut (`lost_targets_estimate`) instead of its full tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

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


# Bounded tokenization of over-long rows. A tokenizer's output for the start of a text depends on the text's end
# only near that end: a pre-tokenizer (byte-level BPE's regex: GPT-2, Llama 3, SmolLM2, Qwen) splits the text into
# words tokenized independently, and a prefix differs from the whole text only in its last word or two (a whitespace
# run or a word cut short); a normalizer such as NFC acts on a character and its combining marks. So the tokens of a
# character prefix equal the whole text's except for the last few, and MARGIN_TOKENS of them are thrown away: a word
# of up to 256 tokens (a long URL, an indentation run, a base64 blob) may straddle the prefix's end without changing a
# kept token. Not every tokenizer is proven local (a BPE without a pre-tokenizer, Unigram): `_prefix_tokens` therefore
# also tokenizes a second, longer prefix and keeps the result only where the two agree, and falls back to the whole
# text when they do not.
MARGIN_TOKENS = 256
# First guess at the characters per token, to size the first prefix. English BPE averages ~4-5, code ~3, CJK ~1-2;
# 6 covers English and code in one pass. A text denser in characters (long whitespace or repeated-symbol tokens)
# doubles the prefix until it has enough tokens, so the largest prefix is under 2 * 9/8 * max(6, L) * (need + margin)
# characters past the last segment's start, L the vocabulary's longest token in characters: bounded by max_seq_len
# (and the prompt's length), never by the response's.
CHARS_PER_TOKEN_GUESS = 6
# The second prefix runs 1/8 longer than the first (1/8 of its part past the last segment's start, so a long prompt
# does not lengthen it): its end falls 40+ tokens later (1/8 of at least 6 * MARGIN_TOKENS characters), in another word.
CHECK_EXTRA_FRACTION = 8


class _Prefix(NamedTuple):
    """Leading tokens of a text that equal the whole text's, and the prefix they came from (for the tail estimate)."""

    ids: list[int]  # the whole text's first len(ids) tokens (BOS included)
    chars: int  # characters tokenized (the longer, checking prefix)
    tokens: int  # tokens that prefix gave


def _prefix_tokens(tok: Tokenizer, text: str, need: int, start: int = 0) -> _Prefix | None:
    """The whole text's first `need` (or more) tokens from a character prefix reaching past `start`, or None when
    the text is too short for a prefix to save work, or two prefixes disagree (the caller tokenizes it whole)."""
    n = max(start + CHARS_PER_TOKEN_GUESS * MARGIN_TOKENS, CHARS_PER_TOKEN_GUESS * (need + MARGIN_TOKENS))
    while n < len(text):
        ids = tok.encode(text[:n], add_bos=True)
        if len(ids) >= need + MARGIN_TOKENS:
            return _checked_prefix(tok, text, n, ids, start)
        n *= 2  # fewer tokens than guessed (long tokens): a longer prefix
    return None


def _checked_prefix(tok: Tokenizer, text: str, n: int, ids: list[int], start: int) -> _Prefix | None:
    """`ids` (of text[:n]) less its last MARGIN_TOKENS, if a prefix ending elsewhere, longer by 1/8 of n - start,
    starts with the same tokens: the end of the prefix did not reach them. None when it does not (or the text ends
    before)."""
    longer = n + (n - start) // CHECK_EXTRA_FRACTION
    if longer >= len(text):
        return None
    kept = len(ids) - MARGIN_TOKENS
    check = tok.encode(text[:longer], add_bos=True)
    if check[:kept] != ids[:kept]:
        return None
    return _Prefix(ids[:kept], longer, len(check))


def _joined(tok: Tokenizer, segments: Sequence[tuple[str, bool]]) -> tuple[str, bool]:
    """The segments' text and whether it ends with the EOS token (whitespace after a final EOS dropped, so the
    sequence really ends on it: chat templates that close turns with the EOS token)."""
    text = "".join(s for s, _ in segments)
    eos_tok = getattr(tok, "eos_token", None)
    stripped = text.rstrip()
    if bool(eos_tok) and stripped.endswith(eos_tok):
        return stripped, True
    return text, False


def _labels(ids: list[int], segments: Sequence[tuple[str, bool]], bounds: Sequence[int],
            train_on_input: bool) -> list[int]:
    """Labels of `ids`: the token on trained segments (all if train_on_input), IGNORE_INDEX elsewhere."""
    labels = [IGNORE_INDEX] * len(ids)
    for (_, trained), lo, hi in zip(segments, [0, *bounds], [*bounds, len(ids)]):
        if trained or train_on_input:
            labels[lo:hi] = ids[lo:hi]
    return labels


def tokenize_segments(tok: Tokenizer, segments: Sequence[tuple[str, bool]], add_eos: bool = True,
                      train_on_input: bool = False, max_tokens: int | None = None) -> dict[str, Any]:
    """Tokens of the concatenated segments; labels = tokens on segments flagged True (all if train_on_input).

    The text is tokenized once, as a whole, so tokens equal what the model sees at inference time. EOS is
    appended unless the text already ends with it (chat templates that close turns with the EOS token).
    `max_tokens`: a row far longer is cut there without tokenizing its tail (`_cut_row`).
    """
    text, ends_with_eos = _joined(tok, segments)
    cuts, acc = [], 0
    for s, _ in segments:
        acc = min(acc + len(s), len(text))
        cuts.append(acc)
    if max_tokens is not None:
        row = _cut_row(tok, segments, text, cuts, max_tokens, train_on_input, add_eos and not ends_with_eos)
        if row is not None:
            return row
    ids = tok.encode(text, add_bos=True)
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
    labels = _labels(ids, segments, bounds, train_on_input)
    if add_eos and not ends_with_eos and (not ids or ids[-1] != tok.eos_id):
        ids.append(tok.eos_id)
        labels.append(tok.eos_id if (segments[-1][1] or train_on_input) else IGNORE_INDEX)
    return {"tokens": ids, "labels": labels}


def _cut_row(tok: Tokenizer, segments: Sequence[tuple[str, bool]], text: str, cuts: list[int], max_tokens: int,
             train_on_input: bool, eos_follows: bool) -> dict[str, Any] | None:
    """The first `max_tokens` tokens and labels `tokenize_segments` gives a row longer than that, from a prefix of
    its text, with `lost_targets_estimate`; None where the whole text must be tokenized (a short row, a cut the
    prefix cannot place exactly).

    Exact only on the whole-text path's prefix-stable branch: every segment start's own tokens begin the text's
    (checked here on the prefix, which reaches past the last segment's start); otherwise None, and the whole-text
    path maps the cuts its own way. Only the last segment (a response) is cut, so a long prompt is still tokenized
    to its end, as the cut checks need.
    """
    start = cuts[-2] if len(cuts) > 1 else 0
    pre = _prefix_tokens(tok, text, max_tokens + 1, start)  # +1: the row surely has more than max_tokens
    if pre is None:
        return None
    prefixes = [tok.encode(text[:c], add_bos=True) for c in cuts[:-1]]
    need = max([max_tokens + 1, *map(len, prefixes)])
    if need > len(pre.ids):  # the prompt alone is longer than the prefix's trusted tokens
        pre = _prefix_tokens(tok, text, need, start)
        if pre is None:
            return None
    if any(pre.ids[: len(p)] != p for p in prefixes):
        return None
    labels = _labels(pre.ids, segments, [len(p) for p in prefixes], train_on_input)
    lost = sum(lab != IGNORE_INDEX for lab in labels[max_tokens:])  # tokenized past the cut: exact
    if segments[-1][1] or train_on_input:  # the rest of the last segment, at this row's own tokens per character
        lost += round(pre.tokens - len(pre.ids) + (len(text) - pre.chars) * pre.tokens / pre.chars + eos_follows)
    return {"tokens": pre.ids[:max_tokens], "labels": labels[:max_tokens], "lost_targets_estimate": lost}


def prompt_only_row(tok: Tokenizer, prompt: str, max_tokens: int | None = None) -> dict[str, Any]:
    """A prompt-only row: the rendered prompt's tokens (BOS first, as a training row's; no EOS: the response
    follows) and no target, so its prompt is all of it. `max_tokens`: a far longer prompt is cut without
    tokenizing its tail (no target is lost)."""
    pre = _prefix_tokens(tok, prompt, max_tokens + 1) if max_tokens is not None else None
    if pre is not None:
        ids = pre.ids[:max_tokens]
        return {"tokens": ids, "labels": [IGNORE_INDEX] * len(ids), "lost_targets_estimate": 0}
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
    """Plain completion from a `text` column; loss on every token. `max_tokens`: cut a longer row there without
    tokenizing its tail (`tokenize_segments`)."""

    def __init__(self, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None,
                 max_tokens: int | None = None) -> None:
        self.tok = tokenizer
        self.column_map = dict(column_map or {})
        self.max_tokens = max_tokens

    def __call__(self, row: Mapping) -> dict[str, list[int]]:
        """Tokenize one row."""
        text = _string(row, self.column_map, "text")
        if not text.strip():
            raise RowError(f"column '{self.column_map.get('text', 'text')}' is empty")
        return tokenize_segments(self.tok, [(text, True)], max_tokens=self.max_tokens)


class InstructFormat:
    """Alpaca-style `instruction` / `input` (optional) / `output`; loss on the output unless train_on_input.
    `prompt_only`: a row with no output (missing, null or blank) is its prompt alone (`prompt_only_row`).
    `max_tokens`: cut a longer row there without tokenizing its output's tail (`tokenize_segments`)."""

    def __init__(self, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None,
                 train_on_input: bool = False, use_chat_template: bool = False, prompt_only: bool = False,
                 max_tokens: int | None = None) -> None:
        self.tok = tokenizer
        self.column_map = dict(column_map or {})
        self.train_on_input = train_on_input
        self.use_chat_template = use_chat_template
        self.prompt_only = prompt_only
        self.max_tokens = max_tokens

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
                                                                              add_generation_prompt=True, fixed_date=True),
                                       self.max_tokens)
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
            segments = chat_segments(self.tok, messages)
        else:
            tmpl = ALPACA_PROMPT if inp.strip() else ALPACA_PROMPT_NO_INPUT
            if not output.strip():
                return prompt_only_row(self.tok, tmpl.format(instruction=instruction, input=inp), self.max_tokens)
            segments = [(tmpl.format(instruction=instruction, input=inp), False), (output, True)]
        return tokenize_segments(self.tok, segments, train_on_input=self.train_on_input, max_tokens=self.max_tokens)


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
    alone: all of it, rendered with the generation prompt (`prompt_only_row`). `max_tokens`: cut a longer row
    there without tokenizing its last turn's tail (`tokenize_segments`)."""

    def __init__(self, tokenizer: Tokenizer, column_map: Mapping[str, str] | None = None,
                 train_on_input: bool = False, prompt_only: bool = False, max_tokens: int | None = None) -> None:
        self.tok = tokenizer
        self.column_map = dict(column_map or {})
        self.train_on_input = train_on_input
        self.prompt_only = prompt_only
        self.max_tokens = max_tokens

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
                                                                                  fixed_date=True), self.max_tokens)
        segments = chat_segments(self.tok, messages)
        if not any(trained and text.strip() for text, trained in segments):
            raise RowError(f"column '{col}' is empty after applying the chat template")
        return tokenize_segments(self.tok, segments, train_on_input=self.train_on_input, max_tokens=self.max_tokens)


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
                train_on_input: bool = False, use_chat_template: bool = False, prompt_only: bool = False,
                max_tokens: int | None = None) -> Any:
    """The row -> tokens callable for a format name (`prompt_only`: instruct/chat rows may lack a response;
    `max_tokens`: rows are cut there, a far longer one without tokenizing its tail)."""
    problem = column_map_problem(format, column_map)
    if problem is not None:
        raise RecipeError(f"dataset.column_map: {problem}")
    if format == "text":
        return TextFormat(tokenizer, column_map, max_tokens)
    if format == "instruct":
        return InstructFormat(tokenizer, column_map, train_on_input, use_chat_template, prompt_only, max_tokens)
    if format == "chat":
        return ChatFormat(tokenizer, column_map, train_on_input, prompt_only, max_tokens)
    raise RecipeError(f"dataset.format '{format}' is not one of {', '.join(FORMATS)}")
