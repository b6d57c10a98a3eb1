"""Whether a student and a teacher can be distilled token by token, and the vocabulary their logits are sliced to.

Checked from config and tokenizer files before any weights load, so a mismatch is a one-line RecipeError at setup.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import RecipeError, read_utf8

__all__ = ["same_tokenizer", "shared_vocab"]


def shared_vocab(
    student_vocab: int, teacher_vocab: int, tokenizer_vocab: int, tokenizers_match: bool = True,
    student_dir: str | Path | None = None, teacher_dir: str | Path | None = None,
) -> tuple[int, str | None]:
    """Return (size to slice both logits to, message to log or None) for KD between two output heads.

    Heads often carry padding rows past the tokenizer (e.g. 151936 vs 151665); logits of padding ids are never
    targets, so both are trimmed to the tokenizer size. A head smaller than the tokenizer, or different tokenizers,
    means the token ids do not mean the same thing: that is a RecipeError raised before training starts, naming
    the folders (`student_dir`, `teacher_dir`) when given.
    """
    where = {"student": f" (student.checkpoint_dir={student_dir})" if student_dir is not None else "",
             "teacher": f" (teacher.checkpoint_dir={teacher_dir})" if teacher_dir is not None else ""}
    if not tokenizers_match:
        files = (f" ({Path(student_dir) / 'tokenizer.json'} vs {Path(teacher_dir) / 'tokenizer.json'})"
                 if student_dir is not None and teacher_dir is not None else "")
        raise RecipeError(
            f"kd: student and teacher tokenizers differ{files}; token-level distillation needs the same tokenizer "
            "(pick a teacher from the student's model family)"
        )
    for who, size in (("student", student_vocab), ("teacher", teacher_vocab)):
        if size < tokenizer_vocab:
            raise RecipeError(
                f"kd: {who} output vocab ({size}){where[who]} is smaller than the tokenizer vocab "
                f"({tokenizer_vocab}); the student and teacher do not share a vocabulary"
            )
    if student_vocab == teacher_vocab:
        return student_vocab, None
    msg = (
        f"kd: student vocab {student_vocab} and teacher vocab {teacher_vocab} differ only by padding rows; "
        f"both logits are sliced to the tokenizer vocab {tokenizer_vocab}"
    )
    return tokenizer_vocab, msg


def same_tokenizer(student_dir: str | Path, teacher_dir: str | Path) -> bool:
    """True when two HF model folders' ``tokenizer.json`` define the same vocabulary and added tokens."""

    def fingerprint(d: str | Path) -> tuple[object, object]:
        path = Path(d) / "tokenizer.json"
        try:
            data = json.loads(read_utf8(path))
        except FileNotFoundError:
            raise RecipeError(f"kd: {path} not found; both models need a tokenizer.json") from None
        except json.JSONDecodeError as e:
            raise RecipeError(f"kd: {path} is not valid JSON ({e})") from None
        model = data.get("model", {})
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens", []))
        return model.get("vocab"), added

    return fingerprint(student_dir) == fingerprint(teacher_dir)
