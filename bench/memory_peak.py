"""What the peak GPU memory of a KD step is made of: one `bench/kd_throughput.py` row run in-process with the CUDA
caching allocator's history on, then the live allocations at the peak, grouped by where they were made.

    python bench/memory_peak.py --out /tmp/kdb --row shipped_lora [--steps 3] [--top 30]

Replays the allocator's alloc/free events from the start of the run (weights included), finds the moment of the
most allocated bytes, and prints those bytes grouped by the first Python frame in our code, torchtune or torchao
(else the first frame at all), largest first. The row's own arguments are kd_throughput's; `--steps` optimizer
steps are enough, since every step allocates the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kd_throughput  # noqa: E402  (the row definitions)

OURS = ("llm_recipe", "/components/", "/recipes/", "torchtune", "torchao")


def where(frames: list[dict]) -> str:
    """The first frame in our code or the libraries we drive, as file:line (function)."""
    pick = next((f for f in frames if any(k in f["filename"] for k in OURS)), frames[0] if frames else None)
    if pick is None:
        return "?"
    name = "/".join(Path(pick["filename"]).parts[-2:])
    return f"{name}:{pick['line']} ({pick['name']})"


def peak_breakdown(trace: list[dict]) -> tuple[int, dict[str, int]]:
    """(peak bytes, bytes per allocation site at the peak) from one device's allocator trace."""
    live: dict[int, dict] = {}
    total = peak = peak_at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, peak_at = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    live.clear()
    for ev in trace[: peak_at + 1]:  # replay again up to the peak: what was alive then
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    groups: dict[str, int] = defaultdict(int)
    for ev in live.values():
        groups[where(ev.get("frames") or [])] += ev["size"]
    return peak, groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/kdb"))
    p.add_argument("--row", default="shipped_lora", choices=[k for k, v in kd_throughput.ROWS.items()
                                                              if v[0] == "shipped" and "DENSE_MASK" not in v[2]])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    _, student, extra = kd_throughput.ROWS[a.row]
    row_args = argparse.Namespace(out=a.out, steps=a.steps, warmup=0)
    cmd = kd_throughput._shipped_cmd(row_args, student, extra, a.out / "runs" / f"memory_{a.row}") + ["overwrite=true"]
    argv = cmd[cmd.index("llm_recipe.cli.main") + 1:]

    from llm_recipe.cli.main import main as recipe_main

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    rc = recipe_main(argv)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, groups = peak_breakdown(snapshot["device_traces"][torch.cuda.current_device()])
    gib = 2**30
    print(f"row {a.row}: rc {rc}, peak of allocated bytes in the trace {peak / gib:.2f} GiB "
          f"(torch.cuda.max_memory_allocated {torch.cuda.max_memory_allocated() / gib:.2f} GiB)")
    for site, size in sorted(groups.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{size / gib:8.3f} GiB  {site}")
    print(json.dumps({"row": a.row, "peak_gib": peak / gib,
                      "sites": {k: v / gib for k, v in sorted(groups.items(), key=lambda kv: -kv[1])[: a.top]}}))


if __name__ == "__main__":
    main()
