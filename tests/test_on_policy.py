"""On-policy KD (kd.on_policy, components/on_policy.py): which micro-batches go on-policy, the prompts, the
sampling (KV cache, seeded, laid out by global row), the completion-only labels, the loss against the reference
divergences (values and gradients; nothing on prompt positions), the config checks, and the kd recipe with it:
metrics, held-out score, bit-identical resume after SIGKILL, and 2 processes = 1 process with twice the batch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from llm_recipe.components.data.dataset import DatasetConfig
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.kd_settings import KDSettings
from llm_recipe.components.losses import KD_LOSSES, LiveTeacher, build_kd_loss, kd_and_ce
from llm_recipe.components.models import LoRASettings, ModelArgs, build_model
from llm_recipe.components.on_policy import (
    OnPolicySettings,
    check_on_policy,
    completion_batch,
    deal_prompts,
    decode_path,
    is_on_policy,
    load_prompt_set,
    on_policy_index,
    on_policy_kd_loss,
    per_prompt_summary,
    prompts_of,
    row_prompts,
    sample_completions,
    sample_with_uniforms,
    score_samples,
)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "fixtures" / f"{name}.py")
    if name not in sys.modules:
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


ref, rc = _load("kd_reference"), _load("recipes_common")
IGNORE = -100
ARGS = ModelArgs(family="llama", vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                 tie_word_embeddings=False, qkv_bias=False, o_bias=False)
PROMPTS = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 2, 6]]
COMPLETIONS = [[11, 12, 13], [20, 21, 22, 23, 24], [30]]


def _model(seed: int, lora: LoRASettings | None = None, scale: float = 4.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(ARGS, lora=lora).double()
    with torch.no_grad():  # peaked, model-specific next-token distributions (random init is near uniform)
        model.output.weight.mul_(scale)
    return model


def _hidden(model, tokens):
    model.skip_output = True
    try:
        return model(tokens)
    finally:
        model.skip_output = False


# ---------------------------------------------------------------------------------------- choosing, prompts


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.3, 0.5, 1.0])
def test_fraction_is_spread_evenly_and_fixed_by_seed_step_micro(fraction):
    accum = 3
    picks = [is_on_policy(0, step, micro, accum, fraction) for step in range(200) for micro in range(accum)]
    for start, length in ((0, 600), (17, 40), (101, 7)):  # any run of k micro-batches holds ~k * fraction
        assert abs(sum(picks[start:start + length]) - length * fraction) < 1
    assert picks == [is_on_policy(0, s, m, accum, fraction) for s in range(200) for m in range(accum)]
    if 0 < fraction < 1:
        by_seed = {tuple(is_on_policy(seed, s, 0, 1, fraction) for s in range(8)) for seed in range(6)}
        assert len(by_seed) > 1  # the seed moves the phase


def test_prompts_of_text_rows_packed_and_not():
    from llm_recipe.components.data.collate import collate

    doc1, doc2 = list(range(100, 110)), list(range(200, 205))
    packed = collate([{"tokens": doc1 + doc2 + [0], "labels": doc1 + doc2 + [IGNORE], "seq_lens": [10, 5, 1]},
                      {"tokens": doc2 + doc1 + [0], "labels": doc2 + doc1 + [IGNORE], "seq_lens": [5, 10, 1]}], 0)
    assert prompts_of(packed, 4, budget=40) == [doc1[:4], doc2[:4]]
    # never past the first document's second-to-last token (its last is the end-of-text), never over budget
    assert prompts_of(packed, 30, budget=40) == [doc1[:9], doc2[:4]]
    assert prompts_of(packed, 30, budget=3) == [doc1[:3], doc2[:3]]
    plain = collate([{"tokens": doc1, "labels": doc1}, {"tokens": doc2, "labels": doc2}], pad_id=0)
    assert prompts_of(plain, 30, budget=40) == [doc1[:9], doc2[:4]]


def test_row_prompts_takes_one_prompt_per_document_while_they_fit():
    """A packed row's documents each give a prompt, in order, up to `per_row`, skipping its padding and any
    document without targets, and only while prompts + max_new_tokens completions fit in the row's length."""
    from llm_recipe.components.data.collate import collate

    docs = [list(range(100 * k, 100 * k + n)) for k, n in ((1, 10), (2, 5), (3, 1), (4, 7))]
    no_targets = [9] * 4  # e.g. a chat document whose response was cut off: no label
    row = lambda ds, labels, pad: {"tokens": sum(ds, []) + [0] * pad, "labels": sum(labels, []) + [IGNORE] * pad,  # noqa: E731
                                   "seq_lens": [len(d) for d in ds] + ([pad] if pad else [])}
    packed = collate([row(docs, docs, 3), row([docs[1], no_targets, docs[3]], [docs[1], [IGNORE] * 4, docs[3]], 10)], 0)
    # the 1-token document's shifted labels are all IGNORE: no target, no prompt; neither from the padding
    assert row_prompts(packed, 4, budget=40, per_row=8) == [[docs[0][:4], docs[1][:4], docs[3][:4]],
                                                          [docs[1][:4], docs[3][:4]]]
    assert row_prompts(packed, 4, budget=40, per_row=2) == [[docs[0][:4], docs[1][:4]], [docs[1][:4], docs[3][:4]]]
    assert prompts_of(packed, 4, budget=40, per_row=2) == [docs[0][:4], docs[1][:4], docs[1][:4], docs[3][:4]]
    # room: each prompt (4 tokens) and its completion (10) take 14 of budget + max_new_tokens = 30 tokens
    assert row_prompts(packed, 4, budget=20, per_row=8, max_new_tokens=10) == [[docs[0][:4], docs[1][:4]],
                                                                             [docs[1][:4], docs[3][:4]]]
    # the first document always gives one (a prompt is never over budget, so it always fits)
    assert row_prompts(packed, 30, budget=3, per_row=8, max_new_tokens=60) == [[docs[0][:3]], [docs[1][:3]]]


