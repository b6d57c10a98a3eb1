"""The kd recipe with on-policy KD (kd.on_policy) end to end on tiny random models: metrics and the held-out score
(full, LoRA and QAT students), held-out rows never train, a prompt set dealt in a run, prompt-only prompt sets and
their errors, bit-identical resume after SIGKILL, 2 processes = 1 process with twice the batch, compiled sampling,
fraction 0, the teacher's embedding on the host, and a sampling KV budget of a whole step."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import on_policy_common as opc
import pytest
import recipes_common as rc
import reliability_doc as doc
import torch

from llm_recipe.components.data.dataset import DatasetConfig
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.kd_settings import KDSettings
from llm_recipe.components.models import ModelArgs, build_model
from llm_recipe.components.on_policy import OnPolicySettings, deal_prompts

_jsonl, _shipped_chat, _chat_prompts = opc.jsonl, opc.shipped_chat, opc.chat_prompts


# ---------------------------------------------------------------------------------------- the kd recipe


@pytest.fixture(scope="module")
def models(tmp_path_factory, embedded_tokenizer_dir) -> tuple[Path, Path]:
    """A teacher and a different student (tiny, random, SmolLM2's tokenizer; peaked heads)."""
    return _model_pair(tmp_path_factory.mktemp("on_policy_models"), embedded_tokenizer_dir, hidden=64)


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory, embedded_tokenizer_dir) -> tuple[Path, Path]:
    """`models` 256 wide: an NF4 base shards over 2 processes only in multiples of 32,768 elements per weight."""
    return _model_pair(tmp_path_factory.mktemp("on_policy_wide_models"), embedded_tokenizer_dir, hidden=256)


def _model_pair(root: Path, tokenizer_dir: Path, hidden: int) -> tuple[Path, Path]:
    from llm_recipe.components.models import save_model

    args = ModelArgs.from_hf_config({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2})
    for name, seed in (("teacher", 0), ("student", 1)):
        torch.manual_seed(seed)
        model = build_model(args)
        with torch.no_grad():
            model.output.weight.mul_(8.0)
        save_model(model, args, root / name, tokenizer_dir=tokenizer_dir)
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
def test_kd_recipe_logs_on_policy_metrics_and_scores_held_out_prompts(tmp_path, models, student, capsys):
    extra = {"full": ["student.keep_layers=[0,3]"],  # pruned, full, fused loss
             "lora": ["lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, lm_head]}"],  # checkpointed loss
             "qat": ["qat={scheme: 8da4w, group_size: 32}"]}[student]  # KD-QAT
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models, *extra), "max_steps=4",
                                                       f"output_dir={out}"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert "on-policy: 2 of this run's 4 micro-batches (kd.on_policy.fraction=0.5, spread evenly)" in said
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
    from llm_recipe.components import on_policy_sampling, on_policy_score
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.models.tokenizer import Tokenizer

    sampled, windows = [], []
    batch = on_policy_sampling.completion_batch
    for module in (on_policy_sampling, on_policy_score):  # training's on-policy batches, and the held-out score's
        monkeypatch.setattr(module, "completion_batch", lambda p, c, pad: sampled.append(p) or batch(p, c, pad))
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
    from llm_recipe.components import on_policy_sampling, on_policy_score
    from llm_recipe.components.data.formats import ALPACA_PROMPT_NO_INPUT
    from llm_recipe.components.models.tokenizer import Tokenizer

    sampled = []
    batch = on_policy_sampling.completion_batch
    for module in (on_policy_sampling, on_policy_score):  # training's on-policy batches, and the held-out score's
        monkeypatch.setattr(module, "completion_batch", lambda p, c, pad: sampled.append(p) or batch(p, c, pad))
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


