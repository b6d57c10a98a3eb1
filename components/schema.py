"""Value specs for recipe SCHEMAs: the type of a config key and the values it may take, declared once.

A SCHEMA maps each key a recipe reads to a spec. Plain Python types (`int`, `float`, `str`, `bool`, `list`,
`dict`, `type(None)`) and tuples of them check the type only; the specs below add what a value may be:

    "kd_ratio": Range(float, ge=0, le=1)          # 0 <= x <= 1
    "lr": Range(float, gt=0)                       # x > 0
    "max_steps": Range(int, ge=1, optional=True)   # null or an int >= 1
    "loss": Choice("forward_kl", "jsd")            # one of these strings
    "keep_layers": ListOf(Range(int, ge=0), min_len=1, unique=True, optional=True)
    "checkpoint_dir": ModelDir()                   # a string; `recipe run` checks the folder exists
    "output_dir": OutputDir()                      # a string; `recipe run` checks it and locks it

`recipe validate` and `recipe run` check every spec before anything is built, so a bad value is one line naming
the key, where it was set and what is allowed. Folders are checked by `recipe run` only (`prepared_run` in
llm_recipe.components.folders): a config may name a folder that exists only on the machine it will run on.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig

__all__ = [
    "DEVICE",
    "Choice",
    "ListOf",
    "ModelDir",
    "OutputDir",
    "Pattern",
    "Range",
    "Spec",
    "spec_problem",
    "type_name",
    "type_ok",
    "value_desc",
    "walk_specs",
]


# ----------------------------------------------------------------------------------------------- plain types


def type_name(expected: Any) -> str:
    """`int or null` for `(int, type(None))`; a spec's own description."""
    if isinstance(expected, Spec):
        return expected.describe()
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join("null" if t is type(None) else getattr(t, "__name__", str(t)) for t in types)


def value_desc(value: Any) -> str:
    """How a value reads in a message: `float 1.5`, `str 'x'`, `a list`, `null`."""
    if isinstance(value, DictConfig):
        return "a mapping"
    if isinstance(value, ListConfig):
        return "a list"
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"


def type_ok(value: Any, expected: Any) -> bool:
    """Whether `value` has one of the plain types of `expected` (an int is a fine float; a bool is no int)."""
    types = expected if isinstance(expected, tuple) else (expected,)
    for t in types:
        if t is type(None) or t is None:
            ok = value is None
        elif t is bool:
            ok = isinstance(value, bool)
        elif t is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif t is float:  # an int is a fine float (lr: 1 is 1.0)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif t is list:
            ok = isinstance(value, (ListConfig, list, tuple))
        elif t is dict:
            ok = isinstance(value, (DictConfig, dict))
        else:
            ok = isinstance(value, t)
        if ok:
            return True
    return False


# ----------------------------------------------------------------------------------------------- specs


class Spec:
    """A value spec: `problem(value)` says what is wrong with a (non-null) value, or None when it is fine."""

    optional: bool = False

    def describe(self) -> str:
        raise NotImplementedError

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError


def spec_problem(expected: Any, value: Any) -> str | None:
    """`must be ..., got ...` when `value` does not satisfy `expected` (a spec or plain types), else None."""
    if isinstance(expected, Spec):
        if value is None:
            return None if expected.optional else f"must be {expected.describe()}, got null"
        return expected.problem(value)
    if type_ok(value, expected):
        return None
    return f"must be {type_name(expected)}, got {value_desc(value)}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


@dataclass(frozen=True)
class Range(Spec):
    """A number within bounds: `Range(float, ge=0, le=1)`, `Range(int, ge=1, optional=True)` (null allowed).

    Floats must also be finite (nan and inf are refused)."""

    kind: type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    optional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in (int, float):
            raise TypeError(f"Range(kind) must be int or float, got {self.kind!r}")

    def bounds(self) -> str:
        lo = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None)
        hi = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None)
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f"{'>=' if self.ge is not None else '>'} {lo[1:]}"
        if hi:
            return f"{'<=' if self.le is not None else '<'} {hi[:-1]}"
        return ""

    def describe(self) -> str:
        text = "an int" if self.kind is int else "a number"
        b = self.bounds()
        return f"{text} {b}{' (or null)' if self.optional else ''}" if b else text

    def problem(self, value: Any) -> str | None:
        if not type_ok(value, self.kind):
            return f"must be {self.describe()}, got {value_desc(value)}"
        v = float(value)
        ok = math.isfinite(v)
        ok = ok and (self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
        ok = ok and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt)
        return None if ok else f"must be {self.describe()}, got {value!r}"