def test_prompts_of_chat_rows_are_the_tokens_before_the_response(embedded_model_dir):
    from llm_recipe.components.data.collate import collate
    from llm_recipe.components.data.formats import make_format
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_dir)
    chat = make_format("chat", tok)
    rows = [chat({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
            for q, a in (("What is 2+2?", "4."), ("Name a colour.", "Blue, like the sea."))]
    batch = collate(rows, tok.pad_id)
    prompts = prompts_of(batch, None, budget=500)
    for row, prompt in zip(rows, prompts, strict=True):
        first = next(i for i, lab in enumerate(row["labels"]) if lab != IGNORE)
        assert prompt == row["tokens"][:first] and len(prompt) > 5
        assert tok.decode(prompt).rstrip().endswith("assistant")  # the generation prompt ends it
    assert prompts_of(batch, None, budget=4) == [p[-4:] for p in prompts]  # too long: its end is kept
    packed = collate([{"tokens": rows[0]["tokens"] + rows[1]["tokens"], "labels": rows[0]["labels"] + rows[1]["labels"],
                       "seq_lens": [len(rows[0]["tokens"]), len(rows[1]["tokens"])]}], tok.pad_id)
    assert prompts_of(packed, None, budget=500, per_row=4) == prompts  # each packed chat document's own prompt


def test_completion_batch_labels_only_the_sampled_tokens():
    b = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    assert b["tokens"].shape == (3, 7) and b["prompt_lens"].tolist() == [4, 2, 6]
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        assert b["tokens"][i, : len(p) + len(c)].tolist() == p + c
        targets = [(t, int(y)) for t, y in enumerate(b["labels"][i]) if y != IGNORE]
        assert targets == [(len(p) - 1 + j, tok) for j, tok in enumerate(c)]  # labels[t] = tokens[t + 1]
    assert int((b["labels"] != IGNORE).sum()) == sum(map(len, COMPLETIONS))


# ---------------------------------------------------------------------------------------- a prompt set


@pytest.mark.parametrize("fraction", [0.25, 0.3, 0.5, 1.0])
def test_on_policy_index_counts_the_on_policy_micro_batches_before(fraction):
    """m of micro-batch k is how many of micro-batches 0..k-1 went on-policy: the on-policy ones get 0, 1, 2, ..."""
    for seed in range(4):
        picks = [is_on_policy(seed, k, 0, 1, fraction) for k in range(300)]
        assert [on_policy_index(seed, k, fraction) for k in range(300)] == [sum(picks[:k]) for k in range(300)]


def test_dealing_cuts_each_pass_into_whole_micro_batches_and_two_ranks_take_what_one_takes_with_twice_the_batch():
    """A pass of n = 13 rows holds n // 6 = 2 micro-batches of 6 (2 ranks x 3, or 1 x 6): the m-th on-policy
    micro-batch of 2 ranks of 3 prompts each is the m-th of one process with 6, rank 0 first; a pass deals 12
    distinct rows in its 2 micro-batches (the 13th waits for a later pass), the next pass in another order; the
    seed changes the order."""
    n, seed = 13, 5
    one = [deal_prompts(seed, n, m, 0, 1, 6) for m in range(8)]
    two = [deal_prompts(seed, n, m, 0, 2, 3) + deal_prompts(seed, n, m, 1, 2, 3) for m in range(8)]
    assert one == two
    assert not set(deal_prompts(seed, n, 0, 0, 2, 3)) & set(deal_prompts(seed, n, 0, 1, 2, 3))  # ranks never overlap
    passes = [one[2 * e] + one[2 * e + 1] for e in range(4)]
    assert all(len(set(p)) == 12 for p in passes)
    assert len({tuple(p) for p in passes}) > 1 and len({i for p in passes for i in p}) == n
    assert deal_prompts(seed + 1, n, 0, 0, 1, n) != deal_prompts(seed, n, 0, 0, 1, n)
    assert deal_prompts(seed, n, 3, 1, 2, 3) == deal_prompts(seed, n, 3, 1, 2, 3)  # stateless: the same each time


def test_no_micro_batch_repeats_a_prompt_across_a_pass_boundary():
    """A micro-batch never straddles two passes, so whatever n, world and rows: a rank's prompts are distinct once
    the set has `rows` of them, all ranks' together (ranks disjoint) once it has world x rows; every index is below
    n (the held-out rows lie past it); and no row is starved (a pass's leftover rows are another pass's)."""
    for n in range(1, 26):
        for world in (1, 2, 3):
            for rows in (1, 2, 3, 4, 7):
                for m in range(3 * n + 5):  # several passes, whatever their length
                    dealt = [deal_prompts(11, n, m, r, world, rows) for r in range(world)]
                    assert all(len(d) == rows and all(0 <= i < n for i in d) for d in dealt)
                    if n >= rows:
                        assert all(len(set(d)) == rows for d in dealt), (n, world, rows, m, dealt)
                    if n >= world * rows:
                        assert len({i for d in dealt for i in d}) == world * rows, (n, world, rows, m, dealt)
    # n = 7, 3 a micro-batch: dealt as one endless stream, micro-batch 2 would take the last row of pass 0 and the
    # first two of pass 1; here each micro-batch takes the first 3 of a pass of its own (7 // 3 = 2 per pass)
    counts = [0] * 7
    for m in range(6000):
        for i in deal_prompts(0, 7, m, 0, 1, 3):
            counts[i] += 1
    assert all(abs(c - 6000 * 3 / 7) < 0.05 * 6000 * 3 / 7 for c in counts), counts


def _chat_prompts(tok, rows: range, budget: int) -> list[list[int]]:
    """Each shipped chat row's prompt as the chat format tokenizes it: the tokens before the first target, cut to
    their last `budget` (an independent reading of what the prompt set should hold)."""
    from llm_recipe.components.data.formats import make_format
    from llm_recipe.components.data.sources import load_rows

    fmt, data = make_format("chat", tok), load_rows("transfer:chat")
    out = []
    for i in rows:
        ex = fmt(data[i])
        first = next(t for t, lab in enumerate(ex["labels"]) if lab != IGNORE)
        out.append(ex["tokens"][:first][-budget:])
    return out


def test_prompt_set_rows_give_their_prompts_cut_to_the_budget_and_hold_out_the_tail(embedded_model_dir):
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_dir)
    chat = DatasetConfig(source="transfer:chat", format="chat", split="train[1043:]", limit=6)
    got = load_prompt_set(OnPolicySettings(prompts=chat, held_out=2, max_new_tokens=16), 64, tok)
    whole = _chat_prompts(tok, range(1043, 1049), 10**6)
    assert got.train + got.held == [p[-48:] for p in whole] and len(got.held) == 2  # budget 64 - 16
    assert got.cut == sum(len(p) > 48 for p in whole) > 0 and got.origin == "transfer:chat, split train[1043:], limit 6"
    assert all(tok.decode(p).rstrip().endswith("assistant") for p in got.train)  # the generation prompt ends each
    text = load_prompt_set(OnPolicySettings(prompts=DatasetConfig(source="transfer:passages", limit=3),
                                            prompt_tokens=5, held_out=0, max_new_tokens=16), 64, tok)
    assert [len(p) for p in text.train] == [5, 5, 5] and text.held == []  # text rows: the first prompt_tokens
    # an on-policy micro-batch of 4 prompts: 4 rows padded to the longest prompt (held-out ones too) + completion
    assert got.micro_batch_tokens(4, 16) == 4 * (max(map(len, got.train + got.held)) + 16)


@pytest.mark.parametrize("prompts, held_out, message", [
    (dict(source="transfer:chat", format="text"), 0,
     r"^kd.on_policy.prompts: \S*chat.jsonl:1: missing column 'text'"),
    (dict(source="transfer:passages", format="chat"), 0,
     r"^kd.on_policy.prompts: \S*passages.jsonl:1: missing column 'conversations' \(expected 'messages'"),
    (dict(source="transfer:chat", format="chat", split="train[5000:]"), 0,
     r"^kd.on_policy.prompts: dataset source 'transfer:chat' split 'train\[5000:\]' has no rows$"),
    (dict(source="transfer:chat", format="chat", limit=4), 4,
     r"^kd.on_policy.prompts: 4 prompt rows in transfer:chat, split train, limit 4, and kd.on_policy.held_out=4 holds "
     r"them all out: none left to train on"),
])
def test_prompt_set_that_yields_no_prompts_is_one_error_naming_the_key(embedded_model_dir, prompts, held_out,
                                                                        message):
    from llm_recipe.components.models.tokenizer import Tokenizer

    s = OnPolicySettings(prompts=DatasetConfig(**prompts), held_out=held_out)
    with pytest.raises(RecipeError, match=message) as e:
        load_prompt_set(s, 128, Tokenizer.from_dir(embedded_model_dir))
    assert "\n" not in str(e.value)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _shipped_chat(rows: range) -> list[list[dict]]:
    from llm_recipe.components.data.sources import load_rows

    data = load_rows("transfer:chat")
    return [data[i]["messages"] for i in rows]


@pytest.mark.parametrize("fmt", ["chat", "instruct", "instruct_chat_template"])
def test_a_prompt_only_row_gives_the_prompt_its_answered_twin_gives(embedded_model_dir, tmp_path, fmt):
    """A prompt set of prompt-only rows (chat: ending in a user turn, GKD's usual input; instruct: no output, a
    null or a blank one) gives the prompts the same rows with their responses give (the tokens before the
    response), rendered up to where the response starts; a row with a response among them keeps its prompt."""
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_dir)
    chat = _shipped_chat(range(1043, 1049))
    if fmt == "chat":
        answered, asked = [{"messages": m} for m in chat], [{"messages": m[:-1]} for m in chat]
    else:
        answered = [{"instruction": m[0]["content"], "output": m[1]["content"]} for m in chat]
        asked = [{"instruction": m[0]["content"], **({}, {"output": None}, {"output": " "})[i % 3]}
                 for i, m in enumerate(chat)]
    asked[1] = answered[1]
    keys = dict(format=fmt.split("_")[0], use_chat_template=fmt.endswith("template"))
    got, twin = (load_prompt_set(OnPolicySettings(prompts=DatasetConfig(source=str(_jsonl(tmp_path / name, rows)),
                                                                         **keys), held_out=2, max_new_tokens=16),
                                 64, tok) for name, rows in (("asked.jsonl", asked), ("answered.jsonl", answered)))
    assert (got.train, got.held, got.cut) == (twin.train, twin.held, twin.cut) and len(got.train) == 4 and got.cut
    end = "### Response:" if fmt == "instruct" else "assistant"
    assert all(tok.decode(p).rstrip().endswith(end) for p in got.train + got.held)