@pytest.mark.parametrize(("train_split", "seen"), [("train", 3), ("train[:-2]", 1), ("train[:-3]", 0)])
def test_a_prompt_set_sliced_from_the_training_rows_is_known_by_its_tokens(tmp_path, models, capsys, train_split,
                                                                            seen):
    """kd.on_policy.prompts with the last 5 rows of the training file (split train[-5:], the last 3 held out) while
    the training rows are the whole split: the run says its held-out prompts are training rows (found token for token), and the
    held-out score says they were trained on (it compared the two split strings, and took train vs train[-5:] for
    rows of their own). train[:-2] trains on 1 of them; with train[:-3] they are unseen and nothing is said."""
    path = _jsonl(tmp_path / "rows.jsonl", [{"text": f"row {i}: the {w} crossed the river at dawn and rested."}
                                            for i, w in enumerate("fox owl deer hare wolf bear crow lynx elk mole".split())])
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [
        *_kd(models, f'kd.on_policy.prompts={{source: "{path}", format: text, split: "train[-5:]"}}'),
        f"dataset.source={path}", "dataset.limit=null", f"dataset.split={train_split}",
        "kd.on_policy.prompts_per_row=1", "max_steps=1", f"output_dir={out}"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ") and "held-out" in line]
    chosen = json.loads((out / "on_policy_eval.json").read_text())["chosen_as"]
    if seen:
        assert len(said) == 1 and said[0].startswith(f"note: {seen} of the 3 held-out prompts of kd.on_policy.prompts "
                                                     "are training rows"), said
        assert f"but {seen} of them are training rows (trained on off-policy)" in chosen
    else:
        assert said == [] and chosen.endswith("never sampled in training"), chosen


def test_a_prompt_set_of_the_training_rows_rendered_another_way_is_known_as_such(tmp_path, models, capsys):
    """The prompt set is the training file and split, but rendered another way (the training rows through the chat
    template, the prompt set with its default use_chat_template=false): no prompt begins a training document token
    for token, yet every held-out row is trained on, which the run says (the two sections name the same rows)."""
    path = _jsonl(tmp_path / "rows.jsonl", [{"instruction": f"Name animal number {i}.", "output": f"The {w}."}
                                            for i, w in enumerate("fox owl deer hare wolf bear crow lynx".split())])
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [
        *_kd(models, f'kd.on_policy.prompts={{source: "{path}", format: instruct}}'), f"dataset.source={path}",
        "dataset.format=instruct", "dataset.use_chat_template=true", "dataset.limit=null",
        "kd.on_policy.prompts_per_row=1", "max_steps=1", f"output_dir={out}"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ") and "held-out" in line]
    assert len(said) == 1 and said[0].startswith("note: 3 of the 3 held-out prompts of kd.on_policy.prompts are "
                                                 "training rows"), said
    assert "but 3 of them are training rows" in json.loads((out / "on_policy_eval.json").read_text())["chosen_as"]


def test_training_on_a_prompt_only_dataset_is_refused_in_one_line(tmp_path, models):
    """A prompt-only set given as the training data (dataset:) stops the run with the training data's error."""
    path = _jsonl(tmp_path / "prompts.jsonl", [{"messages": m[:-1]} for m in _shipped_chat(range(1043, 1046))])
    proc = rc.run_cli("kd", "kd/smollm2_demo", [*_kd(models), f"dataset.source={path}", "dataset.format=chat",
                                                f"output_dir={tmp_path / 'out'}"], cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    assert line == f"recipe: error: {path}:1: column 'messages' has no assistant turn to train on", line


# ~25 s each: the default suite kills and resumes the short_docs case; the other two are slow-marked
@pytest.mark.parametrize("data", [pytest.param("one_prompt_per_row", marks=pytest.mark.slow), "short_docs",
                                  pytest.param("prompt_set", marks=pytest.mark.slow)])
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


@pytest.mark.parametrize(("prompt_tokens", "layout"), [(8, "padded"), (40, "packed")])
def test_a_steps_on_policy_micro_batches_sample_at_once_and_draw_what_each_would_alone(tmp_path, models, short_docs,
                                                                                      monkeypatch, prompt_tokens,
                                                                                      layout):
    """A step's on-policy micro-batches (4 of 4 here) are sampled in one batch, each prompt with its own
    micro-batch's noise: the same completions as sampling each micro-batch alone, so the same run. Each micro-batch's
    samples train in the layout with fewer tokens: one per row (6 x 16 here, against the loader's 2 x 96) for prompts
    of one length, two of them joined into one pass (12 x 16, a data micro-batch's 192 positions), packed back into
    their rows (the loader's shape) for most micro-batches of many lengths."""
    from llm_recipe.components import on_policy as onp

    calls: dict[str, list] = {"together": [], "alone": []}
    sample, window, shapes = onp.OnPolicy._sample, onp.OnPolicy.sample_window, []

    def sample_window(self, model, loaded, step):
        out = window(self, model, loaded, step)
        shapes.append([(tuple(b["tokens"].shape), len(b.get("prompt_lens", [])), "input_pos" in b)
                       for b in [*loaded, *out]])
        return out

    monkeypatch.setattr(onp.OnPolicy, "sample_window", sample_window)
    args = [*_kd(models, *short_docs), "max_steps=2", "gradient_accumulation_steps=4", "kd.on_policy.fraction=1.0",
            "kd.on_policy.held_out=0", f"kd.on_policy.prompt_tokens={prompt_tokens}"]
    for how in calls:
        if how == "alone":
            monkeypatch.setattr(onp, "sampling_groups", lambda sizes, *_: [[i] for i in range(len(sizes))])

        def recorded(self, model, prompts, seed, rows, width, how=how):
            got = sample(self, model, prompts, seed, rows, width)
            calls[how].append((seed, prompts, got))
            return got

        monkeypatch.setattr(onp.OnPolicy, "_sample", recorded)
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={tmp_path / how}"]) == 0
    loops = [len(seed) for seed, _, _ in calls["together"]]  # micro-batches per sampling loop
    # one loop per step; longer prompts: groups as large as the decode batch's memory bound lets them be
    assert loops == [4, 4] if layout == "padded" else sum(loops) == 8 and len(loops) < 8
    (loader,) = {shape for step in shapes for shape, _, _ in step[:4]}
    on = [(shape, prompts, packed) for step in shapes for shape, prompts, packed in step[4:]]
    assert all(prompts > 2 for _, prompts, _ in on)  # several prompts per row
    for shape, prompts, packed in on:  # packed: the loader's rows; else one per row, fewer tokens than packed
        assert shape == loader if packed else shape[0] == prompts and math.prod(shape) <= math.prod(loader)
    assert any(packed for *_, packed in on) == (layout == "packed")  # 40-token prompts: 6-38 tokens (short docs)
    if layout == "padded":  # each step's 4 on-policy micro-batches train in 2 passes (training_batches), both runs
        assert [len(step) - 4 for step in shapes] == [2, 2, 2, 2]
    assert len(calls["alone"]) == 8 and all(len(seed) == 1 for seed, _, _ in calls["alone"])
    flat = {how: [(p, c) for _, prompts, got in calls[how] for p, c in zip(prompts, got, strict=True)] for how in calls}
    assert flat["together"] == flat["alone"] and len(flat["alone"]) > 8
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]  # noqa: E731
    assert strip(rc.read_metrics(tmp_path / "together")) == strip(rc.read_metrics(tmp_path / "alone"))


def test_on_policy_micro_batches_between_off_policy_ones_join_and_train_as_apart(tmp_path, models, short_docs,
                                                                                  monkeypatch):
    """Half of a step's 4 micro-batches on-policy (never adjacent: fraction 0.5 spreads them), 6 samples x 16 each:
    the two train in one pass of 12 x 16 at the first one's place, the off-policy ones stay as the loader gave
    them, in order; and the run's losses, on-policy metrics and gradient norms are those of training every
    micro-batch in its own pass."""
    from llm_recipe.components import on_policy as onp
    from llm_recipe.components import on_policy_sampling

    window, seen = onp.OnPolicy.sample_window, []
    monkeypatch.setattr(onp.OnPolicy, "sample_window",
                        lambda self, model, w, step: seen.append((list(w), window(self, model, w, step))) or seen[-1][1])
    args = [*_kd(models, *short_docs), "kd.on_policy.prompt_tokens=8", "kd.on_policy.held_out=0",
            "gradient_accumulation_steps=4", "max_steps=2"]
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={tmp_path / 'joined'}"]) == 0
    for loaded, out in seen:
        chosen = [i for i, b in enumerate(loaded) if not any(b is o for o in out)]
        assert len(chosen) == 2 and chosen[1] - chosen[0] == 2 and len(out) == 3
        joined = out[chosen[0]]
        assert "prompt_lens" in joined and joined["tokens"].shape == (12, 16)
        assert all(o is b for o, b in zip(out, [b for i, b in enumerate(loaded) if i != chosen[1]], strict=True)
                   if o is not joined)
    monkeypatch.setattr(onp.OnPolicy, "sample_window", window)
    monkeypatch.setattr(on_policy_sampling, "joined_runs", lambda sizes, capacity: [[i] for i in range(len(sizes))])
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={tmp_path / 'apart'}"]) == 0
    joined_rows, apart_rows = rc.read_metrics(tmp_path / "joined"), rc.read_metrics(tmp_path / "apart")
    assert [r["on_policy_batches"] for r in joined_rows] == [r["on_policy_batches"] for r in apart_rows] == [2, 2]
    for a, b in zip(joined_rows, apart_rows, strict=True):
        for k in ("loss", "ce_loss", "kd_loss", "on_policy_loss", "on_policy_rkl", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (k, a, b)


def test_where_data_micro_batches_have_one_shape_on_policy_passes_take_it_and_train_the_same(tmp_path, models,
                                                                                           short_docs, monkeypatch):
    """Packed and compiled, every data micro-batch is batch_size x max_seq_len (the loader drops a short last
    batch); there the on-policy samples train in passes of that shape or half its rows, so the compiled layers see
    two shapes at most (chosen here by hand, without compiling): every pass of the run has one of them, fewer
    passes than micro-batches, and the losses, on-policy metrics and gradient norms are those of the default
    layouts (one sample per row, joined)."""
    from llm_recipe.components import on_policy as onp

    window, init, seen = onp.OnPolicy.sample_window, onp.OnPolicy.__init__, []
    monkeypatch.setattr(onp.OnPolicy, "sample_window",
                        lambda self, model, w, step: seen.append((list(w), window(self, model, w, step))) or seen[-1][1])
    args = [*_kd(models, *short_docs), "kd.on_policy.prompt_tokens=8", "kd.on_policy.held_out=0",
            "gradient_accumulation_steps=4", "kd.on_policy.fraction=0.75", "max_steps=2"]
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={tmp_path / 'default'}"]) == 0
    assert any(b["tokens"].shape != loaded[0]["tokens"].shape for loaded, out in seen for b in out)
    seen.clear()
    monkeypatch.setattr(onp.OnPolicy, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "loader_shape": True}))
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={tmp_path / 'shaped'}"]) == 0
    for loaded, out in seen:
        rows, width = loaded[0]["tokens"].shape
        assert {tuple(b["tokens"].shape) for b in out} <= {(rows, width), (-(-rows // 2), width)}
        assert len(out) < len(loaded)
    shaped, default = rc.read_metrics(tmp_path / "shaped"), rc.read_metrics(tmp_path / "default")
    assert [r["on_policy_batches"] for r in shaped] == [r["on_policy_batches"] for r in default] == [3, 3]
    for a, b in zip(shaped, default, strict=True):
        for k in ("loss", "ce_loss", "kd_loss", "on_policy_loss", "on_policy_rkl", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-5), (k, a, b)


@pytest.mark.slow  # ~1 min: three short compiled runs on CPU
def test_a_compiled_on_policy_run_compiles_no_layer_graph_for_dynamic_sizes(tmp_path, models, short_docs,
                                                                           monkeypatch):
    """With `compile: true` and packed data, the layers' compiled code holds only static graphs after an on-policy
    run, at most one more set than an off-policy run (the samples' passes of half the loader's rows): no pass of
    another shape makes Dynamo compile the layers for dynamic sizes, a graph it would then also run every data
    micro-batch through (~25% slower off-policy steps on an H200, docs/kd_study.md), and sampling runs eagerly or
    in its own compiled step. With the samples' own layouts (one per row, as wide as the longest) it does. Read
    from Dynamo's cache entries: a dynamic dim is `None` in the size its guard checks for the layer's input."""
    from torchtune.modules import TransformerSelfAttentionLayer

    from llm_recipe.components import on_policy as onp

    # batch 4: a pass of half the rows is 2 x 96 (a pass of 1 row is static anyway: Dynamo specializes sizes 0, 1)
    args = [*_kd(models, *short_docs), "kd.on_policy.prompt_tokens=8", "kd.on_policy.held_out=2", "compile=true",
            "gradient_accumulation_steps=2", "max_steps=3", "batch_size=4"]

    def graphs(out: str, *extra: str) -> tuple[int, int]:  # (entries, entries for dynamic sizes) after a run
        torch._dynamo.reset()
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, *extra, f"output_dir={tmp_path / out}"]) == 0
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(TransformerSelfAttentionLayer.forward.__code__)
        x = [[p for p in e.guard_manager.code_parts if p.startswith("check_tensor(L['x']")] for e in entries]
        assert all(len(parts) == 1 for parts in x), x
        return len(entries), sum("None" in parts[0].split("size=")[1].split("]")[0] for parts in x)

    off, dynamic = graphs("off", "kd.on_policy.fraction=0")
    assert off >= 2 and dynamic == 0  # teacher and student (grad mode) at least
    on, dynamic = graphs("on")
    assert off <= on <= 2 * off and dynamic == 0
    init = onp.OnPolicy.__init__
    monkeypatch.setattr(onp.OnPolicy, "__init__", lambda self, *a, **k: init(self, *a, **{**k, "loader_shape": False}))
    assert graphs("own_layouts")[1] > 0
    torch._dynamo.reset()


def test_a_kv_budget_of_a_whole_step_samples_it_in_one_loop_and_changes_no_number(tmp_path, models, short_docs,
                                                                                  monkeypatch, capsys):
    """Where memory allows a step's prompts in one decode loop (`sampling_kv_positions` chooses `step` on a GPU with
    room; chosen here by hand, CPU memory is not measured), long prompts that took several loops per step take one,
    and the run is the same: samples, losses and held-out score. The log says which budget it took and why."""
    from llm_recipe.components import on_policy as onp

    loops: dict[str, list[int]] = {"micro": [], "step": []}
    sample = onp.OnPolicy._sample
    args = [*_kd(models, *short_docs), "max_steps=2", "gradient_accumulation_steps=4", "kd.on_policy.fraction=1.0",
            "kd.on_policy.held_out=2", "kd.on_policy.prompt_tokens=40"]
    for budget in loops:
        if budget == "step":
            monkeypatch.setattr(onp, "sampling_kv_positions",
                                lambda model, micro, step, *_: (step, f"{step} positions (test)"))

        def counted(self, model, prompts, seed, rows, width, budget=budget):
            if not isinstance(seed, int):  # a training step's loop (the held-out rows' pass has one seed)
                loops[budget].append(len(seed))  # micro-batches sampled in this loop
            return sample(self, model, prompts, seed, rows, width)

        monkeypatch.setattr(onp.OnPolicy, "_sample", counted)
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, f"output_dir={tmp_path / budget}"]) == 0
        said = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("on-policy decode KV caches: ")]
        assert len(said) == 1 and ("(on cpu)" in said[0]) == (budget == "micro")
    assert len(loops["micro"]) > 2 and loops["step"] == [4, 4]  # 2 steps of 4 on-policy micro-batches
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]  # noqa: E731
    assert strip(rc.read_metrics(tmp_path / "micro")) == strip(rc.read_metrics(tmp_path / "step"))
    assert (tmp_path / "micro" / "on_policy_eval.json").read_text() == (tmp_path / "step" / "on_policy_eval.json").read_text()


