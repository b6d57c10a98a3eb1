"""On-policy rows of the second KD study (issue 22): does on-policy KD beat off-policy KD at equal GPU time?

Rows `onp50` and `onp100` are kd_r1's training (forward KL, kd_ratio 1.0) with kd.on_policy.fraction 0.5 / 1.0
(shipped defaults for the rest; `kd.on_policy.held_out=0`, so they read the very batches kd_r1 reads), paired
against kd_r1, the off-policy reference. Their prompts are the openings of the training passages. Rows `onp50c`
and `onp100c` are the same but sample on chat prompts, `kd.on_policy.prompts` = the shipped chat set from row 1043
on (`CHAT_SPLIT`): the distribution the metric below samples, without its rows (`chat_prompts_override` checks
that the two sets of rows, and of questions, are disjoint before any job is built), one prompt per row
(`CHAT_PER_ROW`). Rows naming one of them in `--rows` bring kd_r1 along (a model never leaves its lease, and the
comparison needs both). Every row is named, never a `--variant`: the prompts override holds commas, which a
variant's `key=value,key=value` list would split.

Equal GPU time: on-policy steps cost more (the student samples), so before the trainings each row's step time is
probed alone on the GPU (`probe`: its training for `onp_probe_steps` steps, or enough for 5 on-policy steps, each
step timed as its metrics line appears, the first quarter skipped as warm-up; the median off-policy and on-policy
step, weighted by the run's share of on-policy steps, so one-off compiles count in neither) and the on-policy rows train
steps = kd_r1's steps x kd_r1's step time / their step time (out/onp_steps.json, in results.json). Equal steps:
`--variant NAME=kd_r1:kd.on_policy.fraction=0.5,kd.on_policy.held_out=0` (a variant trains its base's steps; it
is scored like these rows).

The held-out on-policy metric (`eval`), one procedure for every student (pruned, sft, kd_r1, the on-policy rows):
the student samples an answer to each of the first `onp_prompts` Natural Questions of the shipped chat set
(transfer:chat, through the chat template) and the teacher scores it: per prompt, the mean per-token reverse
KL(student || teacher) and the teacher's NLL of the answer (components/on_policy.py's `score_samples`). Why these
prompts and not the in-run held-out rows (kd.on_policy.held_out): the students train on passages.jsonl only, so no
row ever saw them, and the in-run rows are passage openings that the transfer set samples several times, so
their siblings train; the off-policy rows would also need the on-policy section to score them. The SQuAD half of
the chat set is left out: its prompts quote paragraphs whose openings are training prompts. Every row samples the
same prompts with the same noise (one seed, prompt i's noise fixed by i), so rows compare prompt by prompt.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.kd_study import Job  # noqa: E402

# kd.on_policy.fraction of each row. onp10c / onp25c: the 2026-11-24 study's onp50c won the on-policy metric by
# z 9.9 and lost LAMBADA by z -12.6 at equal GPU time; smaller fractions keep more of the passages' steps. In one
# lease (2026-11-29) onp10c beat onp25c and onp50c on both (docs/kd_study.md), so onp5c asked whether less is better
# still: in one lease (2026-11-30) it kept onp10c's chat gain and lost less LAMBADA; onp2c asked where the gain
# ends: not above 2% (session 65: the same chat gain, no LAMBADA lost), so 0.02 is the default.
ONP_ROWS = {"onp50": 0.5, "onp100": 1.0, "onp50c": 0.5, "onp100c": 1.0, "onp10c": 0.1, "onp25c": 0.25, "onp5c": 0.05,
            "onp2c": 0.02}
CHAT_ROWS = ("onp50c", "onp100c", "onp10c", "onp25c", "onp5c", "onp2c")  # prompts: kd.on_policy.prompts, CHAT_SPLIT
CHAT_SPLIT = "train[1043:]"  # rows 0..1042 hold the first 512 Natural Questions, which the metric below samples
# One prompt per row: onp50 / onp100 sampled 32.5 prompts per on-policy micro-batch on average (one per packed
# 512-token passage row; 2026-11-24 H200 study), and a prompt set gives a micro-batch batch_size x prompts_per_row:
# 1 keeps 32 prompts and at most 32 x 512 tokens, so only where the prompts come from differs (the default, 8,
# would make it 256 prompts padded to the longest, up to 8x a data micro-batch's tokens).
CHAT_PER_ROW = 1
REFERENCE = "kd_r1"  # the off-policy row they are paired against (their training without kd.on_policy)
SCORED = ("pruned", "sft", "kd", REFERENCE)  # off-policy rows the on-policy metric also scores, when in --rows
EVAL_FILE = "on_policy.json"  # out/evals/<row>/on_policy.json
STEPS_FILE = "onp_steps.json"  # the probes and the equal-GPU-time steps
EVAL_SEED = 22  # the sampling noise of the on-policy metric, the same for every row
METRICS = {"onp_reverse_kl": "reverse_kl", "onp_teacher_nll": "teacher_nll"}  # per_item key -> per_prompt key
SCRIPT = str(ROOT / "bench" / "kd_study2_onp.py")


def _on_policy_variants(variants: list[tuple[str, str, list[str]]]) -> list[str]:
    return [name for name, _, overrides in variants if any(o.startswith("kd.on_policy") for o in overrides)]


def selected(s, variants: list[tuple[str, str, list[str]]]) -> list[str]:
    """The on-policy rows `--rows` names (they run only when named), variants with a kd.on_policy override too."""
    return [r for r in s.rows or [] if r in ONP_ROWS or r in _on_policy_variants(variants)]


def with_reference(s, variants: list[tuple[str, str, list[str]]]) -> list[str] | None:
    """`--rows`, plus kd_r1 when an on-policy row is in it (None: every standard row)."""
    if s.rows is None:
        return None
    return [*s.rows, REFERENCE] if selected(s, variants) and REFERENCE not in s.rows else list(s.rows)


def _argv(ref: Job, out_dir: Path, steps: int | str, extra: list[str]) -> list[str]:
    keep = [a for a in ref.argv if not a.startswith(("output_dir=", "max_steps="))]
    return [*keep, f"output_dir={out_dir}", f"max_steps={steps}", *extra]


def _onp(s, row: str) -> list[str]:
    """A row's on-policy overrides (the chat rows' prompt set included, each one argv element)."""
    chat = [chat_prompts_override(s.onp_prompts), f"kd.on_policy.prompts_per_row={CHAT_PER_ROW}"] \
        if row in CHAT_ROWS else []
    return [f"kd.on_policy.fraction={ONP_ROWS[row]}", "kd.on_policy.held_out=0", *chat, *s.onp_overrides]


def eval_rows(n: int) -> list[int]:
    """The shipped chat set's rows the on-policy metric samples: its first n Natural Questions (nq_open)."""
    from llm_recipe.components.data.sources import load_rows

    rows = load_rows("transfer:chat")
    return [i for i in range(len(rows)) if rows[i].get("source") == "nq_open"][:n]


