"""One run per output folder for the recipes that write their results again (`quantize`, `eval`).

A rerun into a folder used to replace what it wrote there and keep the rest: after `quantize` with another scheme
the folder held the new `hf/` beside the earlier run's GGUF and one report describing only one of them, and a
second `eval` replaced the first one's results without a word. Now each run records what its outputs are computed
from (`run_identity`: the source folder, its weight files' sizes and times, the keys that change the result) in a
hidden `.<kind>_run.json` before it writes any output, and in its record (quantize's report.json, eval's
results.json) at the end. A rerun into a folder holding such outputs (`check_rerun`, before anything loads):
- of the same identity writes its outputs again (also after a kill -9 halfway); the earlier run's other outputs
  are of the same result (another export format, another GGUF type of the same quantized weights) and are kept;
- of another identity, or without a record of one (an older version's files, files from elsewhere), is refused
  with one line naming what differs, unless `overwrite: true` (`writing_run`): the earlier outputs are then set
  aside (components/set_aside.py), deleted once the new run has finished, put back if it stops first, and put
  back by the next run when it was killed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .checkpoint.atomic import atomic_write_bytes
from .errors import RecipeError
from .launch import is_rank0
from .output_kinds import KINDS, kinds_in
from .set_aside import discard, put_back, put_back_leftovers, set_aside, set_aside_folders

RECORD_KEY = "recipe_run"  # where a record file keeps its run's identity
SOURCE_KEY = "model.checkpoint_dir"  # the config key both recipes name their source model with
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf", "config.json", "quantization.json")
_SET_ASIDE = ".replaced.del-"

__all__ = ["RECORD_KEY", "SOURCE_KEY", "check_rerun", "run_identity", "writing_run"]


def _weight_files(folder: Path) -> dict[str, list[int]]:
    """name -> [bytes, mtime in ns] of the files that hold a model folder's weights and shape: a retrained model in
    the same folder shows as another identity without hashing gigabytes."""
    if not folder.is_dir():
        return {}
    files = sorted({p for pattern in _WEIGHT_FILES for p in folder.glob(pattern) if p.is_file()})
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def run_identity(source: str | os.PathLike, **keys: Any) -> dict[str, Any]:
    """What a run's outputs are computed from: the source model folder (`model.checkpoint_dir`, resolved), its
    weight files, and `keys` (the settings that change the result), as JSON values."""
    src = Path(source)
    return {SOURCE_KEY: str(src.resolve()), "source_files": _weight_files(src),
            **{k: list(v) if isinstance(v, tuple) else v for k, v in keys.items()}}


def _differences(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys whose values differ, as `key: old then, new now`. A key that one side leaves unset (null) often
    follows from another (quantize's group_size is set for the grouped schemes only): named only when nothing set
    on both sides differs."""
    both = [k for k in now if earlier.get(k) is not None and now[k] is not None]
    return _differing(earlier, now, both) or _differing(earlier, now, [*now, *(k for k in earlier if k not in now)])


def _differing(earlier: dict[str, Any], now: dict[str, Any], keys: list[str]) -> list[str]:
    diffs = []
    for key in keys:
        old, new = earlier.get(key), now.get(key)
        if old == new:
            continue
        if key == "source_files":
            if earlier.get(SOURCE_KEY) == now.get(SOURCE_KEY):  # else the source's own line says it all
                old, new = old or {}, new or {}
                changed = sorted(n for n in {*old, *new} if old.get(n) != new.get(n))
                # sizes and times, not contents, are compared (hashing gigabytes at every run is not free): a file
                # of the same size written again is said as such (a byte-identical copy reads the same way)
                rewritten = all(n in old and n in new and old[n][0] == new[n][0] for n in changed)
                how = ": rewritten, same size" if rewritten else ""
                diffs.append(f"the weights in {now[SOURCE_KEY]} changed since ({', '.join(changed[:3])}{how})")
        else:
            diffs.append(f"{key}: {json.dumps(old)} then, {json.dumps(new)} now")
    return diffs


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _identity_file(out: Path, kind: str) -> Path:
    """Where a run records its identity before it writes any output (hidden; a kill after the first export leaves
    outputs that the same command then recognises as its own)."""
    return out / f".{kind}_run.json"


def _outputs(out: Path, kind: str) -> list[Path]:
    """`kind`'s outputs in `out` and its identity file: what a run of that kind owns there."""
    return [*(out / n for n in kinds_in(out).get(kind, [])), *[p for p in [_identity_file(out, kind)] if p.exists()]]


def _recover_killed_overwrite(out: Path, kind: str) -> None:
    """A run with overwrite=true killed before it finished (kill -9, a lost node) left the outputs it was replacing
    set aside: they come back, and what that run wrote goes (a finished run deletes them, so any left are a
    killed run's)."""
    if put_back_leftovers(out, _SET_ASIDE, lambda: _outputs(out, kind)):
        print(f"note: {out}: a run with overwrite=true was stopped before it finished: the outputs it was "
              "replacing are back", flush=True)


def check_rerun(recipe: str, output_dir: str | os.PathLike, kind: str, record_name: str, identity: dict[str, Any],
                overwrite: bool) -> dict[str, Any] | None:
    """RecipeError when `output_dir` holds `kind`'s outputs of another run than `identity` describes (or of one that
    recorded none) and not `overwrite`. Returns the earlier record (`record_name`) when it is of the same identity,
    else None. First puts back what a killed `overwrite=true` run set aside. Rank 0 only (the others write nothing)."""
    out = Path(output_dir)
    _recover_killed_overwrite(out, kind)
    held = kinds_in(out).get(kind, [])
    if not held or overwrite:
        return None
    shown = ", ".join(f"{n}/" if (out / n).is_dir() else n for n in held[:4]) + (", ..." if len(held) > 4 else "")
    ways = "overwrite=true replaces them, or choose another output_dir"
    record = _read_json(out / record_name)
    recorded = _read_json(_identity_file(out, kind)) or record or {}
    earlier = recorded.get(RECORD_KEY)
    if not isinstance(earlier, dict):
        raise RecipeError(f"{out} holds {KINDS[kind][0]} ({shown}) without a record of what they were computed "
                          f"from (an older version's, or files from elsewhere): recipe run {recipe} would mix its "
                          f"outputs with them; {ways}")
    diffs = _differences(earlier, identity)
    if diffs:
        raise RecipeError(f"{out} holds {KINDS[kind][0]} of another run ({shown}): {'; '.join(diffs)}; {ways}")
    return record


@contextmanager
def writing_run(output_dir: str | os.PathLike | None, kind: str, identity: dict[str, Any],
                overwrite: bool) -> Iterator[None]:
    """The block writes `kind`'s outputs of the run `identity` describes into `output_dir`, which `check_rerun`
    accepted: its identity is recorded first; with `overwrite`, the earlier outputs are set aside, deleted when the
    block ends, put back (and what it wrote under their names removed) when it raises. Rank 0 only writes."""
    if output_dir is None or not is_rank0():
        yield
        return
    out = Path(output_dir)
    aside = set_aside(out, _outputs(out, kind), _SET_ASIDE) if overwrite else None
    atomic_write_bytes(_identity_file(out, kind), (json.dumps({RECORD_KEY: identity}, indent=2) + "\n").encode(),
                       output=False)
    try:
        yield
    except BaseException:
        if aside is not None:
            put_back(out, aside, _outputs(out, kind))
            print(f"note: {out}: the outputs overwrite=true set aside are back as they were", flush=True)
        raise
    for leftover in set_aside_folders(out, _SET_ASIDE):  # this run's
        discard(leftover)
