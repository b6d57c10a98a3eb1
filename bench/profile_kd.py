"""Where a KD step's GPU time goes: one `bench/kd_throughput.py` row of ours, run in-process under torch.profiler.

    python bench/profile_kd.py --out /tmp/kdb --row ours_lora_compile [--skip 8] [--active 4] [--top 40]

Runs the real `recipe run kd` (the row's exact arguments) and profiles `--active` optimizer steps after `--skip`
(compilation and warm-up excluded; steps are counted with torch.optim's global step hook). Prints the top CUDA
kernels by total device time and the share of each kernel family (matmul, attention, triton-fused, copies).
`--gaps`: also records host ops (a table by host time) and prints where the GPU sat idle inside the profiled steps
(the largest gaps between kernels, the kernels around each and the host ops running meanwhile), and the busy share
of the span. `--host`: cProfile the host's Python in those steps instead (what a host-bound step spends it on).
`--microbatches`: a marker kernel on the GPU as each micro-batch moves to the device (`torch.cuda._sleep`, longer for
an on-policy one), and per micro-batch of the profiled steps its span on the GPU's timeline and the time kernels ran
in it: an on-policy micro-batch whose kernels fill much less than its span kept the GPU waiting (on the host).

Several GPUs: `torchrun --standalone --nproc-per-node N bench/profile_kd.py ...` runs the row's recipe in each
worker (each joins the process group as `recipe run --nproc-per-node N` does), every rank under the profiler, rank 0
printing; NCCL's kernels are their own family, and `--gaps` shows where rank 0's GPU waited.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kd_throughput  # noqa: E402  (the row definitions)

FAMILIES = [("nccl (collectives)", r"nccl"), ("matmul", r"gemm|matmul|cutlass|xmma|nvjet|scaled_mm|f8f8|aten::(addmm|mm|bmm)\b"),
            ("attention", r"flash|fmha|attention"), ("triton (compiled)", r"^triton_"),
            ("copy/convert", r"copy|elementwise|cast|fill"), ("reduce/norm", r"reduce|norm|softmax")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/kdb"))
    p.add_argument("--row", default="ours_lora_compile", choices=[k for k, v in kd_throughput.ROWS.items()
                                                                  if v[0] in ("ours", "shipped") and "CACHE" not in v[2]
                                                                  and "DENSE_MASK" not in v[2]] + ["qat", "qat_plain"])
    p.add_argument("--skip", type=int, default=8)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: SmolLM2 shapes, CPU op times")
    p.add_argument("--gaps", action="store_true", help="GPU idle time between kernels and what the host did")
    p.add_argument("--host", action="store_true", help="cProfile the host's Python instead (a host-bound step)")
    p.add_argument("--microbatches", action="store_true", help="each micro-batch's GPU span and busy time")
    a = p.parse_args()
    side, student, extra = kd_throughput.ROWS.get(a.row, (a.row, "full", []))
    gpu = a.device == "cuda"
    row_args = argparse.Namespace(nproc=1, shapes="llama" if gpu else "smollm2", out=a.out, device=a.device,
                                  dtype="bf16" if gpu else "fp32", batch_size=4 if gpu else 2,
                                  seq_len=1024 if gpu else 128, data_limit=None if gpu else 64,
                                  steps=a.active + 1, warmup=a.skip)
    out_dir = a.out / "runs" / f"profile_{a.row}"
    if side in ("qat", "qat_plain"):  # the shipped QAT config on the 1B folder, fake quantization from the first
        # step (qat_plain: never, for the same step without it)
        after = "null" if side == "qat" else "100000"
        cmd = ["python", "-m", "llm_recipe.cli.main", "run", "qat", "--config", "qat/llama3_2_1b",
               f"model.checkpoint_dir={a.out / 'student_1b'}", f"output_dir={out_dir}", "overwrite=true",
               "dataset.source=transfer:passages", "dataset.format=text", "dataset.use_chat_template=false",
               f"max_steps={a.skip + a.active + 1}", f"qat.fake_quant_after_n_steps={after}", "qat.convert=false",
               "save_every_n_steps=null", "compile=true"]
    elif side == "shipped":  # the shipped 8B -> 1B config, paths only (optimizer steps of 8 micro-batches)
        cmd = kd_throughput._shipped_cmd(row_args, student, extra, out_dir) + ["overwrite=true"]
    else:
        cmd = kd_throughput._ours_cmd(row_args, student, extra, out_dir)
    argv = cmd[cmd.index("llm_recipe.cli.main") + 1:]

    from llm_recipe.cli.main import main as recipe_main

    if a.microbatches:
        mark_microbatches()
    if a.host:
        return profile_host(recipe_main, argv, a)
    sched = torch.profiler.schedule(wait=a.skip, warmup=1, active=a.active, repeat=1)
    activity = torch.profiler.ProfilerActivity.CUDA if gpu else torch.profiler.ProfilerActivity.CPU
    activities = [activity, torch.profiler.ProfilerActivity.CPU] if gpu and a.gaps else [activity]
    with torch.profiler.profile(activities=activities, schedule=sched) as prof:
        register_optimizer_step_post_hook(lambda *_: prof.step())
        rc = recipe_main(argv)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: every rank profiled the same way, rank 0 reports
        return
    # self time: with --gaps the host ops are recorded too, and their total device time is their kernels' again
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key) > 0 and not e.key.startswith("ProfilerStep")]
    total = sum(getattr(e, key) for e in events) or 1.0
    share: dict[str, float] = {}
    for e in events:
        fam = next((f for f, pat in FAMILIES if re.search(pat, e.key, re.I)), "other")
        share[fam] = share.get(fam, 0.0) + getattr(e, key) / total
    print(prof.key_averages().table(sort_by=key, row_limit=a.top, max_name_column_width=90))
    print(json.dumps({"row": a.row, "rc": rc, "device": torch.cuda.get_device_name() if gpu else "cpu",
                      "profiled_steps": a.active,
                      "ms_per_step": total / 1000 / a.active,
                      "share": {k: round(v, 3) for k, v in sorted(share.items(), key=lambda kv: -kv[1])}}))
    if gpu and a.microbatches:
        print_microbatches(prof.events())
    if gpu and a.gaps:  # the host's side too: the ops that take the most host time (a host-bound step shows here)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=90))
        print_gaps(prof.events(), a.active)


def profile_host(recipe_main, argv: list[str], a: argparse.Namespace) -> None:
    """cProfile `--active` steps after `--skip`: where the host's time goes in Python (Dynamo's guards and side
    effects, autograd, the recipe), which torch.profiler's op table does not show. Prints the top functions by
    own time and by cumulative time, and the wall time per profiled step."""
    import cProfile
    import pstats
    import time

    prof, seen, marks = cProfile.Profile(), [0], {}

    def on_step(*_):
        seen[0] += 1
        if seen[0] == a.skip:
            torch.cuda.synchronize()
            marks["start"] = time.perf_counter()
            prof.enable()
        elif seen[0] == a.skip + a.active:
            prof.disable()
            torch.cuda.synchronize()
            marks["end"] = time.perf_counter()

    register_optimizer_step_post_hook(on_step)
    rc = recipe_main(argv)
    stats = pstats.Stats(prof)
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key).print_stats(a.top)
    wall = (marks["end"] - marks["start"]) / a.active if "end" in marks else None
    print(json.dumps({"row": a.row, "rc": rc, "host_profile": True, "wall_ms_per_step_under_cprofile":
                      None if wall is None else round(wall * 1000, 1)}))


# marker kernels (`torch.cuda._sleep` cycles): a data micro-batch ~1 us, an optimizer step ~10 us, an on-policy
# micro-batch ~100 us (at the 1-2.5 GHz clocks of these GPUs); told apart by duration below 5 us / 50 us
MARKS = {"data": 2_000, "step": 20_000, "on_policy": 200_000}


def mark_microbatches() -> None:
    """Launch a marker kernel (`torch.cuda._sleep`) on the GPU as the kd recipe moves each micro-batch to the device
    (a longer one for an on-policy micro-batch) and before each optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from llm_recipe.recipes import kd

    to_device = kd.to_device

    def marked(batch, device):
        torch.cuda._sleep(MARKS["on_policy" if "prompt_lens" in batch else "data"])
        return to_device(batch, device)

    kd.to_device = marked
    register_optimizer_step_pre_hook(lambda *_: torch.cuda._sleep(MARKS["step"]))


