"""How long a compiled KD teacher takes to its first forward, and how many graphs Dynamo builds for it (issue 19).

    python bench/compile_start.py --model DIR [--quantize fp8] [--recompile-limit N] [--tokens 4096] [--row 2048]
        [--repeat 20]

Loads the teacher exactly as `recipe run kd` does (load_model, prepare_teacher with compile, quantize_teacher),
then times its first forward (tracing + compilation) and a second one, under inference mode on a [2, tokens/2]
batch (`--row`: rows of that many tokens instead). Prints one JSON line: seconds for load, first and second forward,
and Dynamo's counters (unique graphs, recompiles); `--repeat N` adds the GPU milliseconds per 1,000 tokens of N
forwards issued back to back (how a micro-batch's size changes the teacher's speed). Run with
TORCH_LOGS=recompiles to see why a layer recompiles.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--quantize", default=None, choices=[None, "fp8", "int8_weight_only"])
    p.add_argument("--recompile-limit", type=int, default=None, help="torch._dynamo.config.recompile_limit")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--row", type=int, default=None, help="tokens per row (default: tokens / 2, two rows)")
    p.add_argument("--repeat", type=int, default=0, help="then time this many forwards back to back")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()

    import torch._dynamo

    from llm_recipe.components.models import load_model
    from llm_recipe.components.quantization.teacher import quantize_teacher
    from llm_recipe.components.runtime import prepare_teacher, setup_runtime

    if a.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = a.recompile_limit
    rt = setup_runtime("cuda", "bf16", 0)
    t0 = time.perf_counter()
    teacher, args = load_model(a.model, dtype=rt.dtype, device=rt.build_device(a.model), max_seq_len=a.tokens)
    prepare_teacher(rt, teacher, "auto", compile=not a.no_compile)
    quantize_teacher(teacher, a.quantize, rt.device)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    row = a.row or a.tokens // 2
    tokens = torch.randint(0, 32000, (a.tokens // row, row), device=rt.device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.inference_mode():
            teacher.skip_output = True
            teacher(tokens)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms_per_1k = None
    if a.repeat:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            start.record()
            for _ in range(a.repeat):
                teacher(tokens)
            end.record()
        torch.cuda.synchronize()
        ms_per_1k = round(start.elapsed_time(end) / a.repeat / tokens.numel() * 1000, 4)
    from torch._dynamo.utils import counters

    print(json.dumps({"quantize": a.quantize, "recompile_limit": a.recompile_limit, "compile": not a.no_compile,
                      "batch": list(tokens.shape), "ms_per_1k_tokens": ms_per_1k,
                      "load_s": round(load_s, 1), "first_forward_s": round(times[0], 1),
                      "second_forward_s": round(times[1], 3), "third_forward_s": round(times[2], 3),
                      "unique_graphs": counters["stats"]["unique_graphs"],
                      "recompiles": {k: v for k, v in counters["recompiles"].items()} if "recompiles" in counters
                      else None}), flush=True)
    if not a.no_compile:  # where compilation spent its time (Dynamo, AOTAutograd, Inductor), per phase
        from torch._dynamo.utils import compile_times

        print(compile_times(repr="str"), flush=True)


if __name__ == "__main__":
    main()
