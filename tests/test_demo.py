"""The main job on a smaller run: distillation must move the pruned student's numbers the right way."""

import json

from cli.demo import run_demo, summary_table


def test_demo_distilled_student_beats_pruned_student(tmp_path, embedded_model_dir):
    rows = run_demo(str(tmp_path / "demo"), limit=6, steps=12,
                    kd_overrides=("dataset.max_seq_len=64", "save_every_n_steps=null"))
    names = [r.name for r in rows]
    assert names == ["teacher", "pruned student", "student after KD", "after KD + 8da4w"]
    teacher, pruned, distilled, quantized = rows
    # The pruned student starts near random; a few KD steps must cut its LAMBADA perplexity by orders of magnitude.
    assert distilled.metrics["lambada_ppl"] < pruned.metrics["lambada_ppl"] / 100
    assert teacher.metrics["lambada_ppl"] < distilled.metrics["lambada_ppl"]
    assert distilled.params == pruned.params < teacher.params
    assert quantized.size_bytes < distilled.size_bytes
    out = tmp_path / "demo"
    for rel in ("kd/model/model.safetensors", "kd/metrics.jsonl", "kd/loss.png", "quantized/hf/config.json",
                "quantized/student-Q4_0.gguf", "summary.txt"):
        assert (out / rel).is_file(), rel
    assert json.loads((out / "summary.json").read_text())[2]["name"] == "student after KD"
    assert "student after KD" in summary_table(rows)
