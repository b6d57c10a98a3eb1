"""bench/kd_study2.py (the GPU study of issue 11) runs end to end on CPU with tiny settings: transfer set written
by the teacher, layers scored once and shared by every student, SFT / KD (ratio 0.5 and 1.0) / KD from the
teacher's top-32 cache / QAT / KD-QAT trained, every row evaluated with standard errors, KD vs SFT and cache vs
online KD compared on the same items, the gap and the PTQ loss recovered computed; then, on the same folder, only
the on-policy rows (issue 22): probes, equal-GPU-time steps, the held-out on-policy metric, paired with kd_r1."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kd_study2_tiny_end_to_end(tmp_path, tiny_model_dir):
    out = tmp_path / "study"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "run", "--tiny", "--teacher",
                        str(tiny_model_dir), "--out", str(out), "--jobs", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").is_dir() else ""
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    res = json.loads((out / "results.json").read_text())
    assert set(res["rows"]) == {"teacher", "teacher_ptq", "pruned", "sft", "kd", "kd_r1", "kd_cache", "kd_ptq",
                                "qat", "kd_qat"}
    keep = json.loads((out / "layers" / "layer_importance.json").read_text())["kept"]
    assert res["keep"] == keep and len(keep) == 2  # --tiny keeps 2 of the tiny model's 4 layers
    for name in ("sft", "kd", "kd_r1", "kd_cache"):  # same scored layers, same steps
        cmd = (out / "logs" / f"{name}.log").read_text().splitlines()[0]
        assert f"student.keep_layers=[{','.join(map(str, keep))}]" in cmd
        rows = [json.loads(x) for x in (out / "train" / name / "metrics.jsonl").read_text().splitlines() if x]
        assert rows[-1]["step"] == 2
    assert (out / "train" / "kd_qat" / "model" / "quantization.json").is_file()  # KD-QAT trained through 8da4w
    for row in res["rows"].values():
        assert row["lambada"]["items"] == 4 and row["lambada"]["acc_se"] >= 0
        for task in ("hellaswag", "arc_easy", "piqa"):
            assert row[task]["items"] == 4 and row[task]["acc_norm_se"] >= 0
    assert set(res["kd_vs_sft"]) == {"lambada_acc", "lambada_nll", "hellaswag_acc_norm", "arc_easy_acc_norm",
                                     "piqa_acc_norm"}
    assert set(res["cache_vs_online"]) == set(res["kd_qat_vs_qat"]) == set(res["kd_vs_sft"])
    assert "teacher.logits_dir=" in (out / "logs" / "kd_cache.log").read_text().splitlines()[0]
    assert (out / "kd_logits" / "manifest.json").is_file()
    assert set(res["gap_recovered"]) == {"sft", "kd", "kd_r1", "kd_cache"}
    assert set(res["gap_recovered"]["kd"]) == set(res["kd_vs_sft"])
    assert set(res["ptq_loss_recovered"]) == {"qat", "kd_qat"}
    assert "KD - SFT" in (out / "table.md").read_text()
    assert (out / "transfer" / "passages.jsonl").stat().st_size > 0

    # A sweep on the same folder: only the variant rows (and their own top-k cache) run; the finished rows are kept
    sft_log = (out / "logs" / "sft.log").stat().st_mtime_ns
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "run", "--tiny", "--teacher",
                        str(tiny_model_dir), "--out", str(out), "--jobs", "2",
                        "--variant", "kd_cache8=kd_cache:cache.top_k=8,kd.kd_ratio=1.0",
                        "--variant", "qat_lr=qat:optimizer.lr=1.0e-04", "--rows", "kd_cache8,qat_lr"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert {"kd_cache8", "qat_lr"} <= set(res["rows"]) and (out / "logs" / "sft.log").stat().st_mtime_ns == sft_log
    cmd = (out / "logs" / "kd_cache8.log").read_text().splitlines()[0]
    assert f"teacher.logits_dir={out / 'kd_logits_kd_cache8'}" in cmd and cmd.endswith("kd.kd_ratio=1.0")
    assert json.loads((out / "kd_logits_kd_cache8" / "manifest.json").read_text())["top_k"] == 8
    assert json.loads((out / "kd_logits" / "manifest.json").read_text())["mode"] == "topk"
    assert set(res["kd_cache8_vs_kd_cache"]) == set(res["kd_vs_sft"]) and "qat_lr" in res["ptq_loss_recovered"]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "plan", "--variant", "x=nope:a=1"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "--variant 'x=nope:a=1'" in bad.stderr

    # A data sweep row: SFT on the passages plus the teacher's answers to the first chat questions, one text file.
    # The tiny random teacher's chat replies decode to nothing (the transfer recipe drops empty rows), so its
    # answers are written here in the recipe's row format and its job marked done; the plan shows the real job.
    plan = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "plan", "--tiny", "--out", str(out),
                           "--variant", "sft_mix=sft:data=chat_mix", "--rows", "sft_mix"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert "run transfer" in plan.stdout and "prompts.passages=0 prompts.chat=16" in plan.stdout, plan.stdout[-2000:]
    (out / "transfer_chat").mkdir()
    (out / "transfer_chat" / "chat.jsonl").write_text("".join(json.dumps(
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}?"},
                                     {"role": "assistant", "content": f"answer number {i}."}]}) + "\n"
        for i in range(3)))
    (out / "status" / "transfer_chat.json").write_text(json.dumps({"rc": 0, "wall_s": 0.0}))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "run", "--tiny", "--teacher",
                        str(tiny_model_dir), "--out", str(out), "--jobs", "2", "--variant", "sft_mix=sft:data=chat_mix",
                        "--rows", "sft_mix"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*")) if "mix" in p.name
                     or "transfer_chat" in p.name)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    chat = (out / "transfer_chat" / "chat.jsonl").read_text().splitlines()
    passages = (out / "transfer" / "passages.jsonl").read_text().splitlines()
    mix = [json.loads(x) for x in (out / "transfer_mix" / "mix.jsonl").read_text().splitlines()]
    assert len(chat) == 3 and len(mix) == len(passages) + len(chat)
    assert [m["text"] for m in mix[:len(passages)]] == [json.loads(x)["text"] for x in passages]
    text = mix[len(passages)]["text"]  # the conversation rendered with the teacher's chat template
    assert "question 0?" in text and "answer number 0." in text and text.index("question") < text.index("answer")
    cmd = (out / "logs" / "sft_mix.log").read_text().splitlines()[0]
    assert f"dataset.source={out / 'transfer_mix' / 'mix.jsonl'}" in cmd and "data=chat_mix" not in cmd
    assert set(json.loads((out / "results.json").read_text())["sft_mix_vs_sft"]) == set(res["kd_vs_sft"])
    assert (out / "logs" / "sft.log").stat().st_mtime_ns == sft_log

    # The on-policy rows alone (as a lease after `restore` runs them): kd_r1 is their reference, already trained
    # here; each row's step time is probed, onp50 / onp100 train kd_r1's GPU time, and every one of the three is
    # scored on the same held-out chat prompts with the same sampling noise, paired prompt by prompt with kd_r1.
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "run", "--tiny", "--teacher",
                        str(tiny_model_dir), "--out", str(out), "--jobs", "2", "--rows", "onp50,onp100"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((out / "logs").glob("*onp*.log")))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    assert (out / "logs" / "sft.log").stat().st_mtime_ns == sft_log
    res = json.loads((out / "results.json").read_text())
    plan = res["on_policy_steps"]
    assert set(plan["probe"]) == {"kd_r1", "onp50", "onp100"} and all(p["step_s"] > 0 for p in plan["probe"].values())
    assert plan["probe"]["onp100"]["sampling_share"] > 0 and plan["probe"]["kd_r1"]["sampling_share"] is None
    for name, fraction in (("onp50", 0.5), ("onp100", 1.0)):
        steps = plan["steps"][name]
        assert steps == max(1, round(2 * plan["probe"]["kd_r1"]["step_s"] / plan["probe"][name]["step_s"]))
        cmd = (out / "logs" / f"{name}.log").read_text().splitlines()[0]
        assert f"max_steps={steps}" in cmd and f"kd.on_policy.fraction={fraction}" in cmd and "kd.kd_ratio=1.0" in cmd
        rows = [json.loads(x) for x in (out / "train" / name / "metrics.jsonl").read_text().splitlines() if x]
        assert rows[-1]["step"] == steps and sum(r["on_policy_batches"] for r in rows) >= 1
    held = {n: json.loads((out / "evals" / n / "on_policy.json").read_text()) for n in ("kd_r1", "onp50", "onp100")}
    assert len({tuple(h["items"]) for h in held.values()}) == 1 and held["kd_r1"]["prompts"] == 4
    for h in held.values():
        assert min(h["per_prompt"]["tokens"]) > 0 and min(h["per_prompt"]["teacher_nll"]) >= 0
    for name in ("onp50", "onp100"):
        assert res["rows"][name]["lambada"]["items"] == 4 and "onp_reverse_kl" in res["rows"][name]["on_policy"]
        cmp = res[f"{name}_vs_kd_r1"]
        assert {"lambada_acc", "hellaswag_acc_norm", "onp_reverse_kl", "onp_teacher_nll"} <= set(cmp)
        assert cmp["onp_reverse_kl"]["items"] == 4 and set(cmp["goal"]) == {"holds", "onp_reverse_kl_z",
                                                                              "lambada_acc_z"}
    assert "issue 22's goal" in (out / "table.md").read_text()


def _study():
    sys.path.insert(0, str(ROOT))
    from bench import kd_study2, kd_study2_onp

    return kd_study2, kd_study2_onp


def test_on_policy_rows_get_equal_gpu_time_steps_and_bring_their_reference(tmp_path):
    """Steps = kd_r1's steps x kd_r1's probed step time / the row's; the rows run only when named, with kd_r1 (its
    training, evaluation and on-policy metric) and nothing else."""
    study, onp = _study()
    s = study.Scale(teacher=str(tmp_path / "teacher"), steps=400, rows=["onp50", "onp100"])
    every = study.Scale(teacher=s.teacher)  # no --rows: the standard rows only
    names = {j.name for j in study.select(study.training_jobs(every, tmp_path, [0, 1]) + study.eval_jobs(every,
                                                                                                        tmp_path), every)}
    assert "eval:kd_r1" in names and not any("onp" in n for n in names)
    (tmp_path / "probe").mkdir()
    for row, step_s in (("kd_r1", 0.1), ("onp50", 0.16), ("onp100", 0.25)):
        (tmp_path / "probe" / f"{row}.json").write_text(json.dumps({"row": row, "step_s": step_s}))
    assert onp.equal_time_steps(s, tmp_path)["steps"] == {"onp50": 250, "onp100": 160}
    jobs = study.select(study.training_jobs(s, tmp_path, [0, 1]) + study.eval_jobs(s, tmp_path), s)
    assert {j.name for j in jobs} == {"kd_r1", "onp50", "onp100", "eval:kd_r1", "eval:onp50", "eval:onp100",
                                      "onp_eval:kd_r1", "onp_eval:onp50", "onp_eval:onp100"}
    by = {j.name: j.argv for j in jobs}
    assert "max_steps=400" in by["kd_r1"] and not any(a.startswith("kd.on_policy") for a in by["kd_r1"])
    assert by["onp100"][-3:] == ["max_steps=160", "kd.on_policy.fraction=1.0", "kd.on_policy.held_out=0"]
    assert [a for a in by["onp50"] if a.startswith("max_steps")] == ["max_steps=250"]
    ref = {a for a in by["kd_r1"] if not a.startswith(("output_dir=", "max_steps="))}
    assert ref <= set(by["onp50"])  # kd_r1's training otherwise
    probes = onp.probe_jobs(s, tmp_path, next(j for j in jobs if j.name == "kd_r1"), [])
    assert [j.name for j in probes] == ["probe:kd_r1", "probe:onp50", "probe:onp100"]
    assert f"max_steps={s.onp_probe_steps}" in probes[1].argv and "kd.on_policy.fraction=0.5" in probes[1].argv


def test_a_probes_step_time_weighs_the_on_policy_steps_by_their_share_and_skips_one_off_stalls():
    """A share of 0.05 (on-policy every 20th step): the probe's step time is 5% of the median on-policy step and
    95% of the median off-policy one, whatever the first on-policy step spent compiling and a stall cost; the
    median over 2-step spans (the rule before, still kd_r1's) would see off-policy steps only. The probe of a 0.05
    row runs 100 steps (5 on-policy ones), of 0.5 the preset's 40."""
    _, onp = _study()
    rows = [{"step": k, **({"on_policy_batches": 1} if k % 20 == 0 else {})} for k in range(1, 101)]
    spent = {k: 12.0 if k == 20 else 0.5 if k % 20 == 0 else 5.0 if k == 50 else 0.07 for k in range(1, 101)}
    times, t = {}, 0.0
    for k in range(1, 101):
        t += spent[k]
        times[k] = t
    assert onp.step_seconds(rows, times, first=25) == pytest.approx(0.05 * 0.5 + 0.95 * 0.07)
    off_policy = [{"step": r["step"]} for r in rows]
    assert onp.step_seconds(off_policy, times, first=25) == pytest.approx(0.07)  # 2-step spans: stalls skipped
    every = [{"step": k, "on_policy_batches": 1} for k in range(1, 101)]  # fraction 1.0: no off-policy step
    assert onp.step_seconds(every, times, first=25) == pytest.approx(0.07)
    assert onp.off_policy_step_seconds(rows, times, first=25) == pytest.approx(0.07)  # the 5.0 s stall: not a median
    assert onp.off_policy_step_seconds(off_policy, times, first=25) is None  # kd_r1: its step_s is the reference
    assert onp.off_policy_step_seconds(every, times, first=25) is None
    study = _study()[0]
    s = study.Scale(teacher="t", rows=["onp5c", "onp50c"])
    ref = next(j for j in study.training_jobs(s, Path("o"), [0, 1]) if j.name == "kd_r1")
    steps = {j.name: next(a for a in j.argv if a.startswith("max_steps=")) for j in onp.probe_jobs(s, Path("o"), ref, [])}
    assert steps == {"probe:kd_r1": "max_steps=40", "probe:onp5c": "max_steps=100", "probe:onp50c": "max_steps=40"}


def test_collect_pairs_the_on_policy_metric_by_prompt(tmp_path):
    """collect: each row's on-policy metric joins its per-item values, so onp - kd_r1 is paired by prompt (lower
    is better: z > 0 means on-policy wins) beside LAMBADA, and the goal is read off the z values."""
    study, onp = _study()
    s = study.Scale(teacher=str(tmp_path), rows=["onp50"])
    lam = {"acc": 0.5, "acc_se": 0.1, "ppl": 10.0, "ppl_se": 1.0, "nll": 2.3, "items": 4}
    for row, rkl, acc in (("kd_r1", [1.0, 1.2, 0.9, 1.1], [1, 0, 1, 0]), ("onp50", [0.5, 0.6, 0.55, 0.7], [1, 0, 1, 1])):
        d = tmp_path / "evals" / row
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"lambada": lam, "per_item": {
            "lambada_acc": dict(enumerate(acc)), "lambada_nll": dict(enumerate([-2.0, -2.1, -2.2, -2.3]))}}))
        (d / "on_policy.json").write_text(json.dumps({"items": [3, 5, 8, 9], "prompts": 4, "eval_s": 1.0,
                                                      "per_prompt": {"reverse_kl": rkl, "teacher_nll": rkl}}))
    res = study.collect(s, tmp_path)
    cmp = res["onp50_vs_kd_r1"]
    assert cmp["onp_reverse_kl"]["items"] == 4 and cmp["onp_reverse_kl"]["diff"] == pytest.approx(0.4625)
    assert cmp["onp_reverse_kl"]["z"] > 2 and cmp["lambada_acc"]["diff"] == pytest.approx(0.25)
    assert cmp["goal"]["holds"] is True
    assert res["rows"]["onp50"]["on_policy"]["onp_reverse_kl"] == pytest.approx(0.5875)
    assert "held-out on-policy metric" in (tmp_path / "table.md").read_text()


