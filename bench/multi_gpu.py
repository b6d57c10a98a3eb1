"""Issue 23 on one multi-GPU machine: scaling, every recipe to the end, PEFT, a killed rank, resume.

    python bench/multi_gpu.py scaling --models DIR --out OUT [--nprocs 1,2] [--rows kd_lora,kd_full]
    python bench/multi_gpu.py recipes --models DIR --out OUT [--nproc 2] [--rows full,lora,...] [--hf-path P]
    python bench/multi_gpu.py fault   --models DIR --out OUT [--nproc 2]   # after `recipes` (needs its lora run)
    python bench/multi_gpu.py table   --out OUT

DIR holds the random-weight `student_1b` (Llama-3.2-1B shape) and `teacher_8b` (Llama-3.1-8B) HF folders of
`bench/kd_throughput.py build`. Every run is `recipe run` on a shipped config with only paths changed (models, the
local transfer passages instead of the Hub's Alpaca, output_dir) and a run length; `scaling` adds the LoRA
section of issue 19 (r64 on q, v, o + MLP) to the shipped KD config, and the `_shard` row teacher.placement=shard
(a diagnosis: the shipped `auto` replicates on an H200). The per-GPU batch is the config's, so N GPUs train N
times the tokens per step. Results go to OUT/*.jsonl, one JSON line per run; `table` prints the Markdown tables.

- `scaling`: tokens/s over all GPUs (median of the steps after `--warmup`), x over 1 GPU, peak GiB (rank 0).
- `recipes`: each training recipe on `--nproc` GPUs to the end: outputs present (model/, adapter/, quantized/,
  sharded checkpoints, the cache's manifest); for adapters, bench/peft_check.py (run with `--hf-path` first on
  PYTHONPATH and none of ours: the machine's transformers) loads them in PEFT against our merged model/.
- `fault`: the `lora` run again, with rank 1 killed (SIGKILL) after step 5: how long until `recipe run` exits and
  what it says; then `resume=true` from its step-4 checkpoint, compared with the uninterrupted `lora` run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KD = "kd/llama3_1_8b_to_llama3_2_1b"
LORA = "lora={rank: 64, alpha: 128.0, targets: [q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
EXTRA: list[str] = []  # --extra: appended to every run (a CPU check of this script: device=cpu, tiny shapes)
DATA = ["dataset.source=transfer:passages", "dataset.format=text", "dataset.use_chat_template=false"]


def kd_paths(m: Path) -> list[str]:
    return [f"teacher.checkpoint_dir={m / 'teacher_8b'}", f"student.checkpoint_dir={m / 'student_1b'}", *DATA]


def scaling_rows(m: Path) -> dict[str, tuple[str, str, list[str]]]:
    return {
        "kd_lora": ("kd", KD, [*kd_paths(m), LORA]),
        "kd_lora_shard": ("kd", KD, [*kd_paths(m), LORA, "teacher.placement=shard"]),
        "kd_full": ("kd", KD, kd_paths(m)),
        # on-policy KD at 0.1 (the default share until session 65), and at 0.5 (sessions 55-59's row): 1 GPU samples
        # with the CUDA-graphed decode step through its merged copy, N through each rank's merged twin
        "kd_on_policy": ("kd", KD, [*kd_paths(m), LORA, "kd.on_policy.fraction=0.1"]),
        "kd_on_policy_half": ("kd", KD, [*kd_paths(m), LORA, "kd.on_policy.fraction=0.5"]),
        # 0.02: the default share since session 65 (docs/kd_study.md: 0.1 lost LAMBADA, 0.02 did not)
        "kd_on_policy_2pct": ("kd", KD, [*kd_paths(m), LORA, "kd.on_policy.fraction=0.02"]),
    }


def recipe_rows(m: Path, out: Path) -> dict[str, tuple[str, str, list[str], list[str]]]:
    """name -> (recipe, config, overrides, outputs that must exist). `lora` saves at step 4 (fault resumes there)."""
    s, t = m / "student_1b", m / "teacher_8b"
    return {
        "full": ("full", "full/llama3_2_1b", [f"model.checkpoint_dir={s}", *DATA, "max_steps=6",
                                              "save_every_n_steps=3"], ["model", "checkpoints/step_000003"]),
        "lora": ("lora", "lora/llama3_2_3b", [f"model.checkpoint_dir={s}", *DATA, "max_steps=8",
                                              "save_every_n_steps=4", "keep_last_n=null"], ["model", "adapter"]),
        "qlora": ("lora", "lora/llama3_1_8b_qlora", [f"model.checkpoint_dir={t}", *DATA, "max_steps=4"],
                  ["model", "adapter"]),
        "kd_lora": ("kd", KD, [*kd_paths(m), LORA, "max_steps=4"], ["model", "adapter"]),
        "kd_dora": ("kd", KD, [*kd_paths(m), LORA.replace("]}", "], use_dora: true}"), "max_steps=4"],
                    ["model", "adapter"]),
        "kd_full": ("kd", KD, [*kd_paths(m), "max_steps=4"], ["model"]),
        # on-policy KD: half the micro-batches sampled by the sharded student (eager decode: FSDP2 gathers in it)
        "kd_on_policy": ("kd", KD, [*kd_paths(m), LORA, "kd.on_policy.fraction=0.5", "max_steps=4"],
                         ["model", "adapter", "on_policy_eval.json"]),
        "qat": ("qat", "qat/llama3_2_1b", [f"model.checkpoint_dir={s}", *DATA, "max_steps=6",
                                           "qat.fake_quant_after_n_steps=2"], ["model", "quantized"]),
        "kd_logits": ("kd_logits", "kd_logits/llama3_1_8b", [f"teacher.checkpoint_dir={t}", f"tokenizer_dir={s}",
                                                             *DATA, "cache.items_per_shard=64"], ["manifest.json"]),
        "kd_from_cache": ("kd", KD, [*kd_paths(m), LORA, f"teacher.logits_dir={out / 'recipes' / 'kd_logits'}",
                                     "max_steps=4"], ["model", "adapter"]),
    }


def command(nproc: int, recipe: str, config: str, overrides: list[str], out_dir: Path) -> list[str]:
    launch = ["--nproc-per-node", str(nproc), "--standalone"] if nproc > 1 else []
    return [sys.executable, "-m", "llm_recipe.cli.main", "run", *launch, recipe, "--config", config, *overrides,
            *EXTRA, f"output_dir={out_dir}"]


def launch(cmd: list[str], log: Path, timeout: float, steps_at: dict[int, float] | None = None) -> tuple[int, float]:
    """Run `cmd` with its output in `log`: (exit code, wall seconds). `steps_at`: filled with the time each step's
    line appeared in the run's metrics.jsonl (polled every 5 ms), so a step's seconds can be told whatever its
    tokens (an on-policy pass's shape changes the tokens a step counts, not its time)."""
    t0 = time.time()
    log.parent.mkdir(parents=True, exist_ok=True)
    run_dir = Path(next((c.split("=", 1)[1] for c in cmd if c.startswith("output_dir=")), "."))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        seen = 0
        while proc.poll() is None and time.time() - t0 < timeout:
            if steps_at is not None and (run_dir / "metrics.jsonl").is_file():
                lines = (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]  # whole lines only
                for line in lines[seen:]:
                    steps_at.setdefault(json.loads(line)["step"], time.perf_counter())
                seen = len(lines)
            time.sleep(0.005 if steps_at is not None else 0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return 124, round(time.time() - t0, 1)
    return proc.returncode, round(time.time() - t0, 1)


def metrics(out_dir: Path) -> list[dict]:
    m = out_dir / "metrics.jsonl"
    return [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.is_file() else []


def log_facts(log: Path) -> dict:
    text = log.read_text(errors="replace") if log.is_file() else ""
    first = re.search(r"first optimizer step done ([0-9.]+) s after launch", text)
    placement = re.search(r"teacher\.placement=auto: (\w+)", text)
    return {"first_step_s": float(first.group(1)) if first else None,
            "placement": placement.group(1) if placement else None}


def sampled_tokens_per_s(steps: list[dict]) -> float | None:
    """On-policy KD: the median over `steps` of the student's sampled tokens/s (all GPUs); None off-policy."""
    rates = [s["sampled_tokens_per_s"] for s in steps if s.get("sampled_tokens_per_s")]
    return statistics.median(rates) if rates else None


def append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def first_sampling_step(steps: list[dict]) -> int | None:
    """The run's first step with an on-policy micro-batch (its decode step and sample passes compile there)."""
    return next((s["step"] for s in steps if s.get("on_policy_batches")), None)


def steady_step_seconds(at: dict[int, float], steps: list[dict], warmup: int) -> float | None:
    """Mean seconds per timed step without the run's first on-policy step when it falls among them: at a small share
    (0.02: session 65) the first one comes after the warm-up and compiles (26 s, once), which step_s_mean counts.
    Step k's seconds are the gap between its metrics line and the one before."""
    first_on = first_sampling_step(steps)
    gaps = [at[k] - at[k - 1] for k in sorted(at) if k > warmup and k - 1 in at and k != first_on]
    return sum(gaps) / len(gaps) if gaps else None


def cmd_scaling(a) -> None:
    rows = scaling_rows(a.models)
    for name in a.rows.split(","):
        recipe, config, over = rows[name]
        for n in (int(x) for x in a.nprocs.split(",")):
            out_dir = a.out / "scaling" / f"{name}_n{n}"
            subprocess.run(["rm", "-rf", str(out_dir)], check=True)
            cmd = command(n, recipe, config, [*over, f"max_steps={a.warmup + a.steps}", "save_every_n_steps=null"],
                          out_dir)
            at: dict[int, float] = {}
            rc, wall = launch(cmd, out_dir.with_suffix(".log"), a.timeout, at)
            steps = metrics(out_dir)
            timed = [s["tokens_per_s"] for s in steps if s["step"] > a.warmup]
            # on-policy rows mix steps that sample and steps that do not (the median is one kind's rate) and their
            # passes' shapes change the tokens a step counts: seconds per step over the timed steps compare runs
            last, first_on = max(at, default=0), first_sampling_step(steps)
            row = {"row": name, "nproc": n, "rc": rc, "wall_s": wall, "cmd": " ".join(cmd[3:]),
                   "tokens_per_s": statistics.median(timed) if timed else None,
                   "step_s_mean": (at[last] - at[a.warmup]) / (last - a.warmup) if a.warmup in at and last > a.warmup
                   else None,
                   "step_s_steady": steady_step_seconds(at, steps, a.warmup),
                   # without the first sampling step, whose compile a small share puts after the warm-up
                   "sampled_tokens_per_s": sampled_tokens_per_s([s for s in steps
                                                                 if s["step"] > a.warmup and s["step"] != first_on]),
                   "peak_gib": max((s.get("peak_memory_gib") or 0 for s in steps), default=None),
                   **log_facts(out_dir.with_suffix(".log"))}
            if rc:
                row["error"] = out_dir.with_suffix(".log").read_text(errors="replace")[-1500:]
            subprocess.run(["rm", "-rf", str(out_dir / "checkpoints"), str(out_dir / "model")], check=False)
            append(a.out / "scaling.jsonl", row)


def peft_check(a, base: Path, run_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": a.hf_path}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "peft_check.py"), str(base), str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else {"peft_error": proc.stderr[-1200:]}


def cmd_recipes(a) -> None:
    rows = recipe_rows(a.models, a.out)
    for name in a.rows.split(","):
        recipe, config, over, expect = rows[name]
        # several processes save a checkpoint as torch.distributed.checkpoint shards, one process as one file
        expect = [f"{e}/sharded" if e.startswith("checkpoints/") and a.nproc > 1 else e for e in expect]
        out_dir = a.out / "recipes" / name
        subprocess.run(["rm", "-rf", str(out_dir)], check=True)
        cmd = command(a.nproc, recipe, config, over, out_dir)
        rc, wall = launch(cmd, out_dir.with_suffix(".log"), a.timeout)
        steps = metrics(out_dir)
        row = {"recipe": name, "nproc": a.nproc, "rc": rc, "wall_s": wall, "cmd": " ".join(cmd[3:]),
               "steps": len(steps), "missing": [e for e in expect if not (out_dir / e).exists()],
               "tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[1:]) if len(steps) > 1 else None,
               "peak_gib": max((s.get("peak_memory_gib") or 0 for s in steps), default=None),
               "sampled_tokens_per_s": sampled_tokens_per_s(steps[1:]),
               **log_facts(out_dir.with_suffix(".log"))}
        if rc:
            row["error"] = out_dir.with_suffix(".log").read_text(errors="replace")[-1500:]
        elif (out_dir / "adapter").is_dir() and a.hf_path is not None and name != "qlora":  # QLoRA: NF4 base
            row["peft"] = peft_check(a, a.models / "student_1b", out_dir)
        append(a.out / "recipes.jsonl", row)
        # the disk (64 GiB on a one-GPU machine, with the 16 GB teacher folder) holds one run's model and
        # checkpoints at a time: kept are metrics, logs, adapter/ (the fault phase compares with lora's) and caches
        subprocess.run(["rm", "-rf", str(out_dir / "checkpoints"), str(out_dir / "model")], check=False)


def workers(parent: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers that `parent` (the `recipe run` process) started."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent:
                continue
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            found[int(rank[0][5:])] = int(stat.parent.name)
    return found


def cmd_fault(a) -> None:
    recipe, config, over, _ = recipe_rows(a.models, a.out)["lora"]
    ref = a.out / "recipes" / "lora"
    out_dir = a.out / "fault" / "lora"
    subprocess.run(["rm", "-rf", str(out_dir)], check=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log = out_dir.parent / "killed.log"
    cmd = command(a.nproc, recipe, config, over, out_dir)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline, killed_at, victim = time.time() + a.timeout, None, None
        while proc.poll() is None and time.time() < deadline:
            if killed_at is None and len(metrics(out_dir)) >= 5:
                victim = workers(proc.pid).get(1)
                if victim:
                    os.kill(victim, signal.SIGKILL)
                    killed_at = time.time()
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    left = list(workers(proc.pid).values())
    text = log.read_text(errors="replace")
    row = {"fault": "rank 1 SIGKILL after step 5", "victim_pid": victim, "rc": proc.returncode,
           "exit_after_kill_s": round(time.time() - killed_at, 1) if killed_at else None,
           "steps_logged": len(metrics(out_dir)), "workers_left": left,
           "last_line": [x for x in text.splitlines() if x.strip()][-1:],
           "recipe_error_lines": [x for x in text.splitlines() if x.startswith("recipe: error")][-3:]}
    # resume from the step-4 checkpoint: steps 5-8 again, against the uninterrupted run
    rc, wall = launch(command(a.nproc, recipe, config, [*over, "resume=true"], out_dir),
                      out_dir.parent / "resumed.log", a.timeout)
    mine, theirs = {r["step"]: r for r in metrics(out_dir)}, {r["step"]: r for r in metrics(ref)}
    row.update(resume_rc=rc, resume_wall_s=wall, resumed_steps=sorted(mine),
               loss_rel_diff={s: abs(mine[s]["loss"] - theirs[s]["loss"]) / abs(theirs[s]["loss"])
                              for s in sorted(mine) if s in theirs})
    if rc == 0 and (ref / "adapter").is_dir():
        from safetensors.torch import load_file

        x = load_file(str(out_dir / "adapter" / "adapter_model.safetensors"))
        y = load_file(str(ref / "adapter" / "adapter_model.safetensors"))
        row["adapter_max_abs_diff"] = max(float((x[k].float() - y[k].float()).abs().max()) for k in y)
        row["adapter_max_abs"] = max(float(y[k].float().abs().max()) for k in y)
        row["adapter_bitwise_equal"] = all(bool((x[k] == y[k]).all()) for k in y)
    elif rc:
        row["resume_error"] = (out_dir.parent / "resumed.log").read_text(errors="replace")[-1500:]
    append(a.out / "fault.jsonl", row)


def cmd_table(a) -> None:
    def read(name: str) -> list[dict]:
        p = a.out / name
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.is_file() else []

    scaling = read("scaling.jsonl")
    one = {r["row"]: r["tokens_per_s"] for r in scaling if r["nproc"] == 1 and r.get("tokens_per_s")}
    print("| row | GPUs | tokens/s (all GPUs) | x 1 GPU | peak GiB (rank 0) | first step s | teacher |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in scaling:
        tps = r.get("tokens_per_s")
        base = one.get(r["row"].removesuffix("_shard")) if r["nproc"] > 1 else None
        steady = (f", {r['step_s_steady']:.3f} without the first sampling step" if r.get("step_s_steady")
                  and r.get("step_s_mean") and abs(r["step_s_steady"] / r["step_s_mean"] - 1) > 0.01 else "")
        tps_cell = f"{tps:,.0f}" + (f" (sampled {r['sampled_tokens_per_s']:,.0f}; {r['step_s_mean']:.3f} s/step"
                                    f"{steady})" if r.get("sampled_tokens_per_s") and r.get("step_s_mean") else "") \
            if tps else f"failed rc {r['rc']}"
        print(f"| {r['row']} | {r['nproc']} | {tps_cell} | "
              f"{f'{tps / base:.2f}x' if tps and base else '-'} | {r.get('peak_gib') or '-'} | "
              f"{r.get('first_step_s') or '-'} | {r.get('placement') or '-'} |")
    print("\n| recipe | GPUs | result | steps | tokens/s | peak GiB | wall s | PEFT |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for r in read("recipes.jsonl"):
        ok = "ok" if r["rc"] == 0 and not r["missing"] else f"rc {r['rc']}, missing {r['missing']}"
        pe = r.get("peft") or {}
        peft = (f"merge: {pe['merge_mismatch']:.2%} of weights differ, <= {pe['merge_max_ulp']:.2f} step; logits rel "
                f"{pe['logits_rel_rounded']:.1e} (vs unrounded {pe['logits_rel']:.1e})" if "merge_mismatch" in pe
                else ("error" if pe else "-"))
        tps = r.get("tokens_per_s")
        tps_cell = f"{tps:,.0f}" + (f" (sampled {r['sampled_tokens_per_s']:,.0f})" if r.get("sampled_tokens_per_s")
                                     else "") if tps else "-"
        print(f"| {r['recipe']} | {r['nproc']} | {ok} | {r['steps']} | {tps_cell} | "
              f"{r.get('peak_gib') or '-'} | {r['wall_s']} | {peft} |")
    for r in read("fault.jsonl"):
        print("\n" + json.dumps(r, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["scaling", "recipes", "fault", "table"])
    p.add_argument("--models", type=Path, default=Path("/tmp/kdb"))
    p.add_argument("--out", type=Path, default=Path("/tmp/mgpu"))
    p.add_argument("--nprocs", default="1,2")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rows", default=None)
    p.add_argument("--steps", type=int, default=8, help="scaling: timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3, help="scaling: untimed first steps (compilation)")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--extra", nargs="*", default=[], help="overrides appended to every run (CPU checks)")
    p.add_argument("--hf-path", default=None, help="PYTHONPATH for bench/peft_check.py (none: no PEFT check)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    EXTRA.extend(a.extra)
    if a.rows is None:
        a.rows = ",".join(scaling_rows(a.models) if a.phase == "scaling" else recipe_rows(a.models, a.out))
    {"scaling": cmd_scaling, "recipes": cmd_recipes, "fault": cmd_fault, "table": cmd_table}[a.phase](a)


if __name__ == "__main__":
    main()
