"""On-policy KD's prompt set and settings (kd.on_policy): the dealing rule (which rows of a prompt set an on-policy
micro-batch samples: whole micro-batches per pass, 2 ranks = 1 process with twice the batch), load_prompt_set
(prompts cut to the budget, the held-out tail, prompt-only rows, one-line errors naming the key and the row), and
the config checks (the decode path, cross-key errors, `recipe validate` naming the key)."""

from __future__ import annotations

import subprocess

import on_policy_common as opc
import pytest
import recipes_common as rc
import torch

from llm_recipe.components.data.dataset import DatasetConfig
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.on_policy import (
    OnPolicySettings,
    check_on_policy,
    deal_prompts,
    decode_path,
    is_on_policy,
    load_prompt_set,
    on_policy_index,
)

_jsonl, _shipped_chat, _chat_prompts = opc.jsonl, opc.shipped_chat, opc.chat_prompts


# ---------------------------------------------------------------------------------------- a prompt set


@pytest.mark.parametrize("fraction", [0.25, 0.3, 0.5, 1.0])
def test_on_policy_index_counts_the_on_policy_micro_batches_before(fraction):
    """m of micro-batch k is how many of micro-batches 0..k-1 went on-policy: the on-policy ones get 0, 1, 2, ..."""
    for seed in range(4):
        picks = [is_on_policy(seed, k, 0, 1, fraction) for k in range(300)]
        assert [on_policy_index(seed, k, fraction) for k in range(300)] == [sum(picks[:k]) for k in range(300)]


@pytest.mark.parametrize("fraction,accum", [(0.02, 8), (0.02, 1), (0.1, 8), (0.5, 3), (1.0, 2)])
def test_the_run_plan_counts_the_micro_batches_that_go_on_policy(fraction, accum):
    """The line before the first step counts exactly the micro-batches is_on_policy picks in steps start+1..steps
    (a resume counts the steps it has left); none at a share above 0 is a warning that names the key and a share
    that would sample; nothing to say at fraction 0 or with no step left (a resume of a finished run)."""
    from llm_recipe.components.on_policy_prompts import on_policy_plan

    warned = 0
    for seed in range(6):
        for start, steps in ((0, 10), (0, 120), (37, 64)):
            picked = sum(is_on_policy(seed, step, m, accum, fraction) for step in range(start, steps)
                         for m in range(accum))
            line = on_policy_plan(seed, fraction, accum, start, steps)
            total = (steps - start) * accum
            which = (f"this run's {total} micro-batches" if start == 0
                     else f"the {total} micro-batches of the steps left")
            if picked:
                assert line == (f"on-policy: {picked} of {which} "
                                f"(kd.on_policy.fraction={fraction:g}, spread evenly)")
            else:
                warned += 1
                assert line.startswith(f"warning: kd.on_policy.fraction={fraction:g} puts none of {which} "
                                       f"({steps - start} steps x {accum}) on-policy")
                share = float(line.split("raise kd.on_policy.fraction to at least ")[1].split(",")[0])
                assert on_policy_plan(seed, share, accum, start, steps).startswith("on-policy: ")  # it does sample
                assert share <= 1.1 / total  # and is not much more than needed
    # only a small share over few micro-batches puts none there: 0.02 of 10 or 27 steps of one micro-batch, for
    # most seeds (the phase decides), never 8 micro-batches a step or 120 steps
    assert (warned > 0) == ((fraction, accum) == (0.02, 1))
    assert on_policy_plan(0, 0.0, 8, 0, 100) is None  # fraction 0: the off-policy baseline, asked for
    assert on_policy_plan(0, fraction, accum, 64, 64) is None  # resumed at its last step: nothing left to train


@pytest.mark.parametrize("micro_batches", [1, 2, 3, 7, 10, 27, 70, 99, 101, 333, 1000, 4999])
def test_the_share_a_warning_suggests_samples_at_least_once_in_any_phase(micro_batches):
    """The share a warning suggests has two significant digits and puts at least one micro-batch on-policy in any
    run of that many micro-batches, whatever the seed's phase and wherever the run starts (a resume)."""
    from llm_recipe.components.on_policy_prompts import share_for_one

    share = share_for_one(micro_batches)
    assert share * micro_batches >= 1 and float(f"{share:.2g}") == share
    for seed in range(20):
        for first in (0, 1, 13, 977):
            assert sum(is_on_policy(seed, first + k, 0, 1, share) for k in range(micro_batches)) >= 1


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


# ---------------------------------------------------------------------------------------- config


