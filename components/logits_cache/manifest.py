"""The offline-teacher cache's format: fingerprints, the manifest, shard encoding and verification.

A cache folder holds ``shard_NNNNN.safetensors`` files (a contiguous range of dataset items each) and
``manifest.json``. Per target token (a position whose shifted label is not -100) a shard stores, by ``mode``:

- ``topk``: the teacher's top-k log-probabilities at temperature T (fp16, 2k bytes), their ids (3 bytes each,
  little-endian: vocabularies up to 16.7M), and the log of the remaining mass (fp16, 2 bytes): 5k + 2 bytes, 162
  at k = 32 (tensors ``logprobs``, ``ids``, ``tail``);
- ``sampled``: N draws from the teacher's softmax at T, as the d distinct ids drawn (3 bytes each), how often each
  was drawn (uint8, so N <= 255) and the teacher's log-prob of each (fp16): 6d + 1 bytes (the 1: d itself), at
  most 6N + 1 = 193 at N = 32, and fewer the more peaked the teacher is (tensors ``widths`` [rows], then ``ids``,
  ``counts``, ``logprobs`` over the rows' distinct ids, row after row).

Per item a shard stores the offset of its first row (8 bytes per item).

The manifest records what the cache was built from, so that ``kd`` refuses a cache that does not match its run
(naming the field): the teacher (a fingerprint: config.json and a sampled hash of each weight file), the
tokenizer (hash of tokenizer.json and the chat template), the dataset section, packing, max_seq_len, k, T, the
vocabulary size, the mode (and N and the seed of the draws), a hash of the tokenized transfer set itself (no token is written anywhere), and per shard its
item range, token count, size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from ..checkpoint.atomic import atomic_write_bytes
from ..data.dataset import DatasetConfig
from ..errors import RecipeError
from ..schema import yaml_word

FORMAT = "recipe-logits-cache/1"
MODES = ("topk", "sampled")
MANIFEST = "manifest.json"
ID_BYTES = 3
# dataset keys that decide the tokenized items (shuffle/bucket only change the order batches are drawn in)
DATASET_FIELDS = ("source", "format", "split", "name", "data_files", "column_map", "train_on_input",
                  "use_chat_template", "limit", "packed", "max_seq_len")
# manifest fields a training run must match, in the order they are checked (first mismatch is reported)
RUN_FIELDS = ("tokenizer", *(f"dataset.{k}" for k in DATASET_FIELDS), "temperature", "data_sha256")
_SAMPLE = 1 << 20  # bytes per sampled block of a weight file
_BLOCKS = 8


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def student_head_error(cache_dir: str | Path, student_vocab: int, cache_vocab: int) -> str:
    """The one line for a student whose head is smaller than a cache's vocabulary (kd checks it before any weights
    load; the reader again when it opens the cache)."""
    return (f"teacher.logits_dir={cache_dir}: the student's head has {student_vocab} rows, fewer than the cache's "
            f"vocabulary ({cache_vocab} tokens): the student cannot score every token the teacher's targets name")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def teacher_fingerprint(model_dir: str | Path) -> str:
    """sha256 of config.json plus, per weight file (safetensors, or the pytorch_model.bin a folder may have instead),
    its name, size and sha256 of 8 evenly spaced 1 MiB blocks.

    Sampled rather than full: hashing 16 GB of weights would add a minute to every training start, and two
    teachers with the same shapes (other weights, other fine-tune) differ in every block.
    """
    d = Path(model_dir)
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted([*d.glob("*.safetensors"), *d.glob("pytorch_model.bin")]):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for i in range(_BLOCKS):
                fh.seek(max(0, (size - _SAMPLE) * i // (_BLOCKS - 1)))
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    """sha256 of tokenizer.json (its canonical JSON) and of the chat template (tokenizer_config.json)."""
    d = Path(model_dir)
    try:
        data = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"{d}: no tokenizer.json") from None
    h = hashlib.sha256(json.dumps(data, sort_keys=True).encode())
    cfg = d / "tokenizer_config.json"
    template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template") if cfg.is_file() else None
    jinja = d / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    h.update(json.dumps(template).encode())
    return h.hexdigest()


def data_fingerprint(items) -> str:
    """sha256 of the tokenized items (tokens, labels, packed document lengths), in order."""
    h = hashlib.sha256()
    for x in items:
        for key in ("tokens", "labels", "seq_lens"):
            if key in x:
                h.update(torch.tensor(list(x[key]), dtype=torch.int64).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()


def run_fields(dataset_cfg: Mapping[str, Any], tokenizer_dir: str | Path, temperature: float, items) -> dict:
    """The fields a cache and a training run must share (RUN_FIELDS), from the run's side (without
    data_sha256 when `items` is None)."""
    if isinstance(dataset_cfg, DictConfig):
        dataset_cfg = OmegaConf.to_container(dataset_cfg, resolve=True)
    fields: dict[str, Any] = {"tokenizer": tokenizer_fingerprint(tokenizer_dir)}
    defaults = {**DatasetConfig(source="").kwargs(), "source": None}  # a key left out has its default
    for k in DATASET_FIELDS:
        fields[f"dataset.{k}"] = dataset_cfg.get(k, defaults.get(k))
    fields["temperature"] = float(temperature)
    if items is not None:
        fields["data_sha256"] = data_fingerprint(items)
    return fields


# ------------------------------------------------------------------------------------------------ shard encoding


def pack_ids(ids: torch.Tensor) -> torch.Tensor:
    """int ids [n, k] (< 2**24) -> uint8 [n, 3k], little-endian."""
    ids = ids.to(torch.int64)
    return torch.stack([(ids >> s) & 0xFF for s in (0, 8, 16)], dim=-1).to(torch.uint8).flatten(-2)


def unpack_ids(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 3k] -> int64 [n, k]."""
    b = packed.to(torch.int64).unflatten(-1, (-1, ID_BYTES))
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)