def test_a_prompt_only_conversation_is_all_of_it_up_to_the_generation_prompt(embedded_model_dir, tmp_path):
    """A conversation ending in a user turn is prompt-only whatever came before (a system turn, earlier answers):
    its prompt is all of it with the generation prompt; ShareGPT rows too."""
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_model_dir)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}]
    rows = [{"messages": turns}, {"messages": turns[:2]}, {"conversations": [{"from": "human", "value": "2+2?"}]}]
    got = load_prompt_set(OnPolicySettings(prompts=DatasetConfig(source=str(_jsonl(tmp_path / "p.jsonl", rows)),
                                                                 format="chat"), held_out=0, max_new_tokens=16),
                          512, tok)
    want = [turns, turns[:2], [{"role": "user", "content": "2+2?"}]]
    assert got.train == [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True), add_bos=True)
                         for m in want]
    assert "Blue." in tok.decode(got.train[0]) and tok.decode(got.train[0]).rstrip().endswith("assistant")


@pytest.mark.parametrize("fmt, rows, message", [
    ("instruct", [{"instruction": "Add 2 and 2."}, {"instruction": " ", "input": "x"}],
     r"p.jsonl:2: column 'instruction' is empty$"),
    ("instruct", [{"input": "2 and 2", "output": "4"}], r"p.jsonl:1: missing column 'instruction'; row has input"),
    ("chat", [{"messages": [{"role": "user", "content": "Hi"}]}, {"messages": [{"role": "user", "content": " "}]}],
     r"p.jsonl:2: column 'messages' ends in an empty user turn: no prompt to answer$"),
    ("chat", [{"messages": []}], r"p.jsonl:1: column 'messages' must be a non-empty list of turns, got list \(empty\)$"),
    ("chat", [{"prompt": "Hi"}], r"p.jsonl:1: missing column 'conversations' \(expected 'messages' or ShareGPT"),
])
def test_a_bad_prompt_only_row_is_one_error_naming_the_key_and_the_row(embedded_model_dir, tmp_path, fmt, rows,
                                                                       message):
    from llm_recipe.components.models.tokenizer import Tokenizer

    s = OnPolicySettings(prompts=DatasetConfig(source=str(_jsonl(tmp_path / "p.jsonl", rows)), format=fmt),
                         held_out=0)
    with pytest.raises(RecipeError, match=r"^kd.on_policy.prompts: \S*" + message) as e:
        load_prompt_set(s, 128, Tokenizer.from_dir(embedded_model_dir))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt, row, message", [
    ("chat", {"messages": [{"role": "user", "content": "Hi"}]}, "column 'messages' has no assistant turn to train on"),
    ("instruct", {"instruction": "Add 2 and 2."}, "missing column 'output'; row has instruction"),
    ("instruct", {"instruction": "Add 2 and 2.", "output": " "}, "column 'output' is empty"),
])
def test_training_rows_still_need_a_response(embedded_model_dir, tmp_path, fmt, row, message):
    """Prompt-only rows are for kd.on_policy.prompts only: as training data they are refused as before."""
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.models.tokenizer import Tokenizer

    path = _jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(RecipeError, match=r"p.jsonl:1: " + message):
        build_dataset(Tokenizer.from_dir(embedded_model_dir), str(path), format=fmt)


# ---------------------------------------------------------------------------------------- sampling


def test_generate_batch_keeps_the_stop_token_and_takes_pick_and_all_done():
    from llm_recipe.components.models.generation import generate_batch

    model = _model(0).float().eval()
    greedy = generate_batch(model, PROMPTS, 10, pad_id=0)
    stop = greedy[0][3]
    cut = generate_batch(model, PROMPTS, 10, pad_id=0, stop_ids=[stop])
    kept = generate_batch(model, PROMPTS, 10, pad_id=0, stop_ids=[stop], keep_stop=True)
    assert kept[0] == cut[0] + [stop] == greedy[0][: greedy[0].index(stop) + 1]
    assert generate_batch(model, PROMPTS, 5, pad_id=0, pick=lambda logits: torch.full_like(logits[:, 0], 7,
                                                                                            dtype=torch.long)) == [[7] * 5] * 3
    asked = []
    generate_batch(model, PROMPTS, 40, pad_id=0, stop_ids=list(range(61)), all_done=lambda d: asked.append(1) or False)
    assert len(asked) == 2  # every row stopped at once, but the caller said no: asked at steps 16 and 32


def test_inverse_cdf_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(20000, 5)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    picks = sample_with_uniforms(logits, 1.0, u)
    freq = torch.bincount(picks, minlength=5).double() / 20000
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.01, rtol=0)
    hot = torch.bincount(sample_with_uniforms(logits, 0.25, u), minlength=5).double() / 20000
    assert hot[0] > 0.95  # a low temperature sharpens it