def test_decode_path_compiles_on_cuda_with_compile():
    """auto compiles on CUDA with compile: true (on several processes too: OnPolicy then samples with the unsharded
    twin, where it fits); `compiled` compiles anywhere; `eager` never."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto, eager, compiled = (OnPolicySettings(decode=d) for d in ("auto", "eager", "compiled"))
    assert decode_path(auto, True, cuda) == "compiled"
    assert [decode_path(auto, c, d) for c, d in ((False, cuda), (True, cpu))] == ["eager", "eager"]
    assert decode_path(eager, True, cuda) == "eager" and decode_path(compiled, False, cpu) == "compiled"


def test_settings_defaults_and_cross_key_errors():
    text = DatasetConfig(source="x", max_seq_len=128)
    check_on_policy(None, "cache", text)  # off: nothing to check
    check_on_policy(OnPolicySettings(fraction=0.5), None, text)
    with pytest.raises(RecipeError, match=r"needs a live teacher.*teacher.logits_dir"):
        check_on_policy(OnPolicySettings(), "cache", text)
    with pytest.raises(RecipeError, match=r"kd.on_policy.max_new_tokens=128 must be below dataset.max_seq_len=128"):
        check_on_policy(OnPolicySettings(max_new_tokens=128), None, text)
    # text prompts (the first prompt_tokens of a document) and their completions share a row: they were cut to fit
    check_on_policy(OnPolicySettings(prompt_tokens=64, max_new_tokens=64), None, text)
    with pytest.raises(RecipeError, match=r"^kd.on_policy.prompt_tokens=65 does not fit: a prompt and its "
                       r"kd.on_policy.max_new_tokens=64 completion share one row of dataset.max_seq_len=128, so a "
                       r"prompt takes at most 64 tokens \(lower prompt_tokens or max_new_tokens, or raise "
                       r"dataset.max_seq_len\)$"):
        check_on_policy(OnPolicySettings(prompt_tokens=65, max_new_tokens=64), None, text)
    chat = DatasetConfig(source="x", max_seq_len=128, format="chat")
    check_on_policy(OnPolicySettings(prompt_tokens=500), None, chat)  # chat prompts keep their end: not used
    with pytest.raises(RecipeError, match=r"prompt_tokens=500 does not fit"):  # a text prompt set: used
        check_on_policy(OnPolicySettings(prompt_tokens=500, prompts=DatasetConfig(source="p", format="text")), None,
                        chat)
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
def test_validate_names_the_key(capsys, override, message):
    # the CLI's entry point in this process (test_cli.py runs `recipe validate` errors through a real process)
    code, _, err = rc.cli_captured(capsys, ["validate", "kd/smollm2_demo", "--recipe", "kd", override])
    assert code == 1
    assert message in rc.one_error(err), err


# ---------------------------------------------------------------------------------------- held_out, before any weights


def test_held_out_that_dataset_limit_cannot_leave_rows_for_is_refused_at_load(capsys):
    """Packed or not, a dataset has at most dataset.limit rows (a prompt set at most its limit): held_out >= limit
    leaves none to train on, which `recipe validate` now says from the config alone (the run said it after the
    weights had loaded)."""
    text = DatasetConfig(source="x", max_seq_len=128, limit=8)
    with pytest.raises(RecipeError, match=r"^kd.on_policy.held_out=16 leaves no training rows: dataset.limit=8 keeps "
                                          r"at most 8 \(lower held_out below 8, or raise dataset.limit\)$"):
        check_on_policy(OnPolicySettings(), None, text)
    check_on_policy(OnPolicySettings(held_out=7), None, text)
    check_on_policy(OnPolicySettings(held_out=0), None, DatasetConfig(source="x", max_seq_len=128, limit=1))
    prompts = DatasetConfig(source="p", format="chat", limit=4)  # the prompt set holds its own rows out
    check_on_policy(OnPolicySettings(prompts=prompts, held_out=3), None, text)
    with pytest.raises(RecipeError, match=r"held_out=4 leaves no training rows: kd.on_policy.prompts.limit=4 keeps"):
        check_on_policy(OnPolicySettings(prompts=prompts, held_out=4), None, text)
    code, _, err = rc.cli_captured(capsys, ["validate", "kd/smollm2_demo", "kd.on_policy.fraction=0.5", "dataset.limit=8"])
    assert code == 1 and rc.one_error(err) == ("recipe: error: kd.on_policy.held_out=16 leaves no training rows: "
                                               "dataset.limit=8 keeps at most 8 (lower held_out below 8, or raise "
                                               "dataset.limit)")


def test_held_out_that_takes_every_tokenized_row_fails_before_any_weights_load(tmp_path, monkeypatch, capsys,
                                                                             tiny_model_dir):
    """20 passages pack into 16 rows of 512 tokens: held_out=16 passes the limit check, and the tokenized data
    (built before the layers are scored or any weights load) says there is no row left to train on."""
    monkeypatch.chdir(tmp_path)
    code = rc.run_in_process("kd", "kd/smollm2_demo", [
        f"teacher.checkpoint_dir={tiny_model_dir}", f"output_dir={tmp_path}/out", "device=cpu", "dtype=fp32",
        "student.prune=null", "dataset.limit=20", "dataset.max_seq_len=512", "kd.on_policy={fraction: 0.5, held_out: 16}",
        "max_steps=1"])
    out, err = capsys.readouterr()
    assert code == 1 and "setup: student layers" not in out and "weights" not in out, out
    assert rc.error_lines(subprocess.CompletedProcess([], 1, out, err)) == [
        "recipe: error: kd.on_policy.held_out=16 leaves no training rows: the dataset has 16 after packing (lower "
        "held_out below 16, or add rows to the dataset)"]


@pytest.mark.parametrize("override, message", [
    ("kd.beta=0.5", "kd.beta=0.5: kd.loss=forward_kl does not read it (beta is an option of jsd); set kd.beta: null, "
                    "or a kd.loss that takes it"),
    ("kd.alpha=0.2", "kd.alpha=0.2: kd.loss=forward_kl does not read it (alpha is an option of skew_kl and "
                     "skew_reverse_kl); set kd.alpha: null, or a kd.loss that takes it"),
])
def test_a_kd_option_the_loss_does_not_read_names_the_key_and_who_reads_it(capsys, override, message):
    """It said `kd loss 'forward_kl' does not take beta; its options are: ` (an empty list) without the key."""
    code, _, err = rc.cli_captured(capsys, ["validate", "kd/smollm2_demo", override])
    assert code == 1 and rc.one_error(err) == f"recipe: error: {message}"


def test_a_prompt_set_read_from_the_training_rows_is_known_as_such(tmp_path, monkeypatch):
    """`kd.on_policy.prompts` naming the training rows themselves (the same file, even spelled another way, split
    and files; no limit on the training rows that stops before the held-out ones): its held-out prompts are trained
    on off-policy, which the run says (its held-out score used to say "never sampled in training" and nothing more).
    Two slices of one file, or another file, are rows of their own."""
    from llm_recipe.components.on_policy_prompts import reads_training_rows

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "other.jsonl").write_text('{"text": "b"}\n')
    train = DatasetConfig(source="rows.jsonl")
    assert reads_training_rows(DatasetConfig(source=str(tmp_path / "rows.jsonl")), train)
    assert reads_training_rows(DatasetConfig(source="./rows.jsonl", limit=5), DatasetConfig(source="rows.jsonl", limit=5))
    assert not reads_training_rows(DatasetConfig(source="rows.jsonl"), DatasetConfig(source="rows.jsonl", limit=5))
    assert not reads_training_rows(DatasetConfig(source="other.jsonl"), train)
    assert not reads_training_rows(DatasetConfig(source="rows.jsonl", split="train[-10:]"),
                                   DatasetConfig(source="rows.jsonl", split="train[:-10]"))
    assert reads_training_rows(DatasetConfig(source="transfer:chat"), DatasetConfig(source="transfer:chat"))


def test_held_out_prompts_are_found_at_the_start_of_training_documents():
    """`prompts_in_documents` counts the held-out prompts a training document begins with, token for token, each
    document of a packed row on its own: not a prompt found inside a document, nor one longer than the document."""
    from llm_recipe.components.data.dataset import TokenizedDataset
    from llm_recipe.components.on_policy_prompts import prompts_in_documents

    packed = TokenizedDataset([{"tokens": [1, 5, 6, 7, 1, 8, 9, 0], "labels": [0] * 8, "seq_lens": [4, 3, 1]}],
                              0, 8, True, False, False, "t")
    plain = TokenizedDataset([{"tokens": [1, 4, 4], "labels": [0] * 3}], 0, 8, False, False, False, "t")
    assert prompts_in_documents([[1, 8], [1, 5, 6], [5, 6], [1, 8, 9, 0], [1, 8]], packed) == 3
    assert prompts_in_documents([[1, 4], [1, 4, 4, 4], [4]], plain) == 1
    assert prompts_in_documents([], plain) == 0
