"""Rows far longer than max_seq_len: only a prefix is tokenized, the kept tokens and labels are exactly the whole
text's, and the truncation warning says its estimate as one."""

from __future__ import annotations

import json
import random
import re

import pytest

from llm_recipe.components.data import IGNORE_INDEX, build_dataset, tokenize_segments, transfer_set_path
from llm_recipe.components.data.formats import (
    ALPACA_PROMPT,
    CHARS_PER_TOKEN_GUESS,
    CHECK_EXTRA_FRACTION,
    MARGIN_TOKENS,
    _prefix_tokens,
    make_format,
    prompt_only_row,
)
from llm_recipe.components.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol(embedded_tokenizer_dir) -> Tokenizer:
    """SmolLM2's real tokenizer (byte-level BPE with a digit splitter) and chat template."""
    return Tokenizer.from_dir(embedded_tokenizer_dir)


@pytest.fixture(scope="module")
def prose() -> str:
    """About 2.9 MB of real English passages (the shipped transfer set), one after another."""
    with open(transfer_set_path("passages"), encoding="utf-8") as f:
        return "\n\n".join(json.loads(line)["text"] for line in f)


def first_prefix(k: int) -> int:
    """Characters of the first prefix a text row cut at `k` tokens is tokenized from (formats._prefix_tokens)."""
    return CHARS_PER_TOKEN_GUESS * (k + 1 + MARGIN_TOKENS)


def one_pass_bound(k: int) -> int:
    """Longest string a row cut at `k` tokens sends to the tokenizer when the first prefix has enough tokens."""
    n = first_prefix(k)
    return n + n // CHECK_EXTRA_FRACTION


def record_encodes(tok: Tokenizer, monkeypatch) -> list[int]:
    """Wrap `tok.encode` to record the length of every string it is given."""
    lengths: list[int] = []
    encode = tok.encode

    def recording(text: str, *args, **kwargs) -> list[int]:
        lengths.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", recording)
    return lengths


def assert_same_as_whole(tok: Tokenizer, segments: list[tuple[str, bool]], k: int, **keys) -> dict:
    """The row cut at `k` equals the whole-text path's first `k` tokens and labels; returns the cut row."""
    cut = tokenize_segments(tok, segments, max_tokens=k, **keys)
    whole = tokenize_segments(tok, segments, **keys)
    assert cut["tokens"][:k] == whole["tokens"][:k]
    assert cut["labels"][:k] == whole["labels"][:k]
    if "lost_targets_estimate" in cut:  # the bounded path: nothing past the cut comes back
        assert len(cut["tokens"]) == len(cut["labels"]) == k < len(whole["tokens"])
    return cut


def mixed_text(seed: int, chars: int) -> str:
    """Words of several scripts, combining accents, emoji, digits and whitespace runs (spaces, tabs, newlines,
    no-break spaces) of every length up to 300."""
    rng = random.Random(seed)
    words = ["naïve", "e\u0301te\u0301", "日本語の文章", "Привет", "مرحبا", "🙂🚀", "x" * 40, "12345", "über",
             "https://example.org/a/very/long/path?q=1&r=2", "<|im_end|>", "==========", "\u00a0\u00a0"]
    spaces = [" ", "  ", "\t", "\n", "\n\n", "\u00a0", " \t \n"]
    out, size = [], 0
    while size < chars:
        piece = rng.choice(words) if rng.random() < 0.8 else rng.choice(spaces) * rng.randint(1, 300)
        out.append(piece)
        out.append(" ")
        size += len(piece) + 1
    return "".join(out)[:chars]


@pytest.mark.parametrize("k", [16, 300, 2048])
def test_text_rows_around_the_bound_keep_exactly_the_whole_texts_tokens(smol, prose, k):
    """Lengths just under, at and just over the first prefix and the checking prefix, and far past: every kept
    token and label is the whole text's, and the rows longer than the checking prefix took the bounded path."""
    n = first_prefix(k)
    lengths = [n - 1, n, n + 1, one_pass_bound(k) - 1, one_pass_bound(k), one_pass_bound(k) + 1, 2 * n, 7 * n + 3,
               40 * n]
    bounded = 0
    for length in lengths:
        for offset in (0, 1, 997):  # shift the prefix's end through different words
            row = assert_same_as_whole(smol, [(prose[offset : offset + length], True)], k)
            bounded += "lost_targets_estimate" in row
    # every row that reaches past the checking prefix, at every offset (a shorter one is tokenized whole)
    assert bounded == 3 * sum(length > one_pass_bound(k) for length in lengths)


@pytest.mark.parametrize("seed", range(6))
def test_unicode_and_whitespace_runs_at_the_prefix_end_keep_the_whole_texts_tokens(smol, seed):
    """Multi-byte characters, combining marks and whitespace runs (one pre-token each) straddling the prefix's end."""
    k = 200
    text = mixed_text(seed, 60 * first_prefix(k))
    n = first_prefix(k)
    for at in (n - 150, n - 1, n, n + 37, one_pass_bound(k) - 3):  # a 600-character whitespace run ending at `at`
        row = text[: at - 600] + " \t\n\u00a0" * 150 + text[at:]
        assert_same_as_whole(smol, [(row, True)], k)
    assert_same_as_whole(smol, [(text, True)], k)


