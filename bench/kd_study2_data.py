"""Sweep rows of bench/kd_study2.py that train on other data: `--variant NAME=BASE:data=chat_mix[,k=v]`.

`data=chat_mix` trains the row on the study's transfer passages plus the teacher's answers to the first
`Scale.mix_chat` shipped chat questions (the rest of the chat set holds the on-policy rows' prompts and their
held-out metric, so no question is both trained on and scored). Two jobs make the set once for every such row:
`transfer_chat` (`recipe run transfer` with only chat prompts, same sampling as the passages) and `mix` (passages
and chat answers in one `format: text` file, each conversation rendered with the teacher's chat template, so the
student sees the chat markup it will be prompted with). The question it answers (docs/kd_study.md): does data
closer to chat and instructions move HellaSwag, where KD and SFT tie on encyclopedic passages?
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CHAT_MIX = "data=chat_mix"
MIX_FILE = Path("transfer_mix") / "mix.jsonl"


def uses_mix(variants: list[tuple[str, str, list[str]]]) -> bool:
    """Whether any sweep row trains on the chat mix."""
    return any(CHAT_MIX in overrides for _, _, overrides in variants)


def with_mix(argv: list[str], deps: list[str], overrides: list[str], out: Path) -> tuple[list[str], list[str],
                                                                                         list[str]]:
    """A variant's command, deps and remaining overrides: with `data=chat_mix`, its data is the mix file (after
    the `mix` job); otherwise unchanged."""
    if CHAT_MIX not in overrides:
        return argv, deps, overrides
    argv = [a for a in argv if not a.startswith("dataset.source=")] + [f"dataset.source={out / MIX_FILE}"]
    return argv, [*deps, "mix"], [o for o in overrides if o != CHAT_MIX]


def mix_jobs(s: Any, out: Path, teacher: str, recipe: Any, job: Any) -> list[Any]:
    """The teacher's chat answers (`transfer_chat`) and the mixed file (`mix`); `recipe` and `job` build the
    study's Job objects (bench/kd_study2.py's `_recipe` and `Job`)."""
    chat = recipe("transfer_chat", "transfer", "transfer/smollm2", [
        f"output_dir={out / 'transfer_chat'}", f"teacher.checkpoint_dir={teacher}", f"device={s.device}",
        "prompts.passages=0", f"prompts.chat={s.mix_chat}", f"prompts.samples_per_prompt={s.samples_per_prompt}",
        f"generation.max_new_tokens={s.max_new_tokens}", f"generation.batch_size={s.gen_batch_size}"], [], "data")
    mix = job("mix", "train", [sys.executable, str(Path(__file__).resolve().parent / "kd_study2.py"), "mix",
                               "--out", str(out), "--teacher", teacher], ["transfer", "transfer_chat"], "data")
    return [chat, mix]


def write_mix(out: Path, tokenizer_dir: str) -> dict:
    """out/transfer_mix/mix.jsonl: every passage row, then every chat answer rendered as text; returns the counts."""
    from llm_recipe.components.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    passages = _jsonl(out / "transfer" / "passages.jsonl")
    chat_file = out / "transfer_chat" / "chat.jsonl"
    chats = _jsonl(chat_file) if chat_file.is_file() else []
    if not chats:  # every answer empty or dropped as contaminated: the transfer job's log says which
        raise SystemExit(f"mix: {chat_file} has no chat answers (see logs/transfer_chat.log)")
    rows = [{"text": p["text"]} for p in passages] + [{"text": tok.apply_chat_template(c["messages"])} for c in chats]
    path = out / MIX_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tmp.replace(path)  # whole or absent: a job killed mid-write leaves no half file for a later lease
    counts = {"passages": len(passages), "chat": len(chats), "rows": len(rows), "file": str(path)}
    print(json.dumps(counts), flush=True)
    return counts


def _jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file, split on "\\n" only: the teacher's text may hold U+2028 and other characters
    that str.splitlines() also breaks on (json.dumps with ensure_ascii=False leaves them raw)."""
    return [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x.strip()]