@functools.lru_cache(maxsize=4)
def chat_prompts_override(n: int) -> str:
    """The chat rows' kd.on_policy.prompts override, once its rows (CHAT_SPLIT of the shipped chat set) are checked
    disjoint from the n rows the metric samples, by row and by question: SystemExit naming the overlap if not."""
    from llm_recipe.components.data.sources import load_rows

    train, every = load_rows("transfer:chat", split=CHAT_SPLIT), load_rows("transfer:chat")
    evaluated = eval_rows(n)
    question = lambda row: row["messages"][0]["content"].strip().lower()  # noqa: E731
    rows = sorted({train.source_index(i) for i in range(len(train))} & set(evaluated))
    asked = {question(every[i]) for i in evaluated} & {question(r) for r in train}
    if rows or asked or len(evaluated) < n:
        raise SystemExit(f"chat prompts {CHAT_SPLIT}: {len(rows)} rows ({rows[:5]}...) and {len(asked)} questions "
                         f"shared with the {len(evaluated)} of the {n} evaluated Natural Questions found: the "
                         "on-policy metric would score prompts the student trained on")
    return f'kd.on_policy.prompts={{source: transfer:chat, format: chat, split: "{CHAT_SPLIT}"}}'


def probe_jobs(s, out: Path, ref: Job, variants: list[tuple[str, str, list[str]]]) -> list[Job]:
    """One short timed training per row (kd_r1 and the selected on-policy rows): run them one at a time."""
    rows = [r for r in selected(s, variants) if r in ONP_ROWS]
    if not rows:
        return []
    def steps(row: str) -> int:  # the first quarter warms up; after it, 3 on-policy steps beside the first's compile
        return s.onp_probe_steps if row == REFERENCE else max(s.onp_probe_steps, math.ceil(5 / ONP_ROWS[row]))

    return [Job(f"probe:{row}", "train", [sys.executable, SCRIPT, "probe", "--name", row, "--out", str(out), "--",
                                          *_argv(ref, out / "probe" / row, steps(row),
                                                 [] if row == REFERENCE else _onp(s, row))], ref.deps, "probe")
            for row in [REFERENCE, *rows]]