def test_samples_are_seeded_and_laid_out_by_global_row():
    """Rank k's row r takes global row r * world + k: two ranks with 2 prompts each sample what one process with
    the 4 prompts samples (same seed), whatever their batch neighbours."""
    model = _model(0).float().train()
    prompts = [[1, 5, 9], [1, 7], [1, 3, 3, 8], [1, 2]]
    kw = dict(max_new_tokens=12, temperature=1.0, pad_id=0, stop_ids=[])
    one = sample_completions(model, prompts, seed=5, rows=range(4), width=4, **kw)
    assert model.training and not model.caches_are_enabled()  # back to training, no KV cache left
    assert one == sample_completions(model, prompts, seed=5, rows=range(4), width=4, **kw)
    assert one != sample_completions(model, prompts, seed=6, rows=range(4), width=4, **kw)
    rank0 = sample_completions(model, prompts[0::2], seed=5, rows=[0, 2], width=4, **kw)
    rank1 = sample_completions(model, prompts[1::2], seed=5, rows=[1, 3], width=4, **kw)
    assert [rank0[0], rank1[0], rank0[1], rank1[1]] == one
    assert all(len(c) == 12 and max(c) < 61 for c in one)
    assert max(max(c) for c in sample_completions(model, prompts, seed=5, rows=range(4), width=4, vocab_size=10,
                                                  **kw)) < 10


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compiled_sampling_and_compiled_training_layers_never_recompile_each_other(checkpointed):
    """The compiled decode step (StaticDecode) between training steps of layers compiled one by one (as
    rt.prepare_model does, with activation checkpointing or not): once the training shapes are seen, nothing
    recompiles (Dynamo's error_on_recompile): the prompt forward runs eagerly, the decode step inlines the layers
    into its own graph, and the layers' `kv_cache = None` is put back where it was. The step reads the weights the
    optimizer updates in place: its samples are those of an uncompiled twin trained the same way. Dynamo with the
    eager backend (its guards decide recompiles; Inductor's kernels and CUDA graphs need a GPU to check)."""
    import torch._dynamo

    from llm_recipe.components.models.generation import StaticDecode
    from llm_recipe.components.runtime import _checkpoint_forward

    torch._dynamo.reset()
    model, twin = _model(0).float(), _model(0).float()
    for layer in model.layers:
        if checkpointed:
            _checkpoint_forward(layer)
        layer.compile(backend="eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    static = StaticDecode(6, mode="default", backend="eager")
    kw = dict(max_new_tokens=8, temperature=1.0, pad_id=0, stop_ids=[], seed=3, rows=range(3), width=6)

    def train(width: int, seed: int) -> None:
        tokens = torch.randint(1, 61, (2, width), generator=torch.Generator().manual_seed(seed))
        for m, opt in zip((model, twin), opts, strict=True):
            m.train()
            kd_and_ce(_hidden(m, tokens), m.output, tokens.roll(-1, 1), num_chunks=2)["loss"].backward()
            opt.step()
            opt.zero_grad()

    def sample(n: int) -> list[list[int]]:
        got = sample_completions(model, PROMPTS[:n], **{**kw, "rows": range(n)}, static=static)
        assert got == sample_completions(twin, PROMPTS[:n], **{**kw, "rows": range(n)})
        assert model.training and all(layer.attn.kv_cache is None for layer in model.layers)
        return got

    train(12, 0)
    train(7, 1)  # a second width: the layers' graph goes dynamic (what Dynamo does for any training run)
    with torch._dynamo.config.patch(error_on_recompile=True):  # the decode step's first compile is no recompile
        first = sample(3)
        for step in range(2, 6):
            train(12, step)
            train(5 + step, 10 + step)
            sample(1 + step % 3)
    assert sample(3) != first  # the weights moved and the compiled step saw it
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA graphs and Inductor's GPU kernels")
def test_cuda_graph_sampling_is_recorded_once_and_reads_the_trained_weights(monkeypatch):
    """On a GPU: the on-policy sampler's decode step (StaticDecode, mode reduce-overhead) between training steps of
    layers compiled with Inductor: sampling never recompiles, no CUDA-graph skip, one recording for all samplings (a
    re-record per micro-batch would show here), and the samples of an uncompiled twin trained the same way."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    from llm_recipe.components.models.generation import StaticDecode

    recorded = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function",
                        lambda self, *a, **k: recorded.append(1) or record(self, *a, **k))
    torch._dynamo.reset()
    counters.clear()
    model, twin = _model(0).float().cuda(), _model(0).float().cuda()
    for layer in model.layers:
        layer.compile()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    static = StaticDecode(6, mode="reduce-overhead")
    kw = dict(max_new_tokens=24, temperature=1.0, pad_id=0, stop_ids=[], seed=3, width=6)

    def train(width: int, seed: int) -> None:
        tokens = torch.randint(1, 61, (2, width), generator=torch.Generator().manual_seed(seed)).cuda()
        for m, opt in zip((model, twin), opts, strict=True):
            m.train()
            kd_and_ce(_hidden(m, tokens), m.output, tokens.roll(-1, 1), num_chunks=2)["loss"].backward()
            opt.step()
            opt.zero_grad()

    train(12, 0)
    train(7, 1)
    samples = []
    for step in range(2, 7):
        n = 1 + step % 3
        with torch._dynamo.config.patch(error_on_recompile=True):  # sampling never recompiles
            got = sample_completions(model, PROMPTS[:n], rows=range(n), static=static, **kw)
            assert got == sample_completions(twin, PROMPTS[:n], rows=range(n), **kw)
        samples.append(got)
        train(12, step)  # training between samplings, at a width it has not seen: the fused loss compiles one
        train(5 + step, 10 + step)  # graph per chunk shape (losses/fused.py), which must not disturb the decode graph
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(recorded) == 1, f"{len(recorded)} CUDA graph recordings"
    assert samples[0] != samples[3]  # same prompts and seed: the weights moved and the graph read them
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("kind", ref.KINDS)
@pytest.mark.parametrize("head", ["plain", "lora"])
def test_on_policy_loss_is_the_divergence_on_completion_tokens(kind, head):
    """On fixed samples, the recipe's on-policy loss (kd_and_ce at kd_ratio 1 over completion_batch's labels) is the
    reference divergence summed over completion tokens, with the same gradients; the fused driver (plain head)
    and the checkpointed one (LoRA head) alike."""
    lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "lm_head")) if head == "lora" else None
    student, teacher = _model(1, lora), _model(0)
    if lora is not None:
        with torch.no_grad():  # LoRA B starts at 0: make the adapters count
            for n, p in student.named_parameters():
                if "lora_b" in n:
                    p.normal_(0, 0.3)
    kd_cfg = OmegaConf.create({"temperature": 1.5, **ref.OPTIONS.get(kind, {})})
    loss_fn = on_policy_kd_loss(OnPolicySettings(loss=kind), kd_cfg)
    b = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        t_hidden = _hidden(teacher, b["tokens"])
    hidden = _hidden(student, b["tokens"]).detach().requires_grad_(True)
    parts = kd_and_ce(hidden, student.output, b["labels"], LiveTeacher(t_hidden, teacher.output), loss_fn, 1.0,
                      num_chunks=3)
    parts["loss"].backward()

    h_ref = hidden.detach().clone().requires_grad_(True)
    s_logits, t_logits = student.output(h_ref).flatten(0, 1), teacher.output(t_hidden).flatten(0, 1)
    expected = ref.divergence(kind, s_logits, t_logits, b["labels"].flatten(), 1.5, **ref.OPTIONS.get(kind, {}))
    expected.backward()
    assert int(parts["n"]) == sum(map(len, COMPLETIONS))
    torch.testing.assert_close(parts["loss"].detach(), expected.detach(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden.grad, h_ref.grad, rtol=1e-7, atol=1e-10)
    assert parts["loss"] > 0


def test_score_samples_per_prompt_reverse_kl_and_teacher_nll_whatever_the_batch():
    """The held-out metric per prompt: the student's sample of prompt i depends on (seed, i) alone (so every
    student evaluated with one seed sees the same noise, whatever the batch), its reverse KL and teacher NLL sums
    are the reference ones on that row, and the summary holds per-prompt means, their mean and the count."""
    student, teacher = _model(1).float(), _model(0).float()
    prompts = [*PROMPTS, [1, 2]]
    kw = dict(max_new_tokens=6, temperature=1.0, pad_id=0, stop_ids=[], seed=3, width=len(prompts))

    def sample(chunk, rows):
        return sample_completions(student, chunk, rows=rows, **kw)

    one = score_samples(student, teacher, prompts, sample, batch=4, pad_id=0, num_chunks=2)
    alone = score_samples(student, teacher, prompts, sample, batch=1, pad_id=0, num_chunks=3)
    assert alone["tokens"] == one["tokens"]  # the same samples (a different batch only rounds differently)
    for k in ("reverse_kl_sum", "teacher_nll_sum"):
        assert alone[k] == pytest.approx(one[k], rel=1e-5)
    b = completion_batch(prompts, sample_completions(student, prompts, rows=range(4), **kw), pad_id=0)
    with torch.no_grad():
        s_logits = student.output(_hidden(student, b["tokens"]))
        t_logits = teacher.output(_hidden(teacher, b["tokens"]))
    for i in range(len(prompts)):
        labels = b["labels"][i]
        rkl = ref.divergence("reverse_kl", s_logits[i], t_logits[i], labels, 1.0)
        nll = torch.nn.functional.cross_entropy(t_logits[i], labels, ignore_index=IGNORE, reduction="sum")
        assert one["tokens"][i] == 6
        assert one["reverse_kl_sum"][i] == pytest.approx(float(rkl), rel=1e-4)
        assert one["teacher_nll_sum"][i] == pytest.approx(float(nll), rel=1e-4)
    summary = per_prompt_summary(one)
    assert summary["prompts"] == 4 and len(summary["per_prompt"]["reverse_kl"]) == 4
    assert summary["per_prompt"]["reverse_kl"][0] == pytest.approx(one["reverse_kl_sum"][0] / 6, abs=1e-6)
    assert summary["reverse_kl_mean"] == pytest.approx(sum(summary["per_prompt"]["reverse_kl"]) / 4)
    assert summary["teacher_nll_mean"] > 0 and student.training

def test_only_completion_tokens_carry_loss():
    """The gradient w.r.t. the student's logits is zero at every position whose next token is a prompt token or
    padding, and non-zero where the next token was sampled."""
    student, teacher = _model(1), _model(0)
    b = completion_batch(PROMPTS, COMPLETIONS, pad_id=0)
    with torch.no_grad():
        t_hidden = _hidden(teacher, b["tokens"])
        s_logits = student(b["tokens"])
    logits = s_logits.clone().requires_grad_(True)  # the loss's "hidden" = the logits, its head the identity
    parts = kd_and_ce(logits, torch.nn.Identity(), b["labels"], LiveTeacher(t_hidden, teacher.output),
                      build_kd_loss("reverse_kl"), 1.0, num_chunks=2)
    parts["loss"].backward()
    carries = logits.grad.abs().sum(-1) > 0
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        expected = [len(p) - 1 <= t < len(p) + len(c) - 1 for t in range(b["tokens"].shape[1])]
        assert carries[i].tolist() == expected, i


def test_on_policy_kd_loss_takes_the_kd_options_its_kind_reads():
    kd = OmegaConf.create({"loss": "jsd", "temperature": 2.0, "beta": 0.3, "alpha": None, "ratio": None})
    assert on_policy_kd_loss(OnPolicySettings(), kd) == build_kd_loss("reverse_kl", 2.0)
    assert on_policy_kd_loss(OnPolicySettings(loss="jsd"), kd) == build_kd_loss("jsd", 2.0, beta=0.3)
    assert set(KD_LOSSES) == set(ref.KINDS)


# ---------------------------------------------------------------------------------------- config


def test_decode_path_compiles_on_one_cuda_process_with_compile():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto, eager, compiled = (OnPolicySettings(decode=d) for d in ("auto", "eager", "compiled"))
    assert decode_path(auto, True, cuda, 1) == "compiled"
    assert [decode_path(auto, c, d, 1) for c, d in ((False, cuda), (True, cpu))] == ["eager", "eager"]
    assert decode_path(auto, True, cuda, 2) == "eager"  # FSDP2: eager, as before
    assert decode_path(eager, True, cuda, 1) == "eager" and decode_path(compiled, False, cpu, 1) == "compiled"
    with pytest.raises(RecipeError, match=r"kd.on_policy.decode=compiled runs on one process only: on 2"):
        decode_path(compiled, True, cuda, 2)


def test_settings_defaults_and_cross_key_errors():
    text = DatasetConfig(source="x", max_seq_len=128)
    check_on_policy(None, "cache", text)  # off: nothing to check
    check_on_policy(OnPolicySettings(fraction=0.5), None, text)
    with pytest.raises(RecipeError, match=r"needs a live teacher.*teacher.logits_dir"):
        check_on_policy(OnPolicySettings(), "cache", text)
    with pytest.raises(RecipeError, match=r"kd.on_policy.max_new_tokens=128 must be below dataset.max_seq_len=128"):
        check_on_policy(OnPolicySettings(max_new_tokens=128), None, text)
    with pytest.raises(RecipeError, match=r"dataset.train_on_input=true"):
        check_on_policy(OnPolicySettings(), None, DatasetConfig(source="x", max_seq_len=128, format="chat",
                                                                train_on_input=True))
    # prompts from their own set: the training rows' labels no longer give them; a text set is fine too
    for fmt in ("chat", "text"):
        check_on_policy(OnPolicySettings(prompts=DatasetConfig(source="p", format=fmt)), None,
                        DatasetConfig(source="x", max_seq_len=128, format="chat", train_on_input=True))


@pytest.mark.parametrize("override, message", [
    ("kd.on_policy.fraction=-0.1", "key 'kd.on_policy.fraction' must be a number in [0, 1], got -0.1"),
    ("kd.on_policy.fraction=1.5", "key 'kd.on_policy.fraction' must be a number in [0, 1], got 1.5"),
    ("kd.on_policy.max_new_tokens=0", "key 'kd.on_policy.max_new_tokens' must be an int >= 1, got 0"),
    ("kd.on_policy.temperature=0", "key 'kd.on_policy.temperature' must be a number > 0, got 0"),
    ("kd.on_policy.loss=kl", "key 'kd.on_policy.loss' must be one of forward_kl, reverse_kl"),
    ("kd.on_policy.top_k=5", "unknown key 'kd.on_policy.top_k'"),
    ("kd.on_policy.prompts_per_row=0", "key 'kd.on_policy.prompts_per_row' must be an int >= 1, got 0"),
    ("kd.on_policy.decode=fast", "key 'kd.on_policy.decode' must be one of auto, compiled, eager"),
    ("kd.on_policy.prompts={source: transfer:chat, packed: true}", "unknown key 'kd.on_policy.prompts.packed' "
     "(recipe kd reads: kd.on_policy.prompts.source, kd.on_policy.prompts.format"),
    ("kd.on_policy.prompts={format: chat}", "key 'kd.on_policy.prompts.source' is required"),
    ("kd.on_policy.prompts.format=jsonl", "key 'kd.on_policy.prompts.format' must be one of text, instruct, chat"),
])
def test_validate_names_the_key(tmp_path, override, message):
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "validate", "kd/smollm2_demo", "--recipe",
                           "kd", override], capture_output=True, text=True, env=rc.cli_env(), cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    assert message in line, line


# ---------------------------------------------------------------------------------------- the kd recipe


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_model_dir) -> tuple[Path, Path]:
    """A teacher and a different student (tiny, random, SmolLM2's tokenizer; peaked heads)."""
    from llm_recipe.components.models import save_model

    args = ModelArgs.from_hf_config({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2})
    root = tmp_path_factory.mktemp("on_policy_models")
    for name, seed in (("teacher", 0), ("student", 1)):
        torch.manual_seed(seed)
        model = build_model(args)
        with torch.no_grad():
            model.output.weight.mul_(8.0)
        save_model(model, args, root / name, tokenizer_dir=embedded_model_dir)
    return root / "teacher", root / "student"


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory) -> list[str]:
    """Overrides for a text set of short documents (10-30 words), packed 2-5 to a row of 96 tokens, and 3 prompts
    per row: on-policy micro-batches of several prompts per row."""
    import random

    words = ("the river town old bridge north light stone market winter road field music school paper garden "
             "ship harbor island forest valley station mountain city lake").split()
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("short_docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 30)))
                                                + "."}) + "\n" for _ in range(80)))
    return [f"dataset.source={path}", "dataset.max_seq_len=96", "dataset.limit=null",
            "kd.on_policy.prompts_per_row=3"]


