"""Read raw rows from local files, `save_to_disk` folders, HF `datasets` names or the shipped transfer set.

Every row remembers where it came from (`file:line` for JSON Lines, `file:N` for CSV with a header, `row N`
otherwise) so that a bad row is reported precisely.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import RecipeError, read_utf8, utf8_error

TRANSFER_PREFIX = "transfer:"
_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
# suffixes of files a user may name by mistake (not Hub dataset names, which have no suffix of this kind)
_OTHER_FILE_SUFFIXES = (".txt", ".text", ".md", ".tsv", ".gz", ".zst", ".bz2", ".xz", ".zip", ".arrow", ".xml",
                        ".yaml", ".yml", ".xlsx")
# `datasets`' packaged builders: with one of them as the source, `data_files` are local paths (relative to the cwd)
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml", "webdataset", "imagefolder",
                   "audiofolder", "videofolder")
_SPLIT_RE = re.compile(r"^\s*([\w.\-]+)\s*(?:\[\s*([^:\]]*)\s*:\s*([^\]]*)\s*\])?\s*$")


class Rows(Sequence):
    """Rows (dicts) of one source, each with a human-readable location for error messages."""

    def __init__(self, rows: Sequence[dict], origin: str, locations: Sequence[str] | None = None,
                 index: Sequence[int] | None = None) -> None:
        self._rows = rows
        self.origin = origin
        self._locations = locations
        self._index = list(range(len(rows))) if index is None else list(index)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> dict:  # type: ignore[override]
        return self._rows[self._index[i]]

    def __iter__(self) -> Iterator[dict]:
        for i in self._index:
            yield self._rows[i]

    def where(self, i: int) -> str:
        """Location of row i: `file:line` (JSONL/CSV) or `source:row N` (N counts the unsliced source's rows from
        1, as a user counts them in a JSON list or a table)."""
        j = self._index[i]
        if self._locations is not None:
            return self._locations[j]
        return f"{self.origin}:row {j + 1}"

    def source_index(self, i: int) -> int:
        """Row i's position in the unsliced source (what a split slice or a `select` kept it as)."""
        return self._index[i]

    def select(self, index: Sequence[int]) -> Rows:
        """A view of some rows (positions relative to this view), keeping their original locations."""
        return Rows(self._rows, self.origin, self._locations, [self._index[i] for i in index])


def _bound(text: str, n: int, spec: str) -> int | None:
    """One end of `[start:end]` as a row index in 0..n (None: the end is open). Negative ends count from the end, as
    in Python and HF datasets, for row counts and percentages alike (`train[-10%:]` is the last tenth)."""
    text = text.strip()
    if text == "":
        return None
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not -100 <= pct <= 100:
                raise RecipeError(f"split '{spec}': '{text}' is not a percentage between -100% and 100%")
            v = round(abs(pct) * n / 100) * (-1 if pct < 0 else 1)
        else:
            v = int(text)
    except ValueError:
        raise RecipeError(f"split '{spec}': '{text}' is not an integer or a percentage like 90%") from None
    return max(0, n + v) if v < 0 else min(v, n)


def parse_split(split: str) -> tuple[str, str | None, str | None]:
    """`train[:90%]` -> ("train", "", "90%"); `train` -> ("train", None, None)."""
    m = _SPLIT_RE.match(split or "train")
    if not m:
        raise RecipeError(f"split '{split}': expected NAME or NAME[start:end] like train[:90%] or train[100:]")
    return m.group(1), m.group(2), m.group(3)


def slice_rows(rows: Rows, split: str) -> Rows:
    """Apply the `[start:end]` part of a split spec (ints, negative ints or percentages) to rows."""
    _, start, end = parse_split(split)
    if start is None:
        return rows
    n = len(rows)
    lo, hi = _bound(start, n, split), _bound(end, n, split)
    lo, hi = 0 if lo is None else lo, n if hi is None else hi
    return rows.select(range(lo, max(lo, hi)))