def test_a_cache_variant_builds_its_own_cache_with_its_cache_keys(tmp_path):
    """`--variant NAME=kd_cache:cache.mode=sampled,cache.samples=32` (or cache.top_k=K) trains from a cache of its
    own, built by kd_logits with those keys over the same transfer set; its other overrides go to the training."""
    study, _ = _study()
    s = study.Scale(teacher=str(tmp_path / "teacher"), rows=["kd_cache_s32", "kd_cache8", "kd"],
                    variants=["kd_cache_s32=kd_cache:cache.mode=sampled,cache.samples=32",
                              "kd_cache8=kd_cache:cache.top_k=8,kd.kd_ratio=1.0"], pairs=["kd:kd_cache_s32"])
    jobs = study.select(study.training_jobs(s, tmp_path, [0, 1]) + study.eval_jobs(s, tmp_path), s)
    by = {j.name: j for j in jobs}
    assert {"kd", "kd_cache_s32", "kd_logits_kd_cache_s32", "kd_cache8", "kd_logits_kd_cache8"} <= set(by)
    assert "kd_logits" not in by and "kd_cache" not in by  # the shared top-32 cache is not needed
    own = by["kd_logits_kd_cache_s32"].argv
    assert own[-3:] == [f"output_dir={tmp_path / 'kd_logits_kd_cache_s32'}", "cache.mode=sampled",
                        "cache.samples=32"] and "cache.top_k=32" in own
    assert "cache.mode=topk" not in own  # the variant's mode replaces the pinned one
    assert [a for a in by["kd_logits_kd_cache8"].argv if a.startswith("cache.top_k=")] == ["cache.top_k=8"]
    assert [a for a in by["kd_logits_kd_cache8"].argv if a.startswith("cache.mode=")] == ["cache.mode=topk"]
    base = {j.name: j for j in study.training_jobs(s, tmp_path, [0, 1])}["kd_logits"]
    assert "cache.mode=topk" in base.argv  # kd_cache stays the measured top-32 row, whatever kd_logits' default
    row = by["kd_cache_s32"]
    assert [a for a in row.argv if a.startswith("teacher.logits_dir=")] == [
        f"teacher.logits_dir={tmp_path / 'kd_logits_kd_cache_s32'}"]
    assert not any(a.startswith("cache.") for a in row.argv) and row.deps == ["prune", "kd_logits_kd_cache_s32"]
    assert by["kd_cache8"].argv[-1] == "kd.kd_ratio=1.0"