@pytest.mark.slow  # ~1 min each: a torchrun launch of 2 processes and the 1-process reference
@pytest.mark.parametrize("prompts", ["rows", "prompt_set", "joined", "compiled"])
def test_two_processes_match_one_with_twice_the_batch(tmp_path, models, short_docs, prompts):
    """2 CPU processes (gloo; the student and the teacher sharded with FSDP2) sample, score and train what one
    process with the 2-row batches of both does: the same on-policy steps, prompts (several per packed row, or
    dealt from a prompt set: the ranks' halves of the one process's), losses, reverse KL and weights. The set's 17
    training rows give each on-policy micro-batch 12 distinct prompts (2 x 2 rows x 3), 6 a rank. Equal up to
    rounding: the two batch shapes move the logits by ~1e-5, which flips a sample whose uniform lands that close to
    a boundary of the CDF (seen with 5 rows, each dealt 2-3 times a micro-batch: 2 of 14 seeds)."""
    prompt_set = CHAT_PROMPTS.replace("limit: 8", "limit: 20")
    # rows: 5 held-out rows give 13-15 prompts, 3 chunks of a rank's 6: rank 1 scores a chunk again and drops it
    # joined: both micro-batches of a step on-policy, each rank's two (6 x 16) trained in one pass as the one
    # process's (12 x 16; training_batches), the sizes agreed over the ranks; one step (the 15 training rows end an
    # epoch in the second, which 1 and 2 processes deal differently)
    # compiled: packed data and compiled layers, so the samples train in the loader's shape, as many passes on
    # each rank as the rank with the most rows needs (loader_shaped_batches)
    case = {"rows": ["kd.on_policy.held_out=5", "max_steps=3"], "prompt_set": [prompt_set, "max_steps=3"],
            "joined": ["kd.on_policy.held_out=5", "kd.on_policy.fraction=1.0", "gradient_accumulation_steps=2",
                       "max_steps=1"],
            "compiled": ["kd.on_policy.held_out=5", "kd.on_policy.fraction=1.0", "gradient_accumulation_steps=2",
                         "max_steps=1", "compile=true"]}[prompts]
    args = [*_kd(models, "student.keep_layers=[0,3]", "teacher.placement=shard", *short_docs, *case),
            "max_grad_norm=1.0"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, "batch_size=4", f"output_dir={one}"]) == 0
    printed = _assert_two_processes_match_one(args, one, two, tmp_path)
    assert ("trained in passes of a data micro-batch's shape" in printed) == (prompts == "compiled")
    if prompts == "rows":
        assert 12 < json.loads((one / "on_policy_eval.json").read_text())["held_out_rows"] <= 18