def _read_jsonl(path: Path) -> Rows:
    rows, locs = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark (Excel, Notepad)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise utf8_error(str(path), raw, e, first_line=lineno) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecipeError(f"{path}:{lineno}: invalid JSON ({_json_problem(e)})") from None
            if not isinstance(obj, dict):
                raise RecipeError(f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
            rows.append(obj)
            locs.append(f"{path}:{lineno}")
    return Rows(rows, str(path), locs)


def _read_json(path: Path) -> Rows:
    text = read_utf8(path)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several objects, one per line: JSON Lines in a .json file
            return _read_jsonl(path)
        raise RecipeError(f"{path}:{e.lineno}: invalid JSON ({_json_problem(e)})") from None
    if isinstance(obj, dict):
        # {"data": [...]} or {"train": [...], ...}: take the one list of objects if unambiguous
        lists = [k for k, v in obj.items() if isinstance(v, list)]
        if len(lists) != 1:
            if not lists:  # a single object on one line is a one-row JSON Lines file
                return Rows([obj], str(path), [f"{path}:1"])
            raise RecipeError(f"{path}: top-level object has several lists ({', '.join(lists)}); "
                              "save the rows as a JSON list or JSON Lines")
        obj = obj[lists[0]]
    if not isinstance(obj, list):
        raise RecipeError(f"{path}: expected a JSON list of objects or JSON Lines, got {type(obj).__name__}")
    for i, r in enumerate(obj):
        if not isinstance(r, dict):
            raise RecipeError(f"{path}:row {i + 1}: expected a JSON object, got {type(r).__name__}")
    return Rows(obj, str(path))


def _read_csv(path: Path) -> Rows:
    with io.StringIO(read_utf8(path), newline="") as f:
        reader = csv.DictReader(f)
        rows, locs = [], []
        for row in reader:
            # the record's first physical line (the header is line 1): the reader is at its last, and a quoted field
            # may hold line breaks
            rows.append(dict(row))
            locs.append(f"{path}:{reader.line_num - _record_lines(row) + 1}")
    return Rows(rows, str(path), locs)


def _record_lines(row: dict) -> int:
    """Physical lines a CSV record spans: one more than the line breaks inside its quoted fields."""
    return 1 + sum(len(re.findall(r"\r\n|\r|\n", v)) for v in row.values() if isinstance(v, str))


def _json_problem(e: json.JSONDecodeError) -> str:
    """json's message and column: `Expecting ',' delimiter at column 12` (some messages end in "at" already)."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def _read_parquet(path: Path) -> Rows:
    import pyarrow.parquet as pq  # lazy: only parquet sources need it

    return Rows(pq.read_table(path).to_pylist(), str(path))


def _load_from_disk(path: Path, split_name: str) -> Rows:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split_name not in ds:
            raise RecipeError(f"{path}: no split '{split_name}'; it has {', '.join(ds)}")
        ds = ds[split_name]
    return Rows(ds, str(path))


def _load_hf(source: str, split_name: str, name: str | None, data_files: Any) -> Rows:
    import datasets

    try:
        ds = datasets.load_dataset(source, name=name, split=split_name, data_files=data_files)
    except Exception as e:  # datasets raises many types (FileNotFound, ConnectionError, ValueError...)
        config = f"name {name}, " if name is not None else ""
        why = [f"{type(x).__name__}: {str(x).splitlines()[0]}" for x in (e, e.__cause__)
               if x is not None and str(x).strip()]  # datasets' "An error occurred while generating" names no cause
        raise RecipeError(f"dataset source '{source}' ({config}split {split_name}) could not be loaded: "
                          f"{'; caused by '.join(why) or type(e).__name__}") from e
    return Rows(ds, source)


def resolve_source(source: str) -> str:
    """Expand `transfer:NAME` to the shipped file; other sources are returned unchanged."""
    if source.startswith(TRANSFER_PREFIX):
        from .transfer import transfer_set_path

        return str(transfer_set_path(source[len(TRANSFER_PREFIX):]))
    return source


def load_rows(source: str, split: str = "train", name: str | None = None, data_files: Any = None) -> Rows:
    """Rows of a dataset source, sliced by `split` (e.g. `train[:90%]`).

    source: a .json/.jsonl/.csv/.parquet file, a `save_to_disk` folder, `transfer:passages|chat`, or a
    `datasets.load_dataset` name/path (with optional `name` config and `data_files`).
    """
    if not isinstance(source, str) or not source:
        raise RecipeError(f"dataset.source must be a path or dataset name, got {'null' if source is None else repr(source)}")
    split_name, _, _ = parse_split(split)
    missing = missing_data_file(source, data_files)
    if missing is not None:
        raise RecipeError(f"dataset.{missing[0]}: {missing[1]}")
    path = Path(resolve_source(source)).expanduser()
    if path.is_file() and data_files is None:
        if split_name != "train":  # as datasets.load_dataset reads a file: one split, `train`
            raise RecipeError(f"dataset.split: {split!r}, but {path} is one file, whose rows are the split 'train'; "
                              "pick rows with a slice (e.g. train[:90%], train[90%:])")
        suffix = path.suffix.lower()
        readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
        if suffix not in readers:
            raise RecipeError(f"{path}: unsupported file type '{suffix}'; use .json, .jsonl, .csv or .parquet")
        rows = readers[suffix](path)
    elif path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        rows = _load_from_disk(path, split_name)
    else:
        rows = _load_hf(str(path) if path.exists() else source, split_name, name, data_files)
    return slice_rows(rows, split)


def data_file_entries(data_files: Any) -> list[str]:
    """The paths or patterns of a `data_files` value: a string, a list of them, or a split -> either mapping."""
    if isinstance(data_files, str):
        return [data_files]
    if isinstance(data_files, dict):
        return [e for v in data_files.values() for e in data_file_entries(v)]
    if isinstance(data_files, (list, tuple)):
        return [e for v in data_files for e in data_file_entries(v)]
    return []


def missing_data_file(source: str, data_files: Any = None) -> tuple[str, str] | None:
    """`(key, problem)` when a dataset section names a local file that is not there or cannot be read as rows (a
    suffix the readers do not know, a model folder), else None; no file is read.

    `source` is checked when it looks like a path (`_looks_like_path`: /, ./, ../ or ~, a file suffix, two '/');
    `data_files` entries when they are local (the source a packaged builder such as `json`, or a folder here;
    a Hub dataset's own files and URLs are the loader's to find): a path must exist, a glob match a file. What
    `load_rows` raises after the weights load, a recipe can say before (`check_data_files`)."""
    if not isinstance(source, str) or not source:
        return None
    path = Path(resolve_source(source)).expanduser()
    if _looks_like_path(source) and not path.exists():
        here = "" if path.is_absolute() else f" (relative to the current directory, {Path.cwd()})"
        return "source", f"no such file or directory: {path}{here}"
    if path.is_file() and data_files is None and path.suffix.lower() not in _DATA_SUFFIXES:
        return "source", (f"{path}: unsupported file type '{path.suffix}'; use .json, .jsonl, .csv or .parquet"
                          + (f" (plain text, a document per line: dataset.source=text dataset.data_files={source} dataset.format=text)"
                             if path.suffix.lower() in (".txt", ".text", ".md") else ""))
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "source", f"{path} is a model folder (config.json, *.safetensors), not a dataset"
    for entry, full, found in local_data_files(source, data_files):
        if not found:
            return "data_files", (f"no file matches {entry}" if glob.has_magic(entry)
                                  else f"no such file or directory: {full}")
    return None


def local_data_files(source: str, data_files: Any) -> list[tuple[str, Path, list[Path]]]:
    """Each local `data_files` entry of a dataset section (the source a packaged builder such as `json`, relative
    to the current directory, or a folder, relative to it; a Hub dataset's own files and URLs are the loader's to
    find): the entry, its path, and the paths it names that exist (a glob's matches, sorted)."""
    path = Path(resolve_source(source)).expanduser()
    base = path if path.is_dir() else Path.cwd() if source in LOCAL_BUILDERS else None
    out = []
    for entry in data_file_entries(data_files):
        if base is None or "://" in entry:
            continue
        full = base / Path(entry).expanduser()
        found = (sorted(Path(m) for m in glob.glob(str(full), recursive=True)) if glob.has_magic(entry)
                 else [full] if full.exists() else [])
        out.append((entry, full, found))
    return out


def check_data_files(dataset: Any, where: Callable[[str], str] | None = None, key: str = "dataset") -> None:
    """A RecipeError, `where: key '<key>.data_files': no such file or directory: PATH`, when the `dataset`
    section (a `DatasetConfig`) names a local file that is not there (`missing_data_file`): recipes call it
    before any weights load, so the run fails in a second, not after the models are read. `where(dotted key)`
    names the file:line or override that set it."""
    missing = missing_data_file(dataset.source, dataset.data_files)
    if missing is not None:
        name = f"{key}.{missing[0]}"
        at = f"{where(name)}: " if where is not None else ""
        raise RecipeError(f"{at}key '{name}': {missing[1]}")
    from .formats import column_map_problem

    problem = column_map_problem(dataset.format, dataset.column_map)
    if problem is not None:
        at = f"{where(f'{key}.column_map')}: " if where is not None else ""
        raise RecipeError(f"{at}key '{key}.column_map': {problem}")
    if _is_hub_name(dataset.source):
        from ..hub import hub_unreachable

        why = hub_unreachable()
        if why is not None:  # datasets would retry for ~30 s, printing every try, then fail the same way
            at = f"{where(f'{key}.source')}: " if where is not None else ""
            raise RecipeError(f"{at}key '{key}.source': '{dataset.source}' is a Hugging Face Hub dataset, but {why}: "
                              f"set HF_HUB_OFFLINE=1 to load it from your Hugging Face cache, or point {key}.source "
                              "at a local file or folder")


def check_config_data_files(cfg: Any, where: Callable[[str], str] | None = None) -> None:
    """`check_data_files` for every dataset section of a typed config (`dataset`, `kd.on_policy.prompts`, ...): the
    recipes call it first in `main`, and `recipe run` before torchrun starts any rank (one line, not one per rank
    after 20 s of start-up)."""
    from dataclasses import fields, is_dataclass

    from .dataset import DatasetConfig

    def walk(obj: Any, prefix: str) -> None:
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, DatasetConfig):
                check_data_files(value, where, key=f"{prefix}{f.name}")
            elif is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{prefix}{f.name}.")

    if is_dataclass(cfg) and not isinstance(cfg, type):
        walk(cfg, "")


def _looks_like_path(source: str) -> bool:
    """A local path rather than a Hub name: starts with /, ./, ../ or ~, ends in a file suffix (a Hub name is
    `name` or `owner/name`), or has more than one '/'."""
    suffix = Path(source).suffix.lower()
    return (source.startswith(("/", "./", "../", "~")) or source.count("/") > 1
            or suffix in _DATA_SUFFIXES or suffix in _OTHER_FILE_SUFFIXES)


def _is_hub_name(source: Any) -> bool:
    """Whether `load_rows` would ask the Hub for `source`: not a local file or folder, a packaged builder
    (`json` with data_files) or a shipped `transfer:` set."""
    if not isinstance(source, str) or not source or source in LOCAL_BUILDERS or source.startswith(TRANSFER_PREFIX):
        return False
    return not _looks_like_path(source) and not Path(source).expanduser().exists()