def print_microbatches(events) -> None:
    """Each profiled micro-batch, from its marker to the next one (a step's last micro-batch ends at the optimizer
    step's marker): on-policy or not, its span on the GPU's timeline and the time kernels ran in it (markers
    excluded), then the medians by kind."""
    import statistics

    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                     and not e.name.startswith("ProfilerStep"))
    marks = [(start, end, "data" if end - start < 5 else "step" if end - start < 50 else "on_policy")
             for start, end, name in kernels if "spin" in name.lower()]
    rows = []
    for (_, end, kind), (stop, _, _) in zip(marks, marks[1:]):
        if kind == "step":
            continue
        inside = [(s, e, n) for s, e, n in kernels if s >= end and e <= stop and "spin" not in n.lower()]
        busy = idle_gaps(inside, 1e9)[0] if inside else 0.0
        rows.append({"on_policy": kind == "on_policy", "span_ms": round((stop - end) / 1000, 2),
                     "busy_ms": round(busy / 1000, 2)})
        print(json.dumps(rows[-1]))
    if not rows:
        print(json.dumps({"microbatches": "no marker kernels recorded"}))
    for on in (False, True):
        mine = [r for r in rows if r["on_policy"] == on]
        if mine:
            print(json.dumps({"on_policy": on, "microbatches": len(mine),
                              "median_span_ms": statistics.median(r["span_ms"] for r in mine),
                              "median_busy_ms": statistics.median(r["busy_ms"] for r in mine)}))


