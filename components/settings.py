"""Typed config sections: one frozen dataclass per section, each field its key's one home.

A field is declared with `setting(default, spec, doc)` (the spec is a components/schema.py spec or plain type: what
values the key may take; `REQUIRED` for a key without a default) and a nested section with `section(cls, doc)`:

    @dataclass(frozen=True, kw_only=True)
    class LRScheduler:
        name: str = setting("cosine", Choice(*SCHEDULERS), "cosine | linear | constant")
        warmup_steps: int = setting(0, Range(int, ge=0), "linear warmup from 0 over this many steps")

A recipe names its root type (`CONFIG = KDConfig`). From it `schema_of` derives the validation SCHEMA that
components/config.py checks with its `file:line` errors, and `parse_config` builds the typed object once, defaults
filled in; a root type's `check()` method (if any) then runs the checks that span several keys. `describe_config`
lists every key with its allowed values, default and doc (`recipe keys`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from .errors import RecipeError
from .schema import ListOf, ModelDir, OutputDir, Spec, spec_problem, type_name

__all__ = ["REQUIRED", "check_fields", "config_fields", "describe_config", "is_config_type", "parse_config",
           "schema_of", "section", "setting"]

REQUIRED: Any = MISSING  # `setting(REQUIRED, ...)`: the config must set the key


def setting(default: Any, spec: Any, doc: str) -> Any:
    """A config key's field: its default (`REQUIRED`: none), what values it takes (`spec`) and a one-line doc."""
    meta = {"spec": spec, "doc": doc}
    if default is REQUIRED:
        return field(metadata=meta)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, doc: str, optional: bool = False, only: tuple[str, ...] | None = None) -> Any:
    """A nested section of type `cls`. `optional`: absent or null is None (the feature is off); otherwise absent or
    null gives `cls`'s defaults. `only`: the keys of `cls` this recipe reads (the others keep their defaults)."""
    meta = {"section": cls, "doc": doc, "optional": optional, "only": only}
    return field(default=None, metadata=meta) if optional else field(default_factory=cls, metadata=meta)


def is_config_type(obj: Any) -> bool:
    """Whether `obj` is a config dataclass (a type whose fields are `setting`s / `section`s)."""
    return isinstance(obj, type) and is_dataclass(obj)


def config_fields(cls: type) -> list[Field]:
    """The fields of `cls` that are config keys, in declaration order (base classes first)."""
    return [f for f in fields(cls) if "spec" in f.metadata or "section" in f.metadata]


def check_fields(obj: Any, prefix: str) -> None:
    """Every key of a section object against its field's own spec, for sections that library code builds directly
    (a parsed config was checked already, with `file:line`): a RecipeError `prefix.key: must be ..., got ...`.
    Called from such a section's `__post_init__`; nested sections check themselves."""
    for f in config_fields(type(obj)):
        spec = f.metadata.get("spec")
        if isinstance(spec, (Spec, type, tuple)):
            problem = spec_problem(spec, getattr(obj, f.name))
            if problem is not None:
                raise RecipeError(f"{prefix}{f.name}: {problem}")


def _keys(f: Field) -> tuple[str, ...] | None:
    return f.metadata.get("only")


def schema_of(cls: type) -> dict[str, Any]:
    """The validation SCHEMA of a config type: key -> spec, a nested dict per section (components/config.py)."""
    out: dict[str, Any] = {}
    for f in config_fields(cls):
        if "section" in f.metadata:
            sub = schema_of(f.metadata["section"])
            out[f.name] = {k: v for k, v in sub.items() if _keys(f) is None or k in _keys(f)}
        else:
            out[f.name] = f.metadata["spec"]
    return out


def _plain(value: Any, spec: Any) -> Any:
    """A config value as plain Python: containers become lists and dicts, a `ListOf` value a tuple, and a folder's
    leading `~` the home folder (the shell leaves `key=~/x` alone, YAML always does): the recipe then reads and
    writes the folder that `recipe run` checked and locked."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(spec, (ModelDir, OutputDir)) and isinstance(value, str):
        return os.path.expanduser(value)
    return tuple(value) if isinstance(spec, ListOf) and isinstance(value, list) else value


def parse_config(cls: type, node: DictConfig | None, where: Callable[[str], str], prefix: str = "") -> Any:
    """`cls` from a validated config node, defaults filled in; a missing `REQUIRED` key is a RecipeError naming
    where it should have been set (`where(dotted key)`)."""
    values: dict[str, Any] = {}
    for f in config_fields(cls):
        key = f"{prefix}{f.name}"
        present = node is not None and f.name in node
        required = f.default is MISSING and f.default_factory is MISSING
        value = node[f.name] if present else None
        if "section" in f.metadata:
            optional = f.metadata["optional"]
            values[f.name] = None if value is None and optional else parse_config(
                f.metadata["section"], value, where, key + ".")
        elif present and (value is not None or not required):
            values[f.name] = _plain(value, f.metadata["spec"])
        elif required:  # absent, or null (`optimizer: null` passed validate, then failed after the weights loaded)
            raise RecipeError(f"{where(key)}: key '{key}' is required ({_allowed(f)}): set it in the file or "
                              f"override {key}=...")
    return cls(**values)


def _allowed(f: Field) -> str:
    spec = f.metadata["spec"]
    if isinstance(spec, Spec):
        return spec.describe()
    return type_name(spec) if isinstance(spec, (type, tuple)) else "a {_component_: dotted.path, ...} mapping"


def _default(f: Field) -> str:
    if f.default is not MISSING:
        value = f.default
    elif f.default_factory is not MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, tuple):
        value = list(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def describe_config(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """(dotted key, allowed values, default, doc) of every key of `cls`, sections first named then expanded."""
    for f in config_fields(cls):
        key, doc = f"{prefix}{f.name}", f.metadata["doc"]
        if "section" in f.metadata:
            off = "null (off)" if f.metadata["optional"] else "its keys' defaults"
            yield key, "a section", off, doc
            for row in describe_config(f.metadata["section"], key + "."):
                if _keys(f) is None or row[0][len(key) + 1 :].split(".")[0] in _keys(f):
                    yield row
        else:
            yield key, _allowed(f), _default(f), doc
