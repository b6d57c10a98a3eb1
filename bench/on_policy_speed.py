"""On-policy KD's sampling speed on one GPU (issue 22), one command:

    python bench/kd_throughput.py build --out /tmp/kdb --tokenizer-dir DIR   # random 1B/8B HF folders, once
    python bench/on_policy_speed.py --out /tmp/kdb                           # the rows below, then a table
    python bench/on_policy_speed.py --out /tmp/kdb table                     # the table of what is done

Training rows: the shipped kd/llama3_1_8b_to_llama3_2_1b config as a user runs it (kd_throughput.py's `shipped`
command: paths, the shipped transfer passages, a run length) with the LoRA section, `kd.on_policy.fraction=0.5`
and `kd.on_policy.max_new_tokens=128` (today's eager GPU smoke, bench/results/2026-11-24_h200_on_policy_gpu_smoke.log):
- `onpolicy_compiled`: nothing else (decode: auto is the compiled, CUDA-graphed decode step on one GPU with the
  shipped compile: true);
- `onpolicy_compiled_alone`: the same, each on-policy micro-batch sampled alone, as before session 51 (a step's
  on-policy micro-batches are now sampled together; bench/sample_alone.py);
- `onpolicy_eager`: `kd.on_policy.decode=eager` (the eager sampling of the smoke, now with every document's prompt);
- `offpolicy`: `kd.on_policy.fraction=0` (the same run without sampling: what a step costs without it);
- `onpolicy_compiled_default`: `kd.on_policy.fraction=0.1`, the default share until session 65 (name and share kept
  so earlier results compare; `mean_tokens_per_s`: over steps with and without an on-policy micro-batch);
- `onpolicy_compiled_chat`: the shipped chat transfer set (`transfer:chat`, format chat): prompts of many lengths,
  so several width buckets (one compiled decode graph each);
- `onpolicy_compiled_chat_alone`: the same, each micro-batch sampled alone (longer prompts: smaller groups);
- `onpolicy_compiled_chat_padded`: the same, each sample trained in a row of its own padded to the longest, as
  before session 52 (bench/on_policy_layout.py padded; now a training row's samples are packed back into it);
- `onpolicy_compiled_chat_kvmicro` / `_kvsets`: the same with a sampling group's KV caches spanning at most one
  micro-batch's prompts, and also a set of them per decode shape, as before session 53 (bench/kv_budget.py);
- `onpolicy_compiled_fkl`: forward KL as the on-policy loss (a closed-form gradient, where reverse KL's is autograd);
- `onpolicy_compiled_steptime` / `_packed` / `_apart` / `_static`: tokens/s counting every micro-batch as a data
  one (so it compares step times), with the shipped layout, with on-policy micro-batches packed into the loader's
  shape, with each on-policy micro-batch a pass of its own (not joined: before session 59), and with the shipped
  layout compiled with static shapes (bench/on_policy_layout.py);
- `onpolicy_compiled_microbatch` / `offpolicy_microbatch`: each micro-batch's time, printed per step in the log;
- `onpolicy_compiled_unmerged` / `onpolicy_compiled_default_unmerged`: the LoRA adapters left in the decode step,
  as before session 61 (now they are merged into a sampling copy where it fits; bench/sample_unmerged.py).
Each reports, over the steps after `--warmup`: tokens/s, the on-policy steps' sampled tokens/s and sampling share
(medians), prompts per on-policy micro-batch, peak memory, seconds to the first step, how often Dynamo
recompiled and how often a CUDA graph was recorded, re-recorded or skipped (TORCH_LOGS=recompiles,cudagraphs: a
recompile or a recording per step would show here and in the per-step rates).

`decode` row: the 1B student's sampling at batch 32 (bench/decode_speed.py, its own process: generate_batch eager
and compiled, on-policy KD's sampler, transformers' generate with a static cache (compiled by transformers on CUDA)
and without compile), 64-token prompts, 256 new tokens.

Results: one JSON line per row in OUT/on_policy_speed.jsonl (decode rows in OUT/decode_speed.jsonl), run logs in
OUT/runs/NAME/log.txt; checkpoints and the final model of each row are deleted after it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from kd_throughput import LORA, _shipped_cmd  # noqa: E402  (bench/ is not a package)

ON = ["kd.on_policy.fraction=0.5"]
ROWS: dict[str, list[str]] = {
    "onpolicy_compiled": ON,
    "onpolicy_compiled_alone": ON,  # each micro-batch sampled alone, as before session 51 (bench/sample_alone.py)
    "onpolicy_eager": [*ON, "kd.on_policy.decode=eager"],
    "decode": [],
    "offpolicy": ["kd.on_policy.fraction=0"],
    # the default share until session 65 (now 0.02: docs/kd_study.md): at accumulation 8 most steps hold one on-policy
    # micro-batch and some none, so its steps differ; mean_tokens_per_s below weighs them by time
    "onpolicy_compiled_default": ["kd.on_policy.fraction=0.1"],
    # a diagnosis: the on-policy micro-batches' loss as forward KL, whose gradient is closed-form (two Triton passes
    # over the logits) where reverse KL's runs its reference implementation with autograd per chunk
    "onpolicy_compiled_fkl": [*ON, "kd.on_policy.loss=forward_kl"],
    "onpolicy_compiled_chat": [*ON, "dataset.source=transfer:chat", "dataset.format=chat",
                               "dataset.use_chat_template=true"],
}
# chat prompts, each micro-batch sampled alone: what sampling together gains when the prompts are long; and each
# sample trained in a row of its own (padded), not packed back into its training row
ROWS["onpolicy_compiled_chat_alone"] = ROWS["onpolicy_compiled_chat"]
ROWS["onpolicy_compiled_chat_padded"] = ROWS["onpolicy_compiled_chat"]
# the decode KV caches as before session 53: a micro-batch's positions per sampling group, and a set per shape
ROWS["onpolicy_compiled_chat_kvmicro"] = ROWS["onpolicy_compiled_chat"]
ROWS["onpolicy_compiled_chat_kvsets"] = ROWS["onpolicy_compiled_chat"]
# step times, every micro-batch counted as a data one: the shipped layout, on-policy micro-batches packed into the
# loader's shape, each trained in a pass of its own (not joined), and the shipped layout compiled with static shapes
# (bench/on_policy_layout.py)
for _how in ("steptime", "packed", "apart", "static", "microbatch"):
    ROWS[f"onpolicy_compiled_{_how}"] = ON
ROWS["offpolicy_microbatch"] = ROWS["offpolicy"]  # each micro-batch's time, on-policy or not (on_policy_layout.py)
# the LoRA adapters left in the decode step, as before session 61 (bench/sample_unmerged.py)
ROWS["onpolicy_compiled_unmerged"] = ON
ROWS["onpolicy_compiled_default_unmerged"] = ROWS["onpolicy_compiled_default"]
SCRIPTS = {"_alone": ["sample_alone.py"], "_unmerged": ["sample_unmerged.py"], "_padded": ["on_policy_layout.py", "padded"],  # a diagnosis row's script and its
           "_kvmicro": ["kv_budget.py", "kvmicro"], "_kvsets": ["kv_budget.py", "kvsets"],  # arguments, by suffix
           **{f"_{h}": ["on_policy_layout.py", h] for h in ("steptime", "packed", "apart", "static", "microbatch")}}


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def train_row(a: argparse.Namespace, name: str) -> dict:
    out_dir = a.out / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cmd = _shipped_cmd(SimpleNamespace(out=a.out, steps=a.steps, warmup=a.warmup), "lora", [], out_dir)
    cmd += [*ROWS[name], f"kd.on_policy.max_new_tokens={a.max_new_tokens}", "save_every_n_steps=null", *a.extra]
    for suffix, script in SCRIPTS.items():
        if name.endswith(suffix):
            cmd[1:3] = [str(ROOT / "bench" / script[0]), *script[1:]]  # in place of `-m llm_recipe.cli.main`
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_LOGS": "recompiles,cudagraphs"}
    t0 = time.time()
    with open(out_dir / "log.txt", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    row = {"row": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "cmd": " ".join(cmd[1:]),
           "lora": LORA, "max_new_tokens": a.max_new_tokens}
    for heavy in ("checkpoints", "model", "adapter"):  # a 1B model per row fills a small disk
        shutil.rmtree(out_dir / heavy, ignore_errors=True)
    text = (out_dir / "log.txt").read_text()
    if rc != 0:
        return {**row, "error": text[-2000:]}
    steps = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    timed = [s for s in steps if s["step"] > a.warmup]
    on = [s for s in timed if s.get("on_policy_batches")]
    first = re.search(r"first optimizer step done ([0-9.]+) s after launch", text)
    sampling = re.search(r"on-policy sampling: (.*)", text)
    held = out_dir / "on_policy_eval.json"
    row.update(
        tokens_per_s=_median([s["tokens_per_s"] for s in timed]),
        # the harmonic mean: tokens over time when the steps hold equal tokens (an on-policy step holds a few fewer)
        mean_tokens_per_s=(len(timed) / sum(1 / s["tokens_per_s"] for s in timed)) if timed else None,
        sampled_tokens_per_s=_median([s.get("sampled_tokens_per_s") for s in on]),
        sampling_share=_median([s.get("sampling_share") for s in on]),
        prompts_per_on_policy_batch=(sum(s["on_policy_prompts"] for s in on) / sum(s["on_policy_batches"] for s in on)
                                     if on else None),
        per_step_sampled_tokens_per_s=[round(s["sampled_tokens_per_s"]) for s in steps
                                       if s.get("sampled_tokens_per_s")],
        peak_gib=max(s.get("peak_memory_gib") or 0 for s in steps),
        first_step_s=float(first.group(1)) if first else None,
        recompiles=text.count("Recompiling function"),
        cudagraph_recordings=text.count("Recording function="),  # per width bucket: once, not per micro-batch
        cudagraph_rerecords=text.count("Re-recording function="),
        cudagraph_skips=text.count("skipping cudagraphs"),
        sampling=sampling.group(1).strip() if sampling else None,
        held_out=json.loads(held.read_text()) if held.exists() else None,
    )
    return row


def decode_row(a: argparse.Namespace) -> list[dict]:
    """Our sampler's rows, then transformers' in a process with HF_PYTHONPATH (when set) as its PYTHONPATH: our
    pinned huggingface-hub 2.x comes first on ours, and the GPU image's transformers refuses to import beside it."""
    dest = a.out / "decode_speed.jsonl"
    cmd = [sys.executable, str(ROOT / "bench" / "decode_speed.py"), "--shape", "llama1b", "--batch", "32",
           "--prompt", "64", "--new", "256", "--out", str(dest)]
    start = len(dest.read_text().splitlines()) if dest.exists() else 0
    subprocess.run([*cmd, "--rows", "ours_eager,ours_reduce-overhead,onpolicy_compiled"], cwd=ROOT,
                   capture_output=True, text=True, timeout=a.timeout)
    env = {**os.environ, "PYTHONPATH": os.environ.get("HF_PYTHONPATH", os.environ.get("PYTHONPATH", ""))}
    proc = subprocess.run([*cmd, "--rows", "hf_static,hf_static_nocompile"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=a.timeout)
    rows = [json.loads(ln) for ln in dest.read_text().splitlines()[start:] if ln.strip()] if dest.exists() else []
    for r in rows:
        r["row"] = f"decode:{r['row']}"
    return rows or [{"row": "decode", "rc": proc.returncode, "error": (proc.stdout + proc.stderr)[-2000:]}]


def table(out: Path) -> str:
    path = out / "on_policy_speed.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    latest = {r["row"]: r for r in rows}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = ["| row | tokens/s | sampled tokens/s | sampling share | prompts per on-policy micro-batch | peak GiB "
             "| first step s | recompiles, CUDA graphs recorded / re-recorded / skipped |",
             "|---|---|---|---|---|---|---|---|"]
    for r in latest.values():
        if "tokens_per_s" not in r or r.get("rc", 0) != 0:
            lines.append(f"| {r['row']} | failed: {str(r.get('error', ''))[-120:]!r} |")
            continue
        if r["row"].startswith("decode:"):  # decode_speed.py: sampling alone, batch 32, 256 new tokens
            lines.append(f"| {r['row']} (batch {r['batch']}, {r['new']} new) | | {r['tokens_per_s']:,} | | | | "
                         f"{r['first_s']} (first call) | graphs: {r.get('dynamo_graphs')} |")
            continue
        lines.append(f"| {r['row']} | {fmt(r['tokens_per_s'], ',.0f')} | {fmt(r['sampled_tokens_per_s'], ',.0f')} | "
                     f"{fmt(r['sampling_share'], '.0%')} | {fmt(r['prompts_per_on_policy_batch'], '.1f')} | "
                     f"{fmt(r['peak_gib'], '.1f')} | {fmt(r['first_step_s'], '.0f')} | {r['recompiles']}, "
                     f"{r.get('cudagraph_recordings')} / {r.get('cudagraph_rerecords')} / {r.get('cudagraph_skips')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", nargs="?", choices=["run", "table"], default="run")
    p.add_argument("--out", type=Path, default=Path("/tmp/kdb"), help="kd_throughput.py build's folder")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps (16 micro-batches each) per row")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones (compilation, CUDA graphs)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--extra", nargs="*", default=[], help="more overrides for every training row")
    a = p.parse_args()
    if a.phase == "run":
        if not (a.out / "student_1b" / "config.json").exists():
            sys.exit(f"{a.out}/student_1b is missing: run `python bench/kd_throughput.py build --out {a.out} "
                     "--tokenizer-dir DIR` first")
        for name in a.rows.split(","):
            rows = decode_row(a) if name == "decode" else [train_row(a, name)]
            for row in rows:
                with open(a.out / "on_policy_speed.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if k not in ("cmd", "error", "lora")}), flush=True)
                if "error" in row:
                    print(row["error"], flush=True)
    print(table(a.out))


if __name__ == "__main__":
    main()