CHAT_PROMPTS = 'kd.on_policy.prompts={source: transfer:chat, format: chat, split: "train[1043:]", limit: 8}'


def _kd(models, *extra: str) -> list[str]:
    teacher, student = models
    return [*rc.COMMON, "dataset.max_seq_len=48", "dataset.limit=16", "dataset.shuffle=false", "student.every=null",
            "student.prune=null", f"teacher.checkpoint_dir={teacher}", f"student.checkpoint_dir={student}",
            "kd.kd_ratio=0.5", "optimizer.lr=1e-3", "lr_scheduler.name=constant", "kd.on_policy.fraction=0.5",
            "kd.on_policy.max_new_tokens=8", "kd.on_policy.prompt_tokens=8", "kd.on_policy.held_out=3",
            "kd.on_policy.temperature=0.5", *extra]


TIMINGS = ("tokens_per_s", "sampled_tokens_per_s", "sampling_share", "peak_memory_gib")
ON_POLICY_KEYS = {"on_policy_loss", "on_policy_batches", "on_policy_prompts", "on_policy_rkl", "sampled_tokens_per_s",
                  "sampling_share"}


@pytest.mark.parametrize("student", [
    "full",
    pytest.param("lora", marks=pytest.mark.slow),
    pytest.param("qat", marks=pytest.mark.slow),
])
def test_kd_recipe_logs_on_policy_metrics_and_scores_held_out_prompts(tmp_path, models, student):
    extra = {"full": ["student.keep_layers=[0,3]"],  # pruned, full, fused loss
             "lora": ["lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, lm_head]}"],  # checkpointed loss
             "qat": ["qat={scheme: 8da4w, group_size: 32}"]}[student]  # KD-QAT
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models, *extra), "max_steps=4",
                                                       f"output_dir={out}"]) == 0
    rows = rc.assert_metrics(out, 4, {"loss", "lr", *ON_POLICY_KEYS})
    on = [r for r in rows if r["on_policy_batches"]]
    assert len(on) == 2 and all(r["on_policy_batches"] == 1 for r in on)  # fraction 0.5 of 4 micro-batches
    assert all(r["on_policy_prompts"] == 2 for r in on)  # rows of 48 tokens hold one document each
    for r in on:
        assert r["on_policy_rkl"] > 0 and r["sampled_tokens_per_s"] > 0 and 0 < r["sampling_share"] < 1
        assert r["ce_loss"] is None and r["on_policy_loss"] == pytest.approx(r["loss"])
    for r in rows:
        if not r["on_policy_batches"]:
            assert r["on_policy_rkl"] is None and r["on_policy_loss"] is None and r["ce_loss"] > 0
    held = json.loads((out / "on_policy_eval.json").read_text())
    assert held["held_out_rows"] == 3 and held["reverse_kl_per_token"] > 0 and held["sampled_tokens"] > 0
    per = held["per_prompt"]  # prompt by prompt, for paired comparisons of two runs
    assert held["prompts"] == 3 and len(per["reverse_kl"]) == len(per["teacher_nll"]) == len(per["tokens"]) == 3
    assert sum(per["tokens"]) == held["sampled_tokens"] and min(per["teacher_nll"]) > 0
    assert held["reverse_kl_mean"] == pytest.approx(sum(per["reverse_kl"]) / 3)