def equal_time_steps(s, out: Path) -> dict | None:
    """out/onp_steps.json from the probes: steps = kd_r1's steps x an off-policy step's time / the row's step time.
    An off-policy step is the work of one of kd_r1's steps, timed inside the row's own probe (its median), so the
    machine's drift between two probes cancels: kd_r1's probe and the rows' differed by 10-20% in one lease with
    bit-identical losses (session 64). `off_vs_reference` shows what the rule leaves out: a row's off-policy steps
    against kd_r1's (1.0 when on-policy passes leave the data passes alone; session 63's probes read 1.35)."""
    probes = {p.stem: json.loads(p.read_text()) for p in sorted((out / "probe").glob("*.json"))}
    if REFERENCE not in probes:
        return None
    t_ref = probes[REFERENCE]["step_s"]

    def off_step(p: dict) -> float:  # what one of kd_r1's steps costs, timed in the row's own run where it can be
        return p.get("off_step_s") or t_ref

    plan = {"reference": REFERENCE, "reference_steps": s.steps, "probe": probes,
            "rule": "steps = reference_steps x row's median off-policy step / row step_s (its own run; without "
                    "off-policy steps: reference step_s)",
            "steps": {r: max(1, round(s.steps * off_step(p) / p["step_s"])) for r, p in probes.items() if r in ONP_ROWS},
            "off_vs_reference": {r: round(p["off_step_s"] / t_ref, 3) for r, p in probes.items()
                                 if r in ONP_ROWS and p.get("off_step_s")}}
    (out / STEPS_FILE).write_text(json.dumps(plan, indent=2) + "\n")
    return plan


def training_jobs(s, out: Path, ref: Job) -> list[Job]:
    """The selected on-policy rows at their equal-GPU-time steps (none before the probes ran)."""
    path = out / STEPS_FILE
    steps = json.loads(path.read_text())["steps"] if path.is_file() else {}
    return [Job(row, "train", argv, ref.deps, "kd", shlex.join(["recipe", *argv[3:]]))
            for row in (s.rows or []) if row in steps
            for argv in [_argv(ref, out / "train" / row, steps[row], _onp(s, row))]]


def eval_jobs(s, out: Path, teacher: str, variants: list[tuple[str, str, list[str]]]) -> list[Job]:
    """`onp_eval:ROW`, the held-out on-policy metric of every row it scores (select() keeps those in --rows)."""
    if not selected(s, variants):
        return []
    scale = ["--scale", json.dumps({k: getattr(s, k) for k in ("device", "onp_prompts", "onp_new_tokens",
                                                                 "onp_batch")})]
    rows = [*SCORED, *ONP_ROWS, *_on_policy_variants(variants)]
    return [Job(f"onp_eval:{r}", "eval", [sys.executable, SCRIPT, "eval", "--name", r, "--out", str(out), "--teacher",
                                          teacher, "--model", teacher if r == "pruned" else str(out / "train" / r /
                                                                                                  "model"), *scale],
                ["prune" if r == "pruned" else r], "eval") for r in rows]


# --------------------------------------------------------------------------------------------- probe / eval