@pytest.mark.slow  # ~30 s: a torchrun launch of 2 processes and the 1-process reference
def test_two_processes_whose_samples_differ_in_width_join_alike(tmp_path, models):
    """A text prompt set dealt so that rank 0 samples 32-token prompts and rank 1 a few tokens (2 prompts a rank,
    both micro-batches of the step on-policy): alone, rank 1's two would train in one pass (4 x ~10 of a data
    micro-batch's 96 positions) and rank 0's could not (4 x ~40); the sizes agreed over the ranks keep both at two
    passes, so the sharded teacher's collectives stay in step, and the run matches 1 process with twice the
    batch."""
    from llm_recipe.components.on_policy_prompts import deal_prompts

    seed, train = 3, 8
    long = {i for m in (0, 1) for i in deal_prompts(seed, train, m, 0, 2, 2)}  # the step's rows of rank 0
    assert len(long) == 4
    text = {True: "the old stone bridge over the river led north to the market town " * 4, False: "Hi there."}
    path = _jsonl(tmp_path / "prompts.jsonl", [{"text": text[i in long]} for i in range(train + 2)])
    args = [*_kd(models, "student.keep_layers=[0,3]", "teacher.placement=shard",
                 f'kd.on_policy.prompts={{source: "{path}", format: text}}', "kd.on_policy.held_out=2",
                 "kd.on_policy.prompt_tokens=32", "kd.on_policy.prompts_per_row=1", "kd.on_policy.fraction=1.0"),
            "gradient_accumulation_steps=2", "max_steps=1", f"seed={seed}"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, "batch_size=4", f"output_dir={one}"]) == 0
    _assert_two_processes_match_one(args, one, two, tmp_path)