def test_held_out_rows_never_train(models):
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.models.tokenizer import Tokenizer
    from llm_recipe.components.on_policy import OnPolicy
    from llm_recipe.components.runtime import Runtime

    tok = Tokenizer.from_dir(models[0])
    data = build_dataset(tok, "transfer:passages", max_seq_len=48, packed=True, limit=16)
    cfg = SimpleNamespace(kd=KDSettings(), dataset=DatasetConfig(source="transfer:passages", max_seq_len=48),
                          batch_size=2, seed=0, gradient_accumulation_steps=1, compile=False)  # a KDConfig's keys
    op = OnPolicy(OnPolicySettings(max_new_tokens=8, held_out=3), cfg, Runtime(torch.device("cpu"), torch.float32),
                  tok, None, 4)
    train = op.hold_out(data)
    assert list(train) + op.held == list(data) and len(op.held) == 3 and train.packed
    with pytest.raises(RecipeError, match=r"kd.on_policy.held_out=16 leaves no training rows"):
        OnPolicy(OnPolicySettings(held_out=len(data)), cfg, Runtime(torch.device("cpu"), torch.float32), tok, None,
                 4).hold_out(data)


def test_on_policy_micro_batches_sample_the_prompt_set_by_the_dealing_rule(tmp_path, models, monkeypatch):
    """With kd.on_policy.prompts (8 shipped chat rows past the evaluated ones, the last 3 held out): every
    on-policy micro-batch samples the chosen rows' prompts in the dealing order (4 distinct rows of the 5), never a
    held-out one, and those 3 score the student at the end; the training rows still feed the
    off-policy micro-batches, all 16 of them (the dataset keeps its tail)."""
    from llm_recipe.components import on_policy as onp
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.models.tokenizer import Tokenizer

    sampled, windows = [], []
    batch = onp.completion_batch
    monkeypatch.setattr(onp, "completion_batch", lambda p, c, pad: sampled.append(p) or batch(p, c, pad))
    window = onp.OnPolicy.sample_window
    monkeypatch.setattr(onp.OnPolicy, "sample_window",
                        lambda self, model, w, step: windows.append((w, window(self, model, w, step))) or windows[-1][1])
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models, CHAT_PROMPTS), "kd.on_policy.prompts_per_row=2",
                                                       "gradient_accumulation_steps=2", "max_steps=4", "seed=3",
                                                       f"output_dir={out}"]) == 0
    tok = Tokenizer.from_dir(models[0])
    chat = _chat_prompts(tok, range(1043, 1051), 48 - 8)
    train, held = chat[:5], chat[5:]
    sampled, scored = sampled[:-1], sampled[-1]  # the last batch: the held-out score at the end
    assert scored == held
    assert len(sampled) == 4 and all(len(p) == 4 for p in sampled)  # half of 8 micro-batches, 2 rows x 2 prompts
    assert not [p for batch in sampled for p in batch if p in held]
    assert len({tuple(p) for p in train}) == 5 and all(len({tuple(p) for p in batch}) == 4 for batch in sampled)
    assert sampled == [[train[i] for i in deal_prompts(3, 5, m, 0, 1, 4)] for m in range(4)]
    data = build_dataset(tok, DatasetConfig(source="transfer:passages", max_seq_len=48, packed=True, limit=16))
    rows = {tuple(r["tokens"]) for r in data}
    seen = set()
    for w, replaced in windows:
        seen |= {tuple(t) for b in w for t in b["tokens"].tolist()}
        off = [b for b, r in zip(w, replaced, strict=True) if r is b]
        assert all(tuple(t) in rows for b in off for t in b["tokens"].tolist())
        assert len(off) + sum("prompt_lens" in r for r in replaced) == len(w)
    assert sum(r is b for w, rr in windows for b, r in zip(w, rr, strict=True)) == 4 and seen == rows
    evaluated = json.loads((out / "on_policy_eval.json").read_text())
    assert evaluated["held_out_rows"] == 3 and evaluated["prompts"] == 3 and evaluated["sampled_tokens"] > 0
    assert "kd.on_policy.prompts (transfer:chat, split train[1043:], limit 8)" in evaluated["chosen_as"]


