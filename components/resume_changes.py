"""What a resumed run changed in its config, against the values its run started with (run.json's `values`).

A resume is the same run continued: the checkpoint's optimizer state, schedule and data position only mean what
they meant under the values that wrote them. So `resume=true` compares the resolved config (defaults filled in)
with the one recorded when the run started, key by key:
- `FREE_KEYS` change where or how often the run writes, how it logs, or its speed and memory with the same math,
  or extend it (`max_steps`, `epochs`): they may change, and the resume says which did;
- any other change (a learning rate, the data, a LoRA rank, a forgotten override) is refused with one line naming
  each key and both values, unless `resume_with_changes=true` accepts them; accepted changes are printed and
  recorded in run.json, so the run's record says what it ran with from which step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from typing import Any

from .schema import yaml_word

# Keys a resumed run may change freely: where and how often it writes and logs, switches that change speed or
# memory but not the math (compile, activation checkpointing, output chunks, the teacher's placement, the decode
# path), the device, and the run's length (a longer run is the same run extended).
FREE_KEYS = frozenset({
    "max_steps", "epochs", "save_every_n_steps", "keep_last_n", "tensorboard", "wandb", "compile",
    "activation_checkpointing", "num_output_chunks", "device", "teacher.placement", "kd.on_policy.decode",
})
# Keys whose change makes a checkpoint not fit the model or optimizer built now (other adapter shapes or targets,
# another optimizer's state): refused even with resume_with_changes, before anything loads.
SHAPE_KEYS = frozenset({"lora", "lora.rank", "lora.targets", "lora.use_dora", "optimizer._component_"})
# Keys whose change alters the training rows, so the checkpoint's data position would not fit: kd.on_policy's
# held-out prompts come out of the dataset (set or dropped, or another count). Refused like SHAPE_KEYS, before
# anything loads (the data loader said so only after the weights had loaded, naming its example count).
DATA_SHAPE_KEYS = frozenset({"kd.on_policy", "kd.on_policy.held_out"})
# Keys that say how this command treats the folder, not what the run computes: never compared.
_CONTROL_KEYS = frozenset({"output_dir", "resume", "overwrite", "resume_with_changes"})
_NOT_SET = "<not set>"

__all__ = ["DATA_SHAPE_KEYS", "FREE_KEYS", "SHAPE_KEYS", "config_changes", "describe_changes", "resolved_values",
           "value_changes"]


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


def resolved_values(cfg: Any) -> dict[str, Any]:
    """The typed config's values, defaults filled in, as JSON-ready `{"dotted.key": value}` (what run.json keeps).
    Tuples become lists, other objects their str(), as a JSON round trip leaves them."""
    values = asdict(cfg) if is_dataclass(cfg) else dict(cfg)
    flat: dict[str, Any] = {}
    _flatten(values, "", flat)
    return json.loads(json.dumps(flat, default=str))


def _same(old: Any, new: Any) -> bool:
    if old == new:
        return True
    # one file or folder written two ways (relative and absolute, through a link)
    if isinstance(old, str) and isinstance(new, str) and old and new:
        try:
            return os.path.samefile(old, new)
        except OSError:
            return False
    return False


def value_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple]:
    """`key -> (old, new)` for each key of two flat value dicts (`resolved_values`) whose values are not equal; a key
    on one side only has `<not set>` on the other (as `describe_changes` shows it)."""
    return {k: (old.get(k, _NOT_SET), new.get(k, _NOT_SET)) for k in sorted(old.keys() | new.keys())
            if old.get(k, _NOT_SET) != new.get(k, _NOT_SET)}


def config_changes(recorded: dict[str, Any], cfg: Any) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """`(changed, free)`: the keys whose value differs between `recorded` (run.json's `values`) and `cfg`, each
    `key -> (recorded value, value now)`; `free` holds those in `FREE_KEYS` (a key under a free key counts as it)."""
    now = resolved_values(cfg)
    changed: dict[str, tuple] = {}
    free: dict[str, tuple] = {}
    for key in sorted(set(recorded) | set(now)):
        old, new = recorded.get(key, _NOT_SET), now.get(key, _NOT_SET)
        if key in _CONTROL_KEYS or _same(old, new):
            continue
        is_free = any(key == k or key.startswith(k + ".") for k in FREE_KEYS)
        (free if is_free else changed)[key] = (old, new)
    return changed, free


def _word(value: Any) -> str:
    # a section's own key is <not set> when the section was given (its keys were recorded one by one)
    return "a section" if value == _NOT_SET else yaml_word(value)


def describe_changes(changes: dict[str, tuple], limit: int = 6) -> str:
    """`key: old -> new` for each change (YAML spellings: null, true), at most `limit`, then how many more."""
    # a section set or dropped is one change: its own keys, then present on one side only, are not listed
    changes = {k: v for k, v in changes.items() if not any(k.startswith(p + ".") for p in changes)}
    parts = [f"{k}: {_word(old)} -> {_word(new)}" for k, (old, new) in list(changes.items())[:limit]]
    if len(changes) > limit:
        parts.append(f"and {len(changes) - limit} more")
    return ", ".join(parts)