@pytest.mark.slow  # ~1 min each on 2 cores: Inductor compiles the decode step in the 1-process run and each rank
@pytest.mark.parametrize("student", ["full", "lora", "qlora", "dora", "qat"])
def test_two_processes_sample_with_the_compiled_step_on_an_unsharded_twin(tmp_path, request, short_docs, student):
    """`kd.on_policy.decode=compiled` on 2 processes (gloo): each rank samples with the compiled step on an
    unsharded twin of the sharded student (components/sampling_twin.py), its trained weights gathered into it before
    each sampling (a LoRA student's merged into its weights), so the steps, prompts, losses, weights and held-out
    score are those of 1 process sampling with the compiled step on its own student with twice the batch. A twin
    left with the step's first weights, or a rank sampling another's prompts, would move the later steps' losses. KD-QAT against 2 processes sampling eagerly
    through the sharded student instead: after one step the weights of 1 and 2 processes are ~1e-6 apart (rounding),
    which fake quantization's int4 rounding turns into different samples at step 2, on either path."""
    lora = "lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, down_proj]"  # only the adapters are refreshed
    kind = {"full": ["student.keep_layers=[0,3]"], "lora": [lora + "}"],
            "qlora": [lora + ", quantize_base: nf4}"],  # an NF4 base, gathered into the twin once
            "dora": [lora + ", use_dora: true}"],  # DoRA's magnitudes are trained too
            "qat": ["student.keep_layers=[0,3]", "qat={scheme: 8da4w, group_size: 32}"]}[student]  # fake-quantized
    models = request.getfixturevalue("wide_models" if student == "qlora" else "models")
    args = [*_kd(models, *kind, "teacher.placement=shard", *short_docs), "max_steps=3", "max_grad_norm=1.0",
            "kd.on_policy.decode=compiled"]
    one, two = tmp_path / "one", tmp_path / "two"
    if student == "qat":  # the reference: the same 2 processes, sampling eagerly through the sharded student
        _two_processes([*args, "batch_size=2", "kd.on_policy.decode=eager", f"output_dir={one}"], tmp_path)
    else:
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*args, "batch_size=4", f"output_dir={one}"]) == 0
    out = _assert_two_processes_match_one(args, one, two, tmp_path)
    assert "on-policy sampling on 2 processes: an unsharded copy of the student per process" in out, out
    # a LoRA twin samples with its adapters merged (in fp32 the same samples as the adapters); NF4, DoRA keep them
    assert (", its LoRA adapters merged into the weights they adapt" in out) == (student == "lora"), out