@pytest.mark.parametrize("bad", ["no_messages", "empty_prompt"])
def test_a_bad_prompt_set_stops_the_run_in_setup_with_one_line(tmp_path, models, bad):
    """A prompt set whose rows have no prompt in its format (or an empty one) fails before any weights load, in
    one line naming kd.on_policy.prompts and the row."""
    empty = _jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]},
                                          {"messages": [{"role": "user", "content": ""}]}])
    source, where = {"no_messages": ("transfer:passages", "passages.jsonl:1: missing column"),
                     "empty_prompt": (f'"{empty}"', "p.jsonl:2: column 'messages' ends in an empty user turn")}[bad]
    proc = rc.run_cli("kd", "kd/smollm2_demo", [*_kd(models, f"kd.on_policy.prompts={{source: {source}, "
                                                               "format: chat}"), f"output_dir={tmp_path / 'out'}"],
                      cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    assert line.startswith("recipe: error: kd.on_policy.prompts: ") and where in line, line
    assert "student weights" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("fmt", ["chat", "instruct"])
def test_a_prompt_only_prompt_set_trains_end_to_end(tmp_path, models, monkeypatch, fmt):
    """GKD's usual input, prompts without responses (chat rows ending in a user turn, instruct rows without an
    output), as kd.on_policy.prompts through the CLI's entry: the on-policy micro-batch samples 2 distinct prompts
    of the 3 training rows, each rendered up to where the response would start and cut to its last 48 - 8 tokens,
    and the 3 held-out ones score the student at the end."""
    from llm_recipe.components import on_policy as onp
    from llm_recipe.components.data.formats import ALPACA_PROMPT_NO_INPUT
    from llm_recipe.components.models.tokenizer import Tokenizer

    sampled = []
    batch = onp.completion_batch
    monkeypatch.setattr(onp, "completion_batch", lambda p, c, pad: sampled.append(p) or batch(p, c, pad))
    chat = _shipped_chat(range(1043, 1049))
    path = _jsonl(tmp_path / "prompts.jsonl", [{"messages": m[:-1]} if fmt == "chat" else
                                               {"instruction": m[0]["content"]} for m in chat])
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [
        *_kd(models, f'kd.on_policy.prompts={{source: "{path}", format: {fmt}}}'), "kd.on_policy.prompts_per_row=1",
        "max_steps=2", f"output_dir={out}"]) == 0
    rows = rc.assert_metrics(out, 2, {"loss", *ON_POLICY_KEYS})
    assert sum(r["on_policy_batches"] for r in rows) == 1 and sum(r["on_policy_prompts"] for r in rows) == 2
    tok = Tokenizer.from_dir(models[0])
    render = {"chat": lambda m: tok.apply_chat_template(m[:-1], add_generation_prompt=True),
              "instruct": lambda m: ALPACA_PROMPT_NO_INPUT.format(instruction=m[0]["content"])}[fmt]
    want = [tok.encode(render(m), add_bos=True)[-40:] for m in chat]
    dealt, scored = sampled[0], [p for chunk in sampled[1:] for p in chunk]  # held out: 2 + 1 (a batch is 2)
    assert scored == want[3:] and len(dealt) == 2 and all(p in want[:3] for p in dealt) and dealt[0] != dealt[1]
    evaluated = json.loads((out / "on_policy_eval.json").read_text())
    assert evaluated["held_out_rows"] == 3 and evaluated["sampled_tokens"] > 0 and "prompts.jsonl" in evaluated[
        "chosen_as"]


