"""bench/kd_study2.py (the GPU study of issue 11) runs end to end on CPU with tiny settings: transfer set written
by the teacher, layers scored once and shared by every student, SFT / KD (ratio 0.5 and 1.0) / KD from the
teacher's top-32 cache / QAT / KD-QAT trained, every row evaluated with standard errors, KD vs SFT and cache vs
online KD compared on the same items, the gap and the PTQ loss recovered computed."""

import json
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
    assert set(res["kd_cache8_vs_kd_cache"]) == set(res["kd_vs_sft"]) and "qat_lr" in res["ptq_loss_recovered"]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "kd_study2.py"), "plan", "--variant", "x=nope:a=1"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "--variant 'x=nope:a=1'" in bad.stderr
