"""An interrupted evaluation continues where it stopped: every answer the model gives is appended to a file in
output_dir as it comes, and the same evaluation run again answers those requests from the file.

A whole-set evaluation can take hours on a CPU; without this, Ctrl-C, a SIGTERM or a crash at 90% lost everything.
lm-eval has a cache of its own (`use_cache`, `CachingLM`), but it pickles its values into SQLite (a file in the
output folder that unpickling would execute) and commits once per request; here the answers are JSON lines
(floats, flags and strings), appended and flushed, and a line a kill cut short is skipped.

The file is named by the evaluation's identity (model folder fingerprint and every setting that changes scores:
components/result_runs.py), so answers of another model or other settings are never reused; it is one file per
rank, and it is deleted once results.json is written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..interrupt import note_continues

ANSWERS_DIR = ".eval_answers"  # in output_dir, while an evaluation has not finished
_METHODS = ("loglikelihood", "loglikelihood_rolling", "generate_until")


def answers_path(output_dir: str | Path, identity: dict[str, Any], rank: int) -> Path:
    """The answers file of this evaluation (its identity) and rank."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(output_dir) / ANSWERS_DIR / f"{key}.rank{rank}.jsonl"


def discard_answers(output_dir: str | Path) -> None:
    """The evaluation finished (results.json written): its answers, and any other interrupted one's, go."""
    shutil.rmtree(Path(output_dir) / ANSWERS_DIR, ignore_errors=True)


class AnswerLog:
    """The answers of one evaluation on one rank: `attach(lm)` makes an lm-eval LM answer from the file first and
    append each new answer (lm-eval's cache hook, which our LM calls per request as it answers)."""

    def __init__(self, path: Path) -> None:
        from lm_eval.api.model import hash_args

        self._hash = hash_args
        self.path = path
        self.answers: dict[str, Any] = {}
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.answers[row["h"]] = row["a"]
                except (ValueError, KeyError, TypeError):  # the line a kill cut short
                    continue
        path.parent.mkdir(parents=True, exist_ok=True)
        note_continues(f"the answers so far are kept in {path.parent}: the same command continues the evaluation")
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the evaluation; closed by close())

    def attach(self, lm: Any) -> None:
        """Route `lm`'s three request methods through the file, and its cache hook into it."""
        from lm_eval.api.model import CacheHook

        log = self

        class _Hook(CacheHook):
            def __init__(self) -> None:
                self.dbdict = None

            def add_partial(self, attr: str, req: Any, res: Any) -> None:
                log.add(attr, req, res)

        lm.set_cache_hook(_Hook())
        for method in _METHODS:
            setattr(lm, method, self._reusing(method, getattr(lm, method)))

    def add(self, method: str, args: Any, answer: Any) -> None:
        """One answer, on disk at once (flushed: a kill of this process keeps it)."""
        h = self._hash(method, args)
        self.answers[h] = answer
        self._file.write(json.dumps({"h": h, "a": answer}) + "\n")
        self._file.flush()

    def _reusing(self, method: str, inner: Callable[..., list]) -> Callable[..., list]:
        def answer(requests: list, *args: Any, **kwargs: Any) -> list:
            out: list[Any] = [None] * len(requests)
            todo = []
            for i, req in enumerate(requests):
                sampled = method == "generate_until" and req.args[1].get("do_sample", False)
                h = None if sampled else self._hash(method, req.args)  # a sampled answer is drawn again
                if h is not None and h in self.answers:
                    a = self.answers[h]
                    out[i] = tuple(a) if method == "loglikelihood" else a
                else:
                    todo.append(i)
            if todo:
                for i, a in zip(todo, inner([requests[i] for i in todo], *args, **kwargs), strict=True):
                    out[i] = a
            return out

        return answer

    def close(self) -> None:
        self._file.close()