@pytest.mark.parametrize("seed", range(4))
def test_every_token_a_prefix_vouches_for_is_the_whole_texts(smol, prose, seed):
    """The invariant the cut rests on, past the kept tokens: all tokens `_prefix_tokens` returns (its prefix's less
    the margin) begin the whole text's, with the prefix's end inside words, numbers and whitespace runs."""
    rng = random.Random(seed)
    for text in (prose[rng.randrange(100_000) :][:300_000], mixed_text(seed, 300_000)):
        whole = smol.encode(text, add_bos=True)
        for need in (1, 50, 777, 3000):
            pre = _prefix_tokens(smol, text, need)
            assert pre is not None and len(pre.ids) >= need
            assert pre.ids == whole[: len(pre.ids)]
            assert pre.chars < len(text) and pre.tokens > len(pre.ids)


def test_a_row_of_long_tokens_grows_its_prefix_and_stays_bounded_by_the_longest_token(smol, monkeypatch):
    """A row of spaces gives ~64 characters a token: the first prefix has too few tokens and doubles, but the
    longest string tokenized stays under 2 * 9/8 * L * (k + 1 + margin) characters, L the longest token."""
    k = 64
    longest = max(len(smol.decode([i], skip_special_tokens=False)) for i in range(smol.vocab_size))
    text = " " * 400_000 + "end"
    lengths = record_encodes(smol, monkeypatch)
    row = assert_same_as_whole(smol, [(text, True)], k)
    assert "lost_targets_estimate" in row
    bounded = [n for n in lengths if n < len(text)]
    assert len(bounded) == len(lengths) - 1  # the one whole-text call is assert_same_as_whole's own
    assert max(bounded) > one_pass_bound(k)  # it did grow
    assert max(bounded) <= 2 * (1 + 1 / CHECK_EXTRA_FRACTION) * longest * (k + 1 + MARGIN_TOKENS)


def test_a_far_longer_row_tokenizes_only_a_prefix_bounded_by_max_seq_len(smol, prose, monkeypatch):
    """A 2.9 MB row cut at 2048: no string longer than the checking prefix reaches the tokenizer, and it is read
    at most twice (the prefix and its check), so memory and work follow max_seq_len, not the row."""
    k = 2048
    lengths = record_encodes(smol, monkeypatch)
    row = tokenize_segments(smol, [(prose, True)], max_tokens=k)
    assert len(row["tokens"]) == k and len(prose) > 100 * one_pass_bound(k)
    assert max(lengths) <= one_pass_bound(k)
    assert sum(lengths) <= 2 * one_pass_bound(k)


def test_a_row_just_over_max_seq_len_is_tokenized_whole_and_cut_as_before(smol, prose, monkeypatch):
    """A row a few tokens over the limit is shorter than any prefix worth taking: tokenized once, whole, with every
    token returned (the data loader cuts it and counts its lost tokens exactly)."""
    k = 512
    text = prose[:3000]
    whole = tokenize_segments(smol, [(text, True)])
    assert k < len(whole["tokens"]) < k + MARGIN_TOKENS
    lengths = record_encodes(smol, monkeypatch)
    assert tokenize_segments(smol, [(text, True)], max_tokens=k) == whole
    assert lengths == [len(text)]


@pytest.mark.parametrize("train_on_input", [False, True])
@pytest.mark.parametrize("use_chat_template", [False, True])
def test_instruct_rows_with_a_long_output_keep_the_whole_rows_tokens_and_labels(smol, prose, train_on_input,
                                                                                use_chat_template, monkeypatch):
    """The output is the last segment: it is cut from a prefix, the prompt's labels and the cut stay exact."""
    k = 256
    row = {"instruction": "Summarise the passage.", "input": prose[:500], "output": prose[1000:400_000]}
    cut = make_format("instruct", smol, train_on_input=train_on_input, use_chat_template=use_chat_template,
                      max_tokens=k)
    whole = make_format("instruct", smol, train_on_input=train_on_input, use_chat_template=use_chat_template)
    lengths = record_encodes(smol, monkeypatch)
    got = cut(row)
    assert "lost_targets_estimate" in got and max(lengths) <= 1000 + one_pass_bound(k)
    want = whole(row)
    assert got["tokens"] == want["tokens"][:k] and got["labels"] == want["labels"][:k]
    assert (IGNORE_INDEX in got["labels"]) != train_on_input  # the prompt is masked unless trained on


def test_chat_rows_with_a_long_last_answer_keep_the_whole_rows_tokens_and_labels(smol, prose):
    """Several turns; only the last assistant turn runs past the cut: all earlier spans are located exactly."""
    k = 700
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prose[:300]},
                {"role": "assistant", "content": prose[300:900]}, {"role": "user", "content": "More, please."},
                {"role": "assistant", "content": prose[900:300_000]}]
    got = make_format("chat", smol, max_tokens=k)({"messages": messages})
    want = make_format("chat", smol)({"messages": messages})
    assert "lost_targets_estimate" in got
    assert got["tokens"] == want["tokens"][:k] and got["labels"] == want["labels"][:k]
    assert any(lab == IGNORE_INDEX for lab in got["labels"]) and any(lab != IGNORE_INDEX for lab in got["labels"])


