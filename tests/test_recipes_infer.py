"""The eval, quantize and generate recipes through the real CLI on the embedded model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def test_generate_answers_the_capital_of_france(tmp_path, embedded_model_dir):
    r = _run("generate", "--config", "generate/smollm2", "prompt=What is the capital of France?",
             "max_new_tokens=24", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tokens/s" in r.stderr and "note:" not in r.stderr
    # the raw prompt without the chat template: SmolLM2-Instruct ends at once; said, not an empty line alone
    r = _run("generate", "--config", "generate/smollm2", "prompt=What is the capital of France?", "chat=false",
             "max_new_tokens=8", cwd=tmp_path)
    assert r.returncode == 0 and not r.stdout.strip()
    assert ("note: the model ended its answer with a stop token (id 2) before any text (chat=false: an instruct "
            "model sees the raw prompt, not the chat template it was trained on)") in r.stderr
    # more new tokens than the model's context holds: one line naming the key and the most it can be, no allocation
    r = _run("generate", "--config", "generate/smollm2", "prompt=Hi", "max_new_tokens=100000000", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "recipe: error: max_new_tokens=100000000: the prompt (" in r.stderr and "set max_new_tokens <=" in r.stderr


def test_eval_recipe_writes_lm_eval_results(tmp_path, embedded_model_dir):
    out = tmp_path / "eval"
    r = _run("eval", "--config", "eval/smollm2", "tasks=[recipe_arc_easy]", "limit=4", f"output_dir={out}",
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "results.json").read_text())
    acc = results["results"]["recipe_arc_easy"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert "recipe_arc_easy" in r.stdout  # lm-eval's table


def test_quantize_recipe_reports_and_exports_loadable_files(tmp_path, embedded_model_dir):
    gguf = pytest.importorskip("gguf")
    out = tmp_path / "q"
    r = _run("quantize", "--config", "quantize/smollm2_8da4w", f"output_dir={out}", "perplexity.limit=4",
             "perplexity.max_seq_len=64", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    # 8da4w costs some perplexity but must not destroy the model.
    assert report["perplexity_before"] < report["perplexity_after"] < 3 * report["perplexity_before"]
    assert report["exports"]["gguf"]["size_bytes"] < report["exports"]["hf"]["size_bytes"] < report["size_before_bytes"]
    reader = gguf.GGUFReader(str(out / "model-Q4_0.gguf"))
    assert "tokenizer.chat_template" in reader.fields
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert "perplexity" in r.stdout and "MiB" in r.stdout


def test_quantize_rejects_a_scheme_the_qat_run_did_not_train_for(tmp_path, embedded_model_dir):
    qat_out = tmp_path / "fake_qat"
    qat_out.mkdir()
    (qat_out / "quantization.json").write_text(json.dumps({"method": "qat", "scheme": "8da4w", "group_size": 64}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (qat_out / name).write_bytes((embedded_model_dir / name).read_bytes())
    r = _run("quantize", "--config", "quantize/smollm2_8da4w", f"model.checkpoint_dir={qat_out}",
             f"output_dir={tmp_path / 'q'}", cwd=tmp_path)
    assert r.returncode == 1
    assert "trained for 8da4w group_size 64" in r.stderr and "Traceback" not in r.stderr
