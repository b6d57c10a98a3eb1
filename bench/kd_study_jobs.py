"""The KD studies' shared job scheduler (Job, resumable run_jobs, a run's metrics), apart from either study."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    """One process of the study: a training command line or an evaluation of a model folder."""

    name: str
    kind: str  # "train" | "eval"
    argv: list[str]
    deps: list[str] = field(default_factory=list)
    group: str = ""
    recipe_cmd: str = ""  # the user-facing `recipe run ...` form of a training command

    def command(self) -> str:
        return shlex.join(self.argv)



# ----------------------------------------------------------------------------------------------------- run


def _status_path(out: Path, name: str) -> Path:
    return out / "status" / (name.replace(":", "__") + ".json")


def _done(out: Path, name: str) -> bool:
    p = _status_path(out, name)
    return p.is_file() and json.loads(p.read_text()).get("rc") == 0


def _job_env(**extra: str) -> dict[str, str]:
    """The environment of a study subprocess: unbuffered output (llm_recipe comes from the install)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **extra)


def run_jobs(jobs: list[Job], out: Path, max_jobs: int) -> int:
    """Run `jobs` as subprocesses, at most `max_jobs` at once, each after its deps; returns the failure count."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "status").mkdir(parents=True, exist_ok=True)
    env = _job_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    pending = [j for j in jobs if not _done(out, j.name)]
    running: dict[str, tuple[subprocess.Popen, float, Any]] = {}
    failed: set[str] = set()
    t_start = time.time()
    while pending or running:
        for name, (proc, t0, fh) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            fh.close()
            wall = time.time() - t0
            _status_path(out, name).write_text(json.dumps({"rc": rc, "wall_s": round(wall, 1)}) + "\n")
            print(f"[{time.time() - t_start:7.1f}s] {'done' if rc == 0 else f'FAILED rc={rc}'} {name} "
                  f"({wall:.0f}s)", flush=True)
            if rc != 0:
                failed.add(name)
            del running[name]
        for job in list(pending):
            if len(running) >= max_jobs:
                break
            deps = job.deps
            active = {j.name for j in pending} | set(running)
            if any(d in failed or (d not in active and not _done(out, d)) for d in deps):
                print(f"skip {job.name}: a dependency failed", flush=True)
                failed.add(job.name)
                pending.remove(job)
                continue
            if not all(_done(out, d) for d in deps):
                continue
            log = open(out / "logs" / (job.name.replace(":", "__") + ".log"), "w")
            log.write(f"$ {job.command()}\n")
            log.flush()
            proc = subprocess.Popen(job.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            running[job.name] = (proc, time.time(), log)
            pending.remove(job)
            print(f"[{time.time() - t_start:7.1f}s] start {job.name}", flush=True)
        time.sleep(1.0)
    return len(failed)


def _run_stats(run_dir: Path) -> dict | None:
    """A training run's steps, final losses (mean of the last 20 steps), tokens/s (mean after the first 5 steps)
    and peak memory, from its metrics.jsonl; None if it has none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return None
    tail = rows[-20:]
    steady = rows[5:] or rows

    def mean(key: str, rs: list[dict]) -> float | None:
        vals = [r[key] for r in rs if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "steps": rows[-1].get("step"),
        "final_loss": mean("loss", tail), "final_ce": mean("ce_loss", tail), "final_kd": mean("kd_loss", tail),
        "tokens_per_s": mean("tokens_per_s", steady),
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in rows),
    }