@pytest.mark.slow  # ~1.5 min on 2 cores: three 2-process runs
def test_two_processes_resume_with_the_twin_as_if_never_stopped(tmp_path, models, short_docs):
    """2 processes sampling on the compiled twin, stopped after step 2 (its final checkpoint) and resumed to step 3
    with `resume=true`: the twin, built before the checkpoint's weights load, samples with the restored weights,
    so step 3, the weights and the held-out score are the uninterrupted 3-step run's, bit for bit."""
    args = [*_kd(models, "lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, down_proj]}",
                 "teacher.placement=shard", *short_docs), "batch_size=2", "gradient_accumulation_steps=2",
            "kd.on_policy.decode=compiled"]  # a step: one on-policy micro-batch and one of data
    whole, cut = tmp_path / "whole", tmp_path / "cut"

    _two_processes([*args, "max_steps=3", f"output_dir={whole}"], tmp_path)
    _two_processes([*args, "max_steps=2", f"output_dir={cut}"], tmp_path)
    _two_processes([*args, "max_steps=3", f"output_dir={cut}", "resume=true"], tmp_path)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMINGS} for r in rows]  # noqa: E731
    assert strip(rc.read_metrics(cut)) == strip(rc.read_metrics(whole))
    assert sum(r["on_policy_batches"] for r in rc.read_metrics(whole)[2:]) >= 1  # step 3 samples after the resume
    rc.assert_same_weights(cut / "model", whole / "model")
    assert (cut / "on_policy_eval.json").read_text() == (whole / "on_policy_eval.json").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize(("compile", "decode", "student"), [(False, "eager", "full"), (True, "eager", "full"),
                                                          (True, "auto", "full"), (True, "auto", "lora")])
