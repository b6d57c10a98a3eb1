"""The second KD study's `collect`: results.json and table.md, kept apart from its job planner."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from bench import kd_study2_onp as onp
from bench.kd_study2_scale import CHOICE_TASKS, ROWS, STUDENTS, TRAINED, Scale, _keep, parse_variants
from bench.kd_study_jobs import _run_stats, _status_path

LOWER_IS_BETTER = ("lambada_nll", *onp.METRICS)  # paired differences of these are negated: > 0 is better

# ------------------------------------------------------------------------------------------------- collect


def _paired(a: dict, b: dict, sign: float) -> dict:
    from llm_recipe.components.eval.stats import paired_difference

    d = paired_difference({int(k): v for k, v in a.items()}, {int(k): v for k, v in b.items()})
    return {"diff": sign * d["diff"], "se": d["se"], "z": sign * d["z"], "items": d["items"]}


def _metrics(e: dict) -> dict[str, float]:
    """Every metric of one evaluation, oriented so that higher is better (LAMBADA NLL negated)."""
    m = {"lambada_acc": e["lambada"]["acc"], "lambada_nll": -e["lambada"]["nll"]}
    m.update({f"{k}_acc_norm": e[k]["acc_norm"] for k in CHOICE_TASKS if k in e})
    return m


def _fractions(ev: dict, low: str, top: str, rows) -> dict:
    """(row - low) / (top - low) per metric: the fraction of the low -> top gap each row closes."""
    lo, hi = _metrics(ev[low]), _metrics(ev[top])
    return {r: {k: (v - lo[k]) / (hi[k] - lo[k]) if k in lo and k in hi and hi[k] != lo[k] else None
                for k, v in _metrics(ev[r]).items()} for r in rows if r in ev}


def collect(s: Scale, out: Path) -> dict:
    """out/results.json and out/table.md: every row with SEs, KD vs SFT (paired), PTQ loss recovered."""
    variants = parse_variants(s)
    base_of = {name: base for name, base, _ in variants}
    ev = {}
    for name in [*ROWS, *onp.ONP_ROWS, *base_of]:
        p = out / "evals" / name / "summary.json"
        if p.is_file():
            ev[name] = json.loads(p.read_text())
    scores = out / "layers" / "layer_importance.json"
    layers = len(json.loads(scores.read_text())["layers"]) if scores.is_file() else "?"
    lines = [f"{s.tokens_per_run / 1e6:.1f}M tokens per training run ({s.steps} steps x {s.batch_size} x "
             f"{s.seq_len}); student: {len(_keep(out) or [])} of {layers} layers {_keep(out)}", "",
             "| row | LAMBADA acc | LAMBADA ppl | HellaSwag acc_norm | ARC-Easy acc_norm | PIQA acc_norm "
             "| train tokens/s | train wall s | eval s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    train: dict = {}
    for name in [*TRAINED, *onp.ONP_ROWS, "kd_logits", *base_of, *(f"kd_logits_{v}" for v in base_of)]:
        st = _status_path(out, name)
        wall = json.loads(st.read_text()).get("wall_s") if st.is_file() else None
        stats = _run_stats(out / "train" / name) or {}
        if wall is not None or stats:
            train[name] = {"wall_s": wall, **stats}

    def choice(e: dict, key: str) -> str:
        return f"{e[key]['acc_norm']:.4f} +- {e[key]['acc_norm_se']:.4f}" if key in e else "-"

    for name, e in ev.items():
        lam = e["lambada"]
        tps, wall = train.get(name, {}).get("tokens_per_s"), train.get(name, {}).get("wall_s")
        lines.append(f"| {name} | {lam['acc']:.4f} +- {lam['acc_se']:.4f} | {lam['ppl']:.4g} +- {lam['ppl_se']:.2g} "
                     f"| {' | '.join(choice(e, k) for k in CHOICE_TASKS)} | "
                     f"{'-' if tps is None else f'{tps:.0f}'} | {'-' if wall is None else f'{wall:.0f}'} | "
                     f"{e.get('eval_s', '-')} |")
    if ev:
        e = next(iter(ev.values()))
        lines += ["", "items: " + ", ".join([f"LAMBADA {e['lambada']['items']}",
                                              *(f"{k} {e[k]['items']}" for k in CHOICE_TASKS if k in e)])]
    result: dict = {"scale": asdict(s), "keep": _keep(out), "train": train,
                    "rows": {k: {kk: v for kk, v in e.items() if kk != "per_item"} for k, e in ev.items()}}
    # paired differences on the same items: (name, baseline, row); z = improvement of row over baseline / SE
    pairs = [("kd_vs_sft", "sft", "kd"), ("kd_r1_vs_sft", "sft", "kd_r1"), ("cache_vs_online", "kd", "kd_cache"),
             ("kd_qat_vs_qat", "qat", "kd_qat"), *((f"{v}_vs_{b}", b, v) for v, b in base_of.items()),
             *((f"{row}_vs_{base}", base, row) for base, _, row in (p.partition(":") for p in s.pairs)),
             *onp.merge(out, ev, result, lines, variants)]  # the on-policy metric per prompt joins per_item
    for key, base, row in pairs:
        if base in ev and row in ev:
            a, b = ev[base]["per_item"], ev[row]["per_item"]
            cmp = {k: _paired(a[k], b[k], -1.0 if k in LOWER_IS_BETTER else 1.0) for k in a if k in b}
            result[key] = cmp
            lines += ["", f"{row.upper()} - {base.upper()} on the same items (paired; z = improvement / SE; > 2 wins, "
                          "|z| < 1 within one SE; lambada_nll, onp_*: lower by):",
                      *[f"- {k}: {v['diff']:+.4f} +- {v['se']:.4f} (z {v['z']:.2f})" for k, v in cmp.items()]]
    lines += onp.goal_lines(result)

    def fraction_lines(title: str, fr: dict) -> list[str]:
        return ["", title, *[f"- {r}: " + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}"
                                                     for k, v in d.items()) for r, d in fr.items()]]

    if {"teacher", "pruned"} <= ev.keys():  # the fraction of the teacher - pruned gap each student closes
        result["gap_recovered"] = _fractions(ev, "pruned", "teacher", [
            *STUDENTS, *(v for v, b in base_of.items() if b in STUDENTS)])
        lines += fraction_lines("fraction of the teacher - pruned gap recovered, (row - pruned) / (teacher - pruned):",
                                result["gap_recovered"])
    if {"teacher", "teacher_ptq"} <= ev.keys():
        result["ptq_loss_recovered"] = _fractions(ev, "teacher_ptq", "teacher", [
            "qat", "kd_qat", *(v for v, b in base_of.items() if b in ("qat", "kd_qat"))])
        lines += fraction_lines("fraction of the PTQ loss recovered, (row - PTQ) / (teacher - PTQ):",
                                result["ptq_loss_recovered"])
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result