def probe(name: str, out: Path, argv: list[str]) -> int:
    """Run one training, timing each step by when its metrics line appears (polled every 5 ms), and write
    out/probe/<name>.json: its steady-state seconds per step (after the first quarter) and tokens/s."""
    run_dir = Path(next(a for a in argv if a.startswith("output_dir=")).split("=", 1)[1])
    metrics, seen, times = run_dir / "metrics.jsonl", 0, {}
    shutil.rmtree(run_dir, ignore_errors=True)  # a failed attempt's lines would be read as this one's
    proc = subprocess.Popen(argv, cwd=ROOT)
    while True:
        done = proc.poll() is not None
        text = metrics.read_text() if metrics.is_file() else ""
        lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
        for line in lines[seen:]:
            times[json.loads(line)["step"]] = time.perf_counter()
        seen = len(lines)
        if done:
            break
        time.sleep(0.005)
    if proc.returncode != 0:
        return proc.returncode
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    last, first = max(times), max(1, max(times) // 4)
    if last < first + 2:
        raise SystemExit(f"probe {name}: {last} steps; time at least 3 (onp_probe_steps)")
    steady = [r for r in rows if r["step"] > first]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in steady if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    result = {"row": name, "steps": last, "timed_steps": f"{first + 1}-{last}", "step_s": step_seconds(rows, times, first),
              "off_step_s": off_policy_step_seconds(rows, times, first),
              "step_s_mean": (times[last] - times[first]) / (last - first), "tokens_per_s": mean("tokens_per_s"),
              "sampling_share": mean("sampling_share"), "sampled_tokens_per_s": mean("sampled_tokens_per_s"),
              "cmd": shlex.join(["recipe", *argv[3:]])}
    (out / "probe" / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(run_dir)  # only the timing is kept
    return 0


def step_seconds(rows: list[dict], times: dict[int, float], first: int) -> float:
    """A row's steady step time from its probe: the median off-policy step and the median on-policy step after the
    first one (which compiles the decode step), weighted by the share of the run's steps that go on-policy. Medians,
    so a one-off stall (a compile, a new decode width's CUDA graph) moves neither; the weights, so a share of 0.05
    counts its on-policy steps (a median over all steps would see only off-policy ones). Fewer than 3 on-policy
    steps to time (or none in the run): the median over 2-step spans, the rule before (fraction 0.5 alternates)."""
    on, span = _spans(rows, times, first)
    timed_on = [d for k, d in span.items() if k in on and k != min(on)]
    if len(timed_on) < 3:
        spans = [(times[k + 2] - times[k]) / 2 for k in range(first, max(times) - 1) if k in times and k + 2 in times]
        return max(statistics.median(spans), 1e-9)
    share, off = len(on) / len(rows), [d for k, d in span.items() if k not in on]
    return share * statistics.median(timed_on) + (1 - share) * (statistics.median(off) if off else 0.0)


def off_policy_step_seconds(rows: list[dict], times: dict[int, float], first: int) -> float | None:
    """The median off-policy step of an on-policy row's probe (the work of one of kd_r1's steps, timed in the same
    run); None for kd_r1 itself, for a run with no off-policy step, or with fewer than 3 to time."""
    on, span = _spans(rows, times, first)
    off = [d for k, d in span.items() if k not in on]
    return statistics.median(off) if on and len(off) >= 3 else None


def _spans(rows: list[dict], times: dict[int, float], first: int) -> tuple[set[int], dict[int, float]]:
    """The steps that went on-policy, and each steady step's duration (metrics line to metrics line)."""
    on = {r["step"] for r in rows if r.get("on_policy_batches")}
    return on, {k: times[k] - times[k - 1] for k in range(first + 1, max(times) + 1) if k in times and k - 1 in times}


def chat_prompts(tokenizer, n: int) -> list[tuple[int, list[int]]]:
    """(chat row, prompt tokens) of the first n Natural Questions of the shipped chat set (`eval_rows`), in row
    order."""
    from llm_recipe.components.data.transfer.teacher import build_prompts

    rows = set(eval_rows(n))
    prompts = [(int(p.id[1:].split(".")[0]), p.tokens) for p in build_prompts(tokenizer, "chat", None, 1, 1)]
    return sorted(p for p in prompts if p[0] in rows)


def eval_one(name: str, model_dir: str, teacher_dir: str, out: Path, scale: dict) -> dict:
    """The held-out on-policy metric of one student into out/evals/<name>/on_policy.json (module docstring)."""
    import torch

    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer
    from llm_recipe.components.on_policy_sampling import sample_completions
    from llm_recipe.components.on_policy_score import per_prompt_summary, score_samples

    t0 = time.time()
    device = scale["device"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    keep = json.loads((out / "layers" / "layer_importance.json").read_text())["kept"] if name == "pruned" else None
    student, args = load_model(model_dir, dtype=dtype, device=device, keep_layers=keep)
    teacher, _ = load_model(teacher_dir, dtype=dtype, device=device)
    teacher.eval()
    tok = Tokenizer.from_dir(teacher_dir)
    items, prompts = zip(*chat_prompts(tok, scale["onp_prompts"]), strict=True)
    vocab = tok.vocab_size if args.vocab_size > tok.vocab_size else None
    new, temperature = scale["onp_new_tokens"], 1.0

    def sample(chunk: list[list[int]], rows: range) -> list[list[int]]:
        return sample_completions(student, chunk, new, temperature, tok.pad_id, tok.stop_ids, EVAL_SEED, rows,
                                  len(prompts), vocab)

    scores = score_samples(student, teacher, prompts, sample, scale["onp_batch"], tok.pad_id, vocab_size=vocab)
    result = {"name": name, "model": model_dir, "prompts_from": "transfer:chat, Natural Questions rows (nq_open), "
              "chat template; no study row trains on them", "seed": EVAL_SEED, "max_new_tokens": new,
              "temperature": temperature, "items": list(items), **per_prompt_summary(scores),
              "eval_s": round(time.time() - t0, 1),
              "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    dest = out / "evals" / name
    dest.mkdir(parents=True, exist_ok=True)
    (dest / EVAL_FILE).write_text(json.dumps(result) + "\n")
    return result


# ------------------------------------------------------------------------------------------------- collect


def merge(out: Path, ev: dict, result: dict, lines: list[str], variants: list[tuple[str, str, list[str]]]
          ) -> list[tuple[str, str, str]]:
    """Put each row's on-policy metric per prompt into ev[row]["per_item"] (so the paired comparisons take it),
    its means and SEs into result["rows"], a table into `lines`; return the on-policy pairs (name, base, row)."""
    from llm_recipe.components.eval.stats import mean_se

    table = []
    for name, e in ev.items():
        p = out / "evals" / name / EVAL_FILE
        if not p.is_file():
            continue
        d = json.loads(p.read_text())
        cells = {}
        for key, src in METRICS.items():
            e["per_item"][key] = dict(zip(d["items"], d["per_prompt"][src], strict=True))
            cells[key], cells[f"{key}_se"] = mean_se(d["per_prompt"][src])
        result["rows"][name]["on_policy"] = {**cells, "prompts": d["prompts"], "eval_s": d["eval_s"]}
        table.append(f"| {name} | {cells['onp_reverse_kl']:.4f} +- {cells['onp_reverse_kl_se']:.4f} | "
                     f"{cells['onp_teacher_nll']:.4f} +- {cells['onp_teacher_nll_se']:.4f} | {d['prompts']} |")
    steps = out / STEPS_FILE
    if steps.is_file():
        result["on_policy_steps"] = plan = json.loads(steps.read_text())
        ratios = plan.get("off_vs_reference") or {}  # absent in plans written before session 64
        lines += ["", f"equal GPU time: {plan['rule']}; step_s " + ", ".join(
            f"{r} {p['step_s']:.4f}" for r, p in plan["probe"].items()) + "; steps " + ", ".join(
            f"{r} {n}" for r, n in plan["steps"].items()) + f" ({REFERENCE} {plan['reference_steps']})"
            + (f"; off-policy step / {REFERENCE}'s: " + ", ".join(f"{r} {v}" for r, v in ratios.items()) if ratios
               else "")]
    if table:
        lines += ["", "held-out on-policy metric (student samples, teacher scores; lower is better):",
                  "| row | reverse KL per token | teacher NLL per token | prompts |", "| --- | --- | --- | --- |",
                  *table]
    return [(f"{r}_vs_{REFERENCE}", REFERENCE, r) for r in ONP_ROWS if r in ev and REFERENCE in ev]


def goal_lines(result: dict) -> list[str]:
    """Issue 22's goal per on-policy row: the on-policy metric better by > 2 SE, LAMBADA acc not worse by > 1 SE."""
    out = []
    for key, cmp in result.items():
        if key.startswith(tuple(ONP_ROWS)) and key.endswith(f"_vs_{REFERENCE}") and "onp_reverse_kl" in cmp:
            z_onp, z_lam = cmp["onp_reverse_kl"]["z"], cmp["lambada_acc"]["z"]
            holds = z_onp > 2 and z_lam >= -1
            result[key]["goal"] = {"holds": holds, "onp_reverse_kl_z": z_onp, "lambada_acc_z": z_lam}
            out.append(f"- goal ({key}): reverse KL better by z {z_onp:.2f} (> 2), LAMBADA acc z {z_lam:.2f} (>= -1): "
                       f"{'holds' if holds else 'does not hold'}")
    return ["", "issue 22's goal:", *out] if out else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["probe", "eval"])
    p.add_argument("--name", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model")
    p.add_argument("--teacher")
    p.add_argument("--scale", default="{}", help="eval: device, onp_prompts, onp_new_tokens, onp_batch (JSON)")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # probe: -- the training command
    a = p.parse_args(argv[:cut])
    if a.phase == "probe":
        (a.out / "probe").mkdir(parents=True, exist_ok=True)
        return probe(a.name, a.out, argv[cut + 1 :])
    eval_one(a.name, a.model, a.teacher, a.out, json.loads(a.scale))
    return 0


if __name__ == "__main__":
    sys.exit(main())