@dataclass(frozen=True, init=False)
class Choice(Spec):
    """One of a fixed set of values: `Choice("cosine", "linear", "constant")`."""

    choices: tuple
    optional: bool = False

    def __init__(self, *choices: Any, optional: bool = False) -> None:
        if len(choices) == 1 and isinstance(choices[0], (list, tuple)):
            choices = tuple(choices[0])
        object.__setattr__(self, "choices", tuple(choices))
        object.__setattr__(self, "optional", optional)

    def describe(self) -> str:
        return f"one of {', '.join(map(yaml_word, self.choices))}{' (or null)' if self.optional else ''}"

    def problem(self, value: Any) -> str | None:
        # `in` alone would let 1 stand for True and 0 for False: a value must also have its choice's type
        if isinstance(value, (DictConfig, ListConfig)) or not any(
                value == c and isinstance(value, bool) == isinstance(c, bool) for c in self.choices):
            got = repr(value) if isinstance(value, str) else value_desc(value)
            return f"must be {self.describe()}, got {got}"
        return None


def yaml_word(value: Any) -> str:
    """A value as a user writes it in YAML, for messages: false / true / null, lists and mappings in flow style
    (JSON is YAML), other values as they are."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Pattern(Spec):
    """A string matching a regular expression (whole string), described for users by `example`."""

    regex: str
    example: str
    optional: bool = False

    def describe(self) -> str:
        return f"{self.example}{' (or null)' if self.optional else ''}"

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, str) or re.fullmatch(self.regex, value) is None:
            got = repr(value) if isinstance(value, str) else value_desc(value)
            return f"must be {self.describe()}, got {got}"
        return None


@dataclass(frozen=True)
class ListOf(Spec):
    """A list whose items satisfy `item`, with `min_len` <= length <= `max_len` and, if `unique`, no repeats."""

    item: Any
    min_len: int = 0
    max_len: int | None = None
    unique: bool = False
    optional: bool = False

    def describe(self) -> str:
        if self.max_len is not None and self.max_len == self.min_len:
            text = f"a list of {self.min_len} items"
        else:
            text = f"a {'non-empty ' if self.min_len > 0 else ''}list{' of distinct items' if self.unique else ''}"
        text = f"{text} ({type_name(self.item)} each)"
        return f"{text}{' (or null)' if self.optional else ''}"

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (ListConfig, list, tuple)):
            return f"must be {self.describe()}, got {value_desc(value)}"
        items = list(value)
        if len(items) < self.min_len or (self.max_len is not None and len(items) > self.max_len):
            return f"must be {self.describe()}, got {len(items)} item(s)"
        for i, v in enumerate(items):
            p = spec_problem(self.item, v)
            if p is not None:
                return f"item {i} {p}"
        if self.unique:
            seen = [v for i, v in enumerate(items) if v in items[:i]]
            if seen:
                return f"must not repeat items, got {seen[0]!r} twice"
        return None


@dataclass(frozen=True)
class _Folder(Spec):
    """A folder path (a non-empty string); subclasses say which kind `recipe run` checks."""

    optional: bool = False

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, str) or not value.strip():
            return f"must be {self.describe()}, got {value_desc(value)}"
        return None


@dataclass(frozen=True)
class ModelDir(_Folder):
    """A Hugging Face model folder (a string). `recipe run` checks it exists and has a config.json."""

    def describe(self) -> str:
        return f"a model folder path{' (or null)' if self.optional else ''}"


@dataclass(frozen=True)
class OutputDir(_Folder):
    """The run's output folder (a string). `recipe run` checks it can be written and locks it for the run."""

    def describe(self) -> str:
        return f"a folder path{' (or null)' if self.optional else ''}"


# `device:` of every recipe: what llm_recipe.components.runtime.setup_runtime accepts.
DEVICE = Pattern(r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N")


def walk_specs(node: Any, schema: dict, kinds: Sequence[type], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, spec, value) of every key of `node` whose schema spec is one of `kinds`, depth first."""
    found: list[tuple[str, Any, Any]] = []
    if not isinstance(node, (DictConfig, dict)):
        return found
    for k, expected in schema.items():
        if k not in node:
            continue
        value = node[k]
        if isinstance(expected, tuple(kinds)):
            found.append((f"{prefix}{k}", expected, value))
        elif isinstance(expected, dict) and value is not None:
            found.extend(walk_specs(value, expected, kinds, f"{prefix}{k}."))
    return found