@pytest.mark.parametrize("answer", ["Science.", "long"])
def test_a_prompt_longer_than_max_seq_len_is_exact_and_masked(smol, prose, answer, monkeypatch):
    """The prompt alone runs past the cut: it is tokenized to its end (to place the answer exactly), and the kept
    labels are all masked, as the whole row's are there (build_dataset then drops the row). A short answer leaves
    nothing to save (the row is tokenized whole); a long one is still cut from a prefix a little past the prompt."""
    k = 128
    prompt_chars = 60_000
    output = prose[prompt_chars : prompt_chars + 300_000] if answer == "long" else answer
    row = {"instruction": "Name the topic.", "input": prose[:prompt_chars], "output": output}
    want = make_format("instruct", smol)(row)
    lengths = record_encodes(smol, monkeypatch)
    got = make_format("instruct", smol, max_tokens=k)(row)
    assert got["tokens"][:k] == want["tokens"][:k] and got["labels"][:k] == want["labels"][:k] == [IGNORE_INDEX] * k
    assert ("lost_targets_estimate" in got) == (answer == "long")
    if answer == "long":
        prompt = len(ALPACA_PROMPT.format(instruction=row["instruction"], input=row["input"]))  # the last cut
        assert max(lengths) <= prompt + one_pass_bound(k) < prompt + len(output)


def test_a_cut_inside_a_word_falls_back_to_the_whole_text(smol, prose):
    """A segment boundary that splits a word is not prefix-stable: the whole-text path maps it by decoding, so the
    bounded path steps aside (no estimate) rather than place the boundary its own way."""
    segments = [("Tell me about elec", False), ("tricity. " + prose[:200_000], True)]
    got = assert_same_as_whole(smol, segments, 100)
    assert "lost_targets_estimate" not in got


def test_a_tokenizer_whose_start_depends_on_the_end_is_tokenized_whole(smol, prose, monkeypatch):
    """The check prefix catches a tokenizer that is not local (here its first token depends on the text's length):
    the two prefixes disagree and the row is tokenized whole, so the kept tokens are still the whole text's."""
    encode = smol.encode

    def nonlocal_encode(text: str, *args, **kwargs) -> list[int]:
        ids = encode(text, *args, **kwargs)
        return [len(text) % 1009, *ids[1:]]

    monkeypatch.setattr(smol, "encode", nonlocal_encode)
    text = prose[:100_000]
    got = tokenize_segments(smol, [(text, True)], max_tokens=64)
    assert "lost_targets_estimate" not in got and got["tokens"][0] == len(text) % 1009


def test_a_long_prompt_only_row_is_cut_from_a_prefix(smol, prose, monkeypatch):
    """An on-policy prompt far over the limit: its first tokens, exactly, from a bounded prefix."""
    k = 300
    lengths = record_encodes(smol, monkeypatch)
    got = prompt_only_row(smol, prose[:500_000], max_tokens=k)
    assert max(lengths) <= one_pass_bound(k)
    assert got["tokens"] == smol.encode(prose[:500_000], add_bos=True)[:k] and got["labels"] == [IGNORE_INDEX] * k


def test_the_warning_says_the_lost_tokens_it_did_not_count_are_an_estimate(smol, prose, tmp_path, caplog):
    """A row cut from a prefix has its lost tokens estimated (at its own tokens per character): the warning says
    "about", names how many rows were estimated, and lands within 25% of the exact count on real prose."""
    path = tmp_path / "books.jsonl"
    rows = [{"text": prose[:800_000]}, {"text": prose[900_000:903_000]}, {"text": "a short one"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with caplog.at_level("WARNING"):
        ds = build_dataset(smol, str(path), max_seq_len=512, packed=True)
    assert len(ds) >= 2
    (msg,) = [r.getMessage() for r in caplog.records if "longer than max_seq_len" in r.getMessage()]
    m = re.fullmatch(r"dataset: 2 of 3 rows are longer than max_seq_len=512 and were cut there: about ([\d,]+) of "
                     r"the data's about ([\d,]+) target tokens \((\d+)%\) are not trained on \(1 of those rows was "
                     r"tokenized only a little past the cut: the tokens of the rest are estimated from its "
                     r"characters at the row's own tokens per character\); raise dataset.max_seq_len to keep them",
                     msg)
    assert m, msg
    lost, total = (int(g.replace(",", "")) for g in m.groups()[:2])
    exact_total = sum(len(tokenize_segments(smol, [(r["text"], True)])["tokens"]) - 1 for r in rows)
    exact_lost = exact_total - ds.num_loss_tokens()
    assert abs(lost - exact_lost) <= 0.25 * exact_lost and abs(total - exact_total) <= 0.25 * exact_total