def test_training_on_a_prompt_only_dataset_is_refused_in_one_line(tmp_path, models):
    """A prompt-only set given as the training data (dataset:) stops the run with the training data's error."""
    path = _jsonl(tmp_path / "prompts.jsonl", [{"messages": m[:-1]} for m in _shipped_chat(range(1043, 1046))])
    proc = rc.run_cli("kd", "kd/smollm2_demo", [*_kd(models), f"dataset.source={path}", "dataset.format=chat",
                                                f"output_dir={tmp_path / 'out'}"], cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    assert line == f"recipe: error: {path}:1: column 'messages' has no assistant turn to train on", line


@pytest.mark.parametrize("data", ["one_prompt_per_row", "short_docs", "prompt_set"])
def test_resume_after_sigkill_is_bit_identical(tmp_path, models, short_docs, data):
    """Killed after a checkpoint and resumed: the same samples (nothing saved for them: seed, step and micro-batch
    fix them), so the same weights, metrics and held-out score as the uninterrupted run, bit for bit; with one
    prompt per row, with several (short documents packed together), and with prompts dealt from a prompt set."""
    extra = {"one_prompt_per_row": [], "short_docs": short_docs,
             "prompt_set": [CHAT_PROMPTS, "kd.on_policy.prompts_per_row=2"]}[data]
    args = [*_kd(models, *extra), "max_steps=6", "gradient_accumulation_steps=2", "lr_scheduler.name=cosine",
            "lr_scheduler.warmup_steps=2"]
    ref_out, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={ref_out}"]) == 0
    ckpt = [*args, f"output_dir={crashed}", "save_every_n_steps=1", "keep_last_n=2"]
    killed_at = rc.run_and_kill("kd", "kd/smollm2_demo", ckpt, crashed, cwd=tmp_path)
    assert 1 <= killed_at < 6
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*ckpt, "resume=true"]) == 0
    rc.assert_same_weights(crashed / "model", ref_out / "model")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]  # noqa: E731
    resumed, uninterrupted = rc.read_metrics(crashed), rc.read_metrics(ref_out)
    assert strip(resumed) == strip(uninterrupted)
    assert sum(r["on_policy_batches"] for r in resumed) == 6  # half of 12 micro-batches, sampled the same way
    prompts = sum(r["on_policy_prompts"] for r in resumed)
    # 2 rows of one prompt each; of 2-3 prompts each; 2 x 2 prompts dealt from the set
    assert {"one_prompt_per_row": prompts == 12, "short_docs": prompts > 18, "prompt_set": prompts == 24}[data]
    assert (crashed / "on_policy_eval.json").read_text() == (ref_out / "on_policy_eval.json").read_text()


@pytest.mark.slow  # ~1 min each: a torchrun launch of 2 processes and the 1-process reference
@pytest.mark.parametrize("prompts", ["rows", "prompt_set"])
def test_two_processes_match_one_with_twice_the_batch(tmp_path, models, short_docs, prompts):
    """2 CPU processes (gloo; the student and the teacher sharded with FSDP2) sample, score and train what one
    process with the 2-row batches of both does: the same on-policy steps, prompts (several per packed row, or
    dealt from a prompt set: the ranks' halves of the one process's), losses, reverse KL and weights. The set's 17
    training rows give each on-policy micro-batch 12 distinct prompts (2 x 2 rows x 3), 6 a rank. Equal up to
    rounding: the two batch shapes move the logits by ~1e-5, which flips a sample whose uniform lands that close to
    a boundary of the CDF (seen with 5 rows, each dealt 2-3 times a micro-batch: 2 of 14 seeds)."""
    prompt_set = CHAT_PROMPTS.replace("limit: 8", "limit: 20")
    args = [*_kd(models, "student.keep_layers=[0,3]", "teacher.placement=shard", *short_docs,
                 *([prompt_set] if prompts == "prompt_set" else [])), "max_steps=3", "max_grad_norm=1.0"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, "batch_size=4", f"output_dir={one}"]) == 0
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", "--nproc-per-node", "2", "--standalone",
                           "kd", "--config", "kd/smollm2_demo", *args, "batch_size=2", f"output_dir={two}"],
                          cwd=tmp_path, env=rc.cli_env(), capture_output=True, text=True, timeout=900)
    rc.assert_ok(proc)
    a, b = rc.read_metrics(one), rc.read_metrics(two)
    assert [r["on_policy_batches"] for r in a] == [r["on_policy_batches"] for r in b] and sum(
        r["on_policy_batches"] for r in a) >= 1
    assert [r["on_policy_prompts"] for r in a] == [r["on_policy_prompts"] for r in b]
    assert max(r["on_policy_prompts"] for r in a) > 4  # more prompts than rows
    for ra, rb in zip(a, b, strict=True):
        for k in ("loss", "on_policy_loss", "on_policy_rkl", "grad_norm"):
            assert (rb[k] is None and ra[k] is None) or rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (k, ra, rb)
    wa, wb = rc.weights(one / "model"), rc.weights(two / "model")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=2e-5, rtol=1e-4, msg=k)
    ha, hb = (json.loads((d / "on_policy_eval.json").read_text()) for d in (one, two))
    assert hb["sampled_tokens"] == ha["sampled_tokens"]
    assert hb["reverse_kl_per_token"] == pytest.approx(ha["reverse_kl_per_token"], rel=1e-4)


@pytest.mark.slow  # ~1-2 min on 2 cores: Inductor compiles the layers and the decode step for the CPU
def test_compiled_sampling_in_the_kd_recipe(tmp_path, models, short_docs):
    """`kd.on_policy.decode=compiled` with `compile=true` on CPU: the recipe's wiring of the compiled decode step
    (Inductor's CPU kernels, not CUDA graphs) between compiled training layers: it samples several prompts per row
    and the run finishes with the held-out score, the same number of prompts as eager sampling."""
    runs = {}
    for decode in ("eager", "compiled"):
        out = tmp_path / decode
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models, *short_docs), "max_steps=3", "compile=true",
                                                           f"kd.on_policy.decode={decode}", f"output_dir={out}"]) == 0
        runs[decode] = rc.assert_metrics(out, 3, {"loss", *ON_POLICY_KEYS})
        assert json.loads((out / "on_policy_eval.json").read_text())["sampled_tokens"] > 0
    prompts = [[r["on_policy_prompts"] for r in runs[d]] for d in ("eager", "compiled")]
    assert prompts[0] == prompts[1] and max(prompts[0]) > 2


def test_fraction_zero_trains_off_policy_and_scores_the_held_out_prompts(tmp_path, models):
    """kd.on_policy.fraction=0: the off-policy baseline of a comparison, with the same held-out rows and score."""
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models), "kd.on_policy.fraction=0", "max_steps=2",
                                                       f"output_dir={out}"]) == 0
    rows = rc.assert_metrics(out, 2, {"loss", "ce_loss", "kd_loss", *ON_POLICY_KEYS})
    assert all(r["on_policy_batches"] == 0 and r["on_policy_rkl"] is None and r["ce_loss"] > 0 for r in rows)
    held = json.loads((out / "on_policy_eval.json").read_text())
    assert held["held_out_rows"] == 3 and held["reverse_kl_per_token"] > 0
    assert held["prompts"] == 3 and len(held["per_prompt"]["reverse_kl"]) == 3


def test_teacher_embedding_on_the_host_changes_no_number(tmp_path, models, monkeypatch, capsys):
    """The kd loop with the teacher's embedding on the host (forced on this CPU run, as prepare_teacher does on a
    GPU): the same losses, on-policy metrics and held-out score as with it in place. On-policy micro-batches are
    built on the host (completion_batch), so their tokens reach the host embedding without a device copy."""
    from llm_recipe.components.models import host_embedding

    runs = {}
    for where in ("device", "host"):
        if where == "host":
            monkeypatch.setattr(host_embedding, "why_not_on_host", lambda model, device: None)
        out = tmp_path / where
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models), "max_steps=2", f"output_dir={out}"]) == 0
        rows = rc.assert_metrics(out, 2, {"loss", *ON_POLICY_KEYS})
        held = json.loads((out / "on_policy_eval.json").read_text())
        runs[where] = ([{k: v for k, v in r.items() if k not in TIMINGS} for r in rows], held["per_prompt"])
        said = "teacher embeddings: on the host" in capsys.readouterr().out
        assert said == (where == "host")
    assert any(r["on_policy_batches"] for r in runs["host"][0])
    assert runs["host"] == runs["device"]