def bytes_per_token(k: int, mode: str) -> int:
    """Payload bytes per target token: exact for top-k; for a sample of k draws, the most (every draw distinct)."""
    return 2 * k + ID_BYTES * k + 2 if mode == "topk" else (2 + ID_BYTES + 1) * k + 1


def encode_topk(logp: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor) -> dict[str, torch.Tensor]:
    """A top-k shard's tensors: log-probs [n, k] and tail [n] in fp16, packed ids."""
    return {"logprobs": logp.to(torch.float16).contiguous(), "ids": pack_ids(ids).contiguous(),
            "tail": tail.to(torch.float16).contiguous()}


def encode_sampled(logp: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """A sampled shard's tensors from compacted draws ``[n, N]`` (distinct ids first, count 0 = padding): each row's
    number of distinct ids, then its ids, counts and fp16 log-probs, ragged (no padding stored)."""
    keep = counts > 0
    return {"widths": keep.sum(-1).to(torch.uint8), "ids": pack_ids(ids[keep]).contiguous(),
            "counts": counts[keep].to(torch.uint8), "logprobs": logp[keep].to(torch.float16).contiguous()}


def decode_sampled(widths: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, logp: torch.Tensor,
                   samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a sampled shard back to ``(logp fp16, ids int64, counts int64)`` ``[n, samples]``, padded with 0:
    ``widths [n]`` of the rows, then ``ids`` (packed), ``counts`` and ``logp`` of their entries."""
    w = widths.to(torch.int64)
    n = w.shape[0]
    row = torch.repeat_interleave(torch.arange(n), w)
    starts = w.cumsum(0) - w
    col = torch.arange(row.shape[0]) - torch.repeat_interleave(starts, w)
    out_logp = torch.zeros(n, samples, dtype=torch.float16)
    out_ids = torch.zeros(n, samples, dtype=torch.int64)
    out_counts = torch.zeros(n, samples, dtype=torch.int64)
    out_logp[row, col] = logp
    out_ids[row, col] = unpack_ids(ids)
    out_counts[row, col] = counts.to(torch.int64)
    return out_logp, out_ids, out_counts


# ------------------------------------------------------------------------------------------------ manifest


def read_manifest(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"{path.parent}: no {path.name}; build the cache with `recipe run kd_logits`") from None
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: not valid JSON ({e})") from None
    if data.get("format") != FORMAT:
        raise RecipeError(f"{path}: format {data.get('format')!r} is not {FORMAT!r} (a cache of another version)")
    return data


def write_manifest(path: Path, manifest: dict) -> None:
    atomic_write_bytes(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-12)
    return a == b


def show_value(value: Any) -> str:
    """A manifest or config value as a message shows it: as YAML writes it (null, true, 500, topk), a sha256 by its
    first 12 digits."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return f"{value[:12]}..."
    return yaml_word(value)


def _read_back(text: str) -> Any:
    try:
        return OmegaConf.from_dotlist([f"v={text}"]).get("v")
    except Exception:  # noqa: BLE001 (not a value an override can carry as written: quote it)
        return None


def override(key: str, value: Any) -> str:
    """`key=value` as a shell word that `recipe run` reads back as `value` (YAML-typed, like every override)."""
    if value is None or isinstance(value, (bool, dict, list)):
        text = json.dumps(value)  # JSON is YAML: null, true, {"text": "passage"}, ["a.json"]
    else:
        text = str(value)
        if isinstance(value, str) and _read_back(text) != value:
            text = json.dumps(value)  # a string YAML would read as something else ("null", "1e5", "a: b")
    return shlex.quote(f"{key}={text}")


def first_difference(cached: Mapping[str, Any], now: Mapping[str, Any], keys) -> str | None:
    """The first key (in `keys` order) whose values differ, or None."""
    for k in keys:
        if not _same(cached.get(k), now.get(k)):
            return k
    return None


def shard_problem(cache_dir: Path, record: Mapping[str, Any], full: bool = True) -> str | None:
    """Why a recorded shard cannot be used (missing, truncated, checksum mismatch), or None when it is intact."""
    path = cache_dir / record["file"]
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"{path.name} is truncated or altered ({size} bytes, the manifest says {record['bytes']})"
    if full and sha256_file(path) != record["sha256"]:
        return f"{path.name} fails its checksum (sha256 differs from the manifest's)"
    return None