def idle_gaps(kernels: list[tuple[float, float, str]], min_us: float) -> tuple[float, float, list[tuple]]:
    """(busy us, span us, gaps) of kernel intervals (start us, end us, name): the union of the intervals, first start
    to last end, and each idle stretch of at least `min_us` as (length, start, kernel before, kernel after)."""
    kernels = sorted(kernels)
    busy, gaps = 0.0, []
    cur_start, cur_end, cur_name = kernels[0]
    for start, end, name in kernels[1:]:
        if start > cur_end:  # the GPU idles from cur_end to start
            busy += cur_end - cur_start
            if start - cur_end >= min_us:
                gaps.append((start - cur_end, cur_end, cur_name, name))
            cur_start = start
        if end >= cur_end:
            cur_end, cur_name = end, name
    busy += cur_end - cur_start
    return busy, kernels[-1][1] - kernels[0][0], sorted(gaps, reverse=True)


def print_gaps(events, steps: int, min_us: float = 200.0, top: int = 25) -> None:
    """Where the GPU idled in the profiled steps, and the outermost host ops that ran during each gap."""
    from torch.autograd import DeviceType

    # kernels, copies and memsets only: a user annotation (ProfilerStep*, Optimizer.step#...) spans a whole step on
    # the GPU's timeline and would hide every gap inside it
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation and not e.name.startswith("ProfilerStep")]
    host = [e for e in events if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    if not kernels:
        print(json.dumps({"gaps": "no CUDA kernels recorded"}))
        return
    busy, span, gaps = idle_gaps(kernels, min_us)
    print(f"GPU busy {busy / 1000:.1f} ms of a {span / 1000:.1f} ms span ({busy / span:.1%}); idle "
          f"{(span - busy) / 1000 / steps:.1f} ms per step, {sum(g[0] for g in gaps) / 1000 / steps:.1f} ms of it in "
          f"gaps >= {min_us / 1000:.1f} ms ({len(gaps)} gaps)")
    for length, start, before, after in gaps[:top]:
        during = sorted(((min(e.time_range.end, start + length) - max(e.time_range.start, start), e.name)
                         for e in host if e.time_range.start < start + length and e.time_range.end > start),
                        reverse=True)[:4]
        print(f"- {length / 1000:6.2f} ms after {before[:60]!r} before {after[:60]!r}; host: "
              + ", ".join(f"{n[:50]} {d / 1000:.2f} ms" for d, n in during))
    print(json.dumps({"gpu_busy_share": round(busy / span, 4), "idle_ms_per_step": round((span - busy) / 1000 / steps, 2)}))


if __name__ == "__main__":
    main()