def test_two_gpus_match_one_with_twice_the_batch(tmp_path, models, short_docs, compile, decode, student):
    """The tests above on 2 GPUs (NCCL), as 1 GPU with twice the batch: the same steps, prompts, losses, weights
    and held-out score. Eager: every rank's sampling loop runs the same decode steps through the sharded student
    (FSDP2's collectives in each), between eager or compiled training layers. auto with compile: 1 GPU samples with
    the CUDA-graphed step on its student, 2 GPUs with the same step on each rank's unsharded twin; a LoRA student
    through its adapters merged on both (1 GPU: the merged copy; 2: the twin), with the same bf16 rounding noise."""
    kind = {"full": "student.keep_layers=[0,3]",
            "lora": "lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"}
    args = [*(a.replace("device=cpu", "device=cuda") for a in _kd(
        models, kind[student], "teacher.placement=shard", *short_docs)), "max_steps=3",
        "max_grad_norm=1.0", f"compile={str(compile).lower()}", f"kd.on_policy.decode={decode}"]
    one, two = tmp_path / "one", tmp_path / "two"
    rc.assert_ok(subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", "kd", "--config",
                                 "kd/smollm2_demo", *args, "batch_size=4", f"output_dir={one}"],
                                cwd=tmp_path, env=rc.cli_env(), capture_output=True, text=True, timeout=900))
    out = _assert_two_processes_match_one(args, one, two, tmp_path)
    assert ("on-policy sampling on 2 processes: an unsharded copy of the student per GPU" in out) == (
        decode == "auto"), out
    assert ("an unsharded copy of the student per GPU, its LoRA adapters merged into" in out) == (
        student == "lora"), out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the merged copy serves the CUDA-graph decode")
def test_one_gpu_samples_a_lora_student_through_its_merged_copy(tmp_path, models, short_docs):
    """On one GPU with compile: true, a LoRA student samples through a copy with its adapters merged (the log says
    so), and in fp32 (no rounding of the merge) the run trains what sampling through the adapters trains
    (bench/sample_unmerged.py: the same run with the copy turned off): the same prompts, losses and metrics."""
    lora = "lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
    args = [*(a.replace("device=cpu", "device=cuda") for a in _kd(models, *short_docs)), "max_steps=3",
            "compile=true", lora, "kd.on_policy.decode=auto"]
    outs = {}
    for name, entry in (("merged", ["-m", "llm_recipe.cli.main"]),
                        ("unmerged", [str(rc.REPO / "bench" / "sample_unmerged.py")])):
        proc = subprocess.run([sys.executable, *entry, "run", "kd", "--config", "kd/smollm2_demo", *args,
                               f"output_dir={tmp_path / name}"], cwd=tmp_path, env=rc.cli_env(),
                              capture_output=True, text=True, timeout=900)
        rc.assert_ok(proc)
        outs[name] = proc.stdout
    said = "on-policy sampling: the LoRA adapters merged into a copy of the weights they adapt"
    assert said in outs["merged"] and said not in outs["unmerged"], outs["merged"]
    a, b = rc.read_metrics(tmp_path / "merged"), rc.read_metrics(tmp_path / "unmerged")
    assert sum(r["on_policy_batches"] for r in a) >= 1
    assert [r["on_policy_prompts"] for r in a] == [r["on_policy_prompts"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        for k in ("loss", "on_policy_loss", "on_policy_rkl", "grad_norm"):
            assert (ra[k] is None and rb[k] is None) or ra[k] == pytest.approx(rb[k], rel=1e-4, abs=1e-6), (k, ra, rb)


def _two_processes(args: list[str], cwd: Path) -> str:
    """`recipe run --nproc-per-node 2 --standalone kd --config kd/smollm2_demo ARGS`, which must exit 0; what it
    printed."""
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", "--nproc-per-node", "2", "--standalone",
                           "kd", "--config", "kd/smollm2_demo", *args], cwd=cwd, env=rc.cli_env(), capture_output=True,
                          text=True, timeout=900)
    rc.assert_ok(proc)
    return proc.stdout