def test_equal_gpu_time_reads_an_off_policy_step_inside_the_rows_own_probe(tmp_path):
    """The machine ran 25% slower during kd_r1's probe than during the row's (session 64: bit-identical losses, step
    times 10-20% apart): the row's steps come from its own off-policy steps, so the drift cancels; a row with no
    off-policy step (fraction 1.0) falls back on kd_r1's probe; the ratio the rule leaves out is kept and shown."""
    study, onp = _study()
    s = study.Scale(teacher=str(tmp_path / "teacher"), steps=400, rows=["onp10c", "onp100c"])
    (tmp_path / "probe").mkdir()
    for row, step_s, off in (("kd_r1", 0.1, None), ("onp10c", 0.088, 0.08), ("onp100c", 0.4, None)):
        (tmp_path / "probe" / f"{row}.json").write_text(json.dumps({"row": row, "step_s": step_s, "off_step_s": off}))
    plan = onp.equal_time_steps(s, tmp_path)
    assert plan["steps"] == {"onp10c": round(400 * 0.08 / 0.088), "onp100c": 100}  # 364, not 455 by kd_r1's probe
    assert plan["off_vs_reference"] == {"onp10c": 0.8}


def test_chat_prompt_rows_sample_chat_prompts_apart_from_the_evaluated_ones(tmp_path, monkeypatch):
    """onp50c / onp100c: onp50 / onp100 (equal GPU time, kd_r1 along) whose on-policy prompts are the shipped chat
    set past the rows the metric samples, one per row; the override reaches `recipe run` as one argument that the
    kd config reads as a section (and the printed command keeps it quoted); a split reaching into the evaluated
    Natural Questions stops the plan before any job."""
    from llm_recipe.components.config import load_config, typed_config
    from recipes.kd import KDConfig

    study, onp = _study()
    s = study.Scale(teacher=str(tmp_path / "teacher"), steps=400, rows=["onp50c", "onp100c"])
    (tmp_path / "probe").mkdir()
    for row, step_s in (("kd_r1", 0.1), ("onp50c", 0.2), ("onp100c", 0.4)):
        (tmp_path / "probe" / f"{row}.json").write_text(json.dumps({"row": row, "step_s": step_s}))
    assert onp.equal_time_steps(s, tmp_path)["steps"] == {"onp50c": 200, "onp100c": 100}
    jobs = study.select(study.training_jobs(s, tmp_path, [0, 1]) + study.eval_jobs(s, tmp_path), s)
    assert {j.name for j in jobs} == {"kd_r1", "onp50c", "onp100c", "eval:kd_r1", "eval:onp50c", "eval:onp100c",
                                      "onp_eval:kd_r1", "onp_eval:onp50c", "onp_eval:onp100c"}
    by = {j.name: j for j in jobs}
    argv = by["onp100c"].argv
    assert argv[-4:] == ["kd.on_policy.fraction=1.0", "kd.on_policy.held_out=0",
                         'kd.on_policy.prompts={source: transfer:chat, format: chat, split: "train[1043:]"}',
                         "kd.on_policy.prompts_per_row=1"]
    assert shlex.split(by["onp100c"].recipe_cmd)[1:] == argv[3:]
    cfg = typed_config(load_config("kd/smollm2_study", [*argv[argv.index("kd") + 3 :], "output_dir=o"]), KDConfig)
    prompts = cfg.kd.on_policy.prompts
    assert (prompts.source, prompts.format, prompts.split, cfg.kd.on_policy.held_out) == (
        "transfer:chat", "chat", "train[1043:]", 0)
    assert not set(onp.eval_rows(512)) & set(range(1043, 2000)) and max(onp.eval_rows(512)) == 1042
    monkeypatch.setattr(onp, "CHAT_SPLIT", "train[1000:]")
    onp.chat_prompts_override.cache_clear()
    with pytest.raises(SystemExit, match=r"chat prompts train\[1000:\]: 26 rows .* shared with the 512"):
        study.training_jobs(s, tmp_path, [0, 1])
    onp.chat_prompts_override.cache_clear()
