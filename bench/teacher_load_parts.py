"""Where the seconds of `teacher weights` go (issue 19): the 8B teacher's load_model steps timed one by one on the GPU.

    python bench/teacher_load_parts.py --model /tmp/kdb/teacher_8b
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llm_recipe.components.models import loader
from llm_recipe.components.models.args import check_weight_shapes, read_model_args
from llm_recipe.components.models.builder import build_model
from llm_recipe.components.models.stream_load import read_into, stored_tensors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    a = p.parse_args()
    dev = torch.device("cuda")
    parts = {}
    t = time.perf_counter()

    def lap(name):
        nonlocal t
        torch.cuda.synchronize()
        now = time.perf_counter()
        parts[name] = round(now - t, 2)
        t = now

    torch.empty(1, device=dev)
    lap("cuda init")
    args = read_model_args(a.model)
    check_weight_shapes(a.model, args)
    lap("args and header check")
    with loader._default_dtype(torch.bfloat16), dev:
        model = build_model(args, max_seq_len=2048)
    lap("build_model on the GPU (random init)")
    targets = model.state_dict()
    stored = loader.hf_to_tune_names(stored_tensors(a.model), tied=args.tie_word_embeddings)
    lap("state_dict and headers")
    read_into({k: targets[k] for k in stored}, stored)
    lap("read_into")
    del model, targets
    torch.cuda.empty_cache()
    lap("free")
    loader.load_model(a.model, dtype="bf16", device=dev, max_seq_len=2048)
    lap("load_model whole")
    print(json.dumps(parts))


if __name__ == "__main__":
    main()