def _assert_two_processes_match_one(args: list[str], one: Path, two: Path, cwd: Path) -> str:
    """`recipe run --nproc-per-node 2 kd ...` with half the batch finishes and matches the run in `one` (1 process,
    or a reference on 2); what it printed."""
    out = _two_processes([*args, "batch_size=2", f"output_dir={two}"], cwd)
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
    # Adam divides each gradient by its own running size, so an element whose gradient is rounding noise moves by
    # up to lr either way: 1 of 4096 o_proj elements was 3.3e-5 apart on a 2-core VM, 1 of 3,145,728 embedding
    # elements 2.0e-4 on 2 H200s (lr 1e-3, 3 steps move elements by up to 3e-3). So: all elements within 1e-4 (a
    # tenth of one step) except at most 1 in 100,000 (at least one), and those within 2e-3 (two steps); a rank's
    # gradients left out would move most elements by ~lr.
    for k in wa:
        far = ~torch.isclose(wb[k], wa[k], atol=1e-4, rtol=1e-4)
        assert int(far.sum()) <= max(1, wa[k].numel() // 100_000), (k, int(far.sum()), wa[k].numel())
        torch.testing.assert_close(wb[k], wa[k], atol=2e-3, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
    ha, hb = (json.loads((d / "on_policy_eval.json").read_text()) for d in (one, two))
    assert hb["sampled_tokens"] == ha["sampled_tokens"]
    assert hb["reverse_kl_per_token"] == pytest.approx(ha["reverse_kl_per_token"], rel=1e-4)
    return out


@pytest.mark.slow  # ~1-2 min on 2 cores: Inductor compiles the layers and the decode step for the CPU
def test_compiled_sampling_in_the_kd_recipe(tmp_path, models, short_docs, capsys):
    """`kd.on_policy.decode=compiled` with `compile=true` on CPU: the recipe's wiring of the compiled decode step
    (Inductor's CPU kernels, not CUDA graphs) between compiled training layers: it samples several prompts per row
    and the run finishes with the held-out score, the same number of prompts as eager sampling. Seed 0 first
    samples at step 2, so the compiled run says that step stalls to compile the decode step (eager: nothing to say)."""
    runs = {}
    for decode in ("eager", "compiled"):
        out = tmp_path / decode
        assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models, *short_docs), "max_steps=3", "compile=true",
                                                           f"kd.on_policy.decode={decode}", f"output_dir={out}"]) == 0
        runs[decode] = rc.assert_metrics(out, 3, {"loss", *ON_POLICY_KEYS})
        assert [r["on_policy_batches"] for r in runs[decode]] == [0, 1, 0]
        assert json.loads((out / "on_policy_eval.json").read_text())["sampled_tokens"] > 0
        said = [ln for ln in capsys.readouterr().out.splitlines() if "compiling the decode step" in ln]
        assert said == (["on-policy: step 2 is this process's first to sample: compiling the decode step and the "
                         "layers for the samples' passes (once)"] if decode == "compiled" else [])
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


def test_a_share_too_small_for_the_run_says_so_before_the_first_step(tmp_path, models, capsys):
    """The default share (0.02) over a 3-step run of one micro-batch a step puts no micro-batch on-policy (seed 0's
    phase): the run still trains and scores, and the log says, before the first step, that it trained off-policy
    and what share would sample, instead of passing for an on-policy run."""
    out = tmp_path / "out"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models), "kd.on_policy.fraction=0.02", "max_steps=3",
                                                       f"output_dir={out}"]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "kd.on_policy.fraction" in ln]
    assert said == ["warning: kd.on_policy.fraction=0.02 puts none of this run's 3 micro-batches (3 steps x 1) "
                    "on-policy, so they train off-policy (only the held-out score samples): raise "
                    "kd.on_policy.fraction to at least 0.34, or run more steps"]
    rows = rc.assert_metrics(out, 3, {"loss", *ON_POLICY_KEYS})
    assert all(r["on_policy_batches"] == 0 for r in rows)
    assert json.loads((out / "on_policy_eval.json").read_text())["prompts"] == 3


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


def test_a_resume_that_changes_the_held_out_rows_is_refused_before_loading(tmp_path, models, capsys):
    """kd.on_policy dropped (or its held_out changed) on a resume, even with resume_with_changes=true: the held-out
    rows come out of the dataset, so the checkpoint's data position cannot fit. It failed after the weights loaded,
    naming the data loader's example count; now one line at setup naming the key, the run left as it was."""
    out = tmp_path / "run"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*_kd(models), "max_steps=1", f"output_dir={out}"]) == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    resume = [*_kd(models), "max_steps=2", f"output_dir={out}", "resume=true", "resume_with_changes=true"]
    for change, said in (("kd.on_policy=null", "kd.on_policy: a section -> null"),
                         ("kd.on_policy.held_out=2", "kd.on_policy.held_out: 3 -> 2")):
        code, _, err = rc.run_captured(capsys, "kd", "kd/smollm2_demo", [*resume, change])
        assert code == 1
        doc.expect("resume-rows-changed", rc.one_error(err), out=out, changes=said)
        assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*resume, "kd.on_policy.fraction=0.25"]) == 0  # same rows
