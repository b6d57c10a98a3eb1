"""One run per output folder for `quantize` and `eval`: a rerun of the same result writes again (quantize keeps
the same quantization's other exports and lists them); another source, retrained weights, another scheme or other
eval settings are refused in one line before anything loads, folder untouched; `overwrite=true` replaces the
earlier outputs, and puts them back when the new run fails. Messages come from docs/reliability.md."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import recipes_common as rc
import reliability_doc as doc

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.folders import LOCK_NAME

run, one_error = rc.run_captured, rc.one_error


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != LOCK_NAME}


def quantize(capsys, model: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    return run(capsys, "quantize", "quantize/smollm2_8da4w",
               [f"model.checkpoint_dir={model}", f"output_dir={out}", "perplexity.limit=2",
                "perplexity.max_seq_len=32", "device=cpu", *extra])


def test_quantize_keeps_one_quantization_per_folder(tmp_path, tiny_copy, capsys, monkeypatch):
    out = tmp_path / "q"
    code, _, err = quantize(capsys, tiny_copy, out, "scheme=8da4w", "formats=[gguf]")
    assert code == 0, err
    # the same quantization again, another format and GGUF type, from another working directory (paths spelled
    # relative to it): written, and the earlier export kept and listed
    monkeypatch.chdir(tmp_path)
    code, stdout, err = quantize(capsys, tiny_copy, Path("q"), "scheme=8da4w", "formats=[hf,gguf]", "gguf_qtype=Q8_0")
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["exports"]) == ["gguf", "hf"] and report["exports"]["gguf"]["qtype"] == "Q8_0"
    assert list(report["earlier_exports"]) == ["gguf:model-Q4_0.gguf"]
    assert report["earlier_exports"]["gguf:model-Q4_0.gguf"]["path"] == "q/model-Q4_0.gguf"
    assert "q/model-Q4_0.gguf (an earlier run of this quantization)" in stdout
    assert report["recipe_run"]["scheme"] == "8da4w"
    assert report["recipe_run"]["model.checkpoint_dir"] == str(tiny_copy.resolve())
    # and once more with absolute paths, one format: what it wrote is not also listed as earlier
    code, stdout, err = quantize(capsys, tiny_copy, out, "scheme=8da4w", "formats=[gguf]", "gguf_qtype=Q8_0")
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["earlier_exports"]) == ["gguf:model-Q4_0.gguf", "hf"] and list(report["exports"]) == ["gguf"]
    assert stdout.count("model-Q8_0.gguf") == 1  # its export line, not also a "kept" one

    # another scheme into that folder: one line naming the difference, nothing changed
    before = snapshot(out)
    code, stdout, err = quantize(capsys, tiny_copy, out, "scheme=int8_weight_only", "formats=[gguf]")
    assert code == 1 and "quantize: weights" not in stdout
    line = one_error(err)
    doc.expect("rerun-other-result", line, out=out)
    assert 'scheme: "8da4w" then, "int8_weight_only" now' in line and "hf/" in line
    assert "group_size" not in line  # 8da4w's groups follow from its scheme: not a second change to name
    assert snapshot(out) == before

    # the same config after the source was retrained in place (a weight file rewritten): refused too
    weights = next(tiny_copy.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    code, _, err = quantize(capsys, tiny_copy, out, "scheme=8da4w", "formats=[gguf]")
    assert code == 1
    assert f"the weights in {tiny_copy.resolve()} changed since ({weights.name}: rewritten, same size)" in one_error(err)
    assert snapshot(out) == before
    # a file of another size: named alone (config.json is part of what the exports are computed from)
    config = tiny_copy / "config.json"
    config.write_text(config.read_text() + "\n")
    code, _, err = quantize(capsys, tiny_copy, out, "scheme=8da4w", "formats=[gguf]")
    assert code == 1
    assert (f"the weights in {tiny_copy.resolve()} changed since (config.json, {weights.name})"
            in one_error(err)), one_error(err)
    assert snapshot(out) == before

    # overwrite=true that fails during its run (an export error): the earlier outputs come back as they were
    from llm_recipe.recipes import quantize as recipe

    def broken_export(*a, **k):
        (out / "model-Q8_0.gguf").write_bytes(b"half a file")  # what the failed run wrote under an earlier name
        raise RecipeError("gguf export failed")

    monkeypatch.setattr(recipe, "export_gguf", broken_export)
    code, stdout, err = quantize(capsys, tiny_copy, out, "scheme=int8_weight_only", "formats=[gguf]",
                                 "overwrite=true")
    assert code == 1 and "the outputs overwrite=true set aside are back as they were" in stdout
    assert snapshot(out) == before and not [p for p in out.iterdir() if ".del-" in p.name]
    monkeypatch.undo()

    # overwrite=true: only the new run's exports are left, and its report lists nothing earlier
    code, _, err = quantize(capsys, tiny_copy, out, "scheme=int8_weight_only", "formats=[gguf]", "overwrite=true")
    assert code == 0, err
    # group_size means nothing to int8_weight_only (one scale per row): the same quantization
    code, _, err = quantize(capsys, tiny_copy, out, "scheme=int8_weight_only", "formats=[gguf]", "group_size=64")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK_NAME) == [".quantize_run.json", "model-Q8_0.gguf",
                                                                             "report.json"]
    report = json.loads((out / "report.json").read_text())
    assert report["scheme"] == "int8_weight_only" and "earlier_exports" not in report


def test_quantize_refuses_exports_without_a_record(tmp_path, tiny_model_dir, capsys):
    """Exports with no report.json (a run killed before it wrote one, or an older version's folder) are of an
    unknown run: refused, and overwrite=true replaces them."""
    out = tmp_path / "q"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text("{}")
    code, _, err = quantize(capsys, tiny_model_dir, out, "formats=[gguf]")
    assert code == 1
    doc.expect("rerun-unknown-outputs", one_error(err), out=out, held="quantize exports", names="hf/",
               recipe="quantize")
    code, _, err = quantize(capsys, tiny_model_dir, out, "formats=[gguf]", "overwrite=true")
    assert code == 0, err
    assert not (out / "hf").exists() and (out / "model-Q4_0.gguf").is_file()


def test_eval_keeps_one_evaluation_per_folder(tmp_path, tiny_model_dir, tiny_copy, capsys, monkeypatch):
    out = tmp_path / "e"
    base = [f"model.checkpoint_dir={tiny_model_dir}", "tasks=[recipe_piqa]", "device=cpu", "batch_size=4",
            f"output_dir={out}"]
    code, printed, err = run(capsys, "eval", "eval/smollm2", [*base, "limit=2"])
    assert code == 0, err
    assert printed.startswith(f"eval: {tiny_model_dir} on recipe_piqa (2 items per task)\n")  # said first
    results = json.loads((out / "results.json").read_text())
    assert "recipe_piqa" in results["results"] and results["recipe_run"]["limit"] == 2
    before = snapshot(out)

    from llm_recipe.recipes import eval as recipe

    evaluated = []
    monkeypatch.setattr(recipe, "evaluate", lambda *a, **k: evaluated.append(k) or {})
    code, _, err = run(capsys, "eval", "eval/smollm2", [*base, "limit=3"])  # other settings: refused, untouched
    assert code == 1 and evaluated == []
    line = one_error(err)
    doc.expect("rerun-other-result", line, out=out)
    assert "holds eval results of another run (results.json): limit: 2 then, 3 now;" in line
    assert snapshot(out) == before
    other = [*base[1:], f"model.checkpoint_dir={tiny_copy}", "limit=2"]  # another model: named by its key
    code, _, err = run(capsys, "eval", "eval/smollm2", other)
    assert code == 1 and evaluated == []
    assert (f'model.checkpoint_dir: "{tiny_model_dir.resolve()}" then, "{tiny_copy.resolve()}" now; '
            "overwrite=true replaces them") in one_error(err)
    code, _, err = run(capsys, "eval", "eval/smollm2", [*base, "limit=2"])  # the same eval again: allowed
    assert code == 0 and len(evaluated) == 1, err
    code, _, err = run(capsys, "eval", "eval/smollm2", [*base, "limit=2", "dtype=fp32"])  # fp32 is float32
    assert code == 0 and len(evaluated) == 2, err

    def failing(*a, **k):
        raise RuntimeError("lm-eval failed")

    monkeypatch.setattr(recipe, "evaluate", failing)
    with pytest.raises(RuntimeError):  # overwrite=true whose eval fails: the earlier results come back
        recipe.main(recipe.CONFIG(model=recipe.ModelSection(checkpoint_dir=str(tiny_model_dir)),
                                  tasks=("recipe_piqa",), limit=3, output_dir=str(out), overwrite=True))
    assert snapshot(out) == before and not [p for p in out.iterdir() if ".del-" in p.name]


KILL_AT = Path(__file__).parent / "fixtures" / "kill_at.py"


def test_a_killed_overwrite_is_put_back_by_the_next_run(tmp_path, tiny_model_dir, capsys):
    """kill -9 during an overwrite=true quantize (here at its GGUF export, after it set the earlier exports aside and
    wrote its hf/): the next run in the folder puts the earlier exports back, says so, and then checks against them."""
    out = tmp_path / "q"
    assert quantize(capsys, tiny_model_dir, out, "formats=[hf,gguf]")[0] == 0
    before = snapshot(out)
    args = [f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={out}", "perplexity.limit=2",
            "perplexity.max_seq_len=32", "device=cpu", "scheme=int8_weight_only", "formats=[hf,gguf]"]
    fault = {"target": "llm_recipe.recipes.quantize.export_gguf", "action": "kill"}
    p = subprocess.run([sys.executable, str(KILL_AT), json.dumps(fault),
                        *rc.run_args("quantize", "quantize/smollm2_8da4w", [*args, "overwrite=true"])],
                       cwd=tmp_path, env=rc.cli_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert [p.name for p in out.iterdir() if p.name.startswith(".replaced.del-")]  # the earlier run, set aside
    code, stdout, err = quantize(capsys, tiny_model_dir, out, "scheme=int8_weight_only", "formats=[hf,gguf]")
    assert code == 1 and 'scheme: "8da4w" then, "int8_weight_only" now' in one_error(err)
    assert "a run with overwrite=true was stopped before it finished: the outputs it was replacing are back" in stdout
    assert snapshot(out) == before and not [p for p in out.iterdir() if ".del-" in p.name]


def test_an_interrupted_eval_continues_from_its_answers(tmp_path, tiny_model_dir, tiny_copy, capsys):
    """Ctrl-C, then kill -9, in the middle of an evaluation: the same command again reuses the answers kept in
    output_dir, scores only the rest, and writes the uninterrupted evaluation's results; the answers file goes once
    results.json is written, and another evaluation (another model) reuses none of them."""
    from llm_recipe.components.eval.answers import ANSWERS_DIR

    args = ["tasks=[recipe_piqa]", "device=cpu", "batch_size=2", "limit=6", "log_samples=true"]
    ref, out = tmp_path / "ref", tmp_path / "e"
    assert run(capsys, "eval", "eval/smollm2", [*args, f"model.checkpoint_dir={tiny_model_dir}",
                                                f"output_dir={ref}"])[0] == 0
    mine = [*args, f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={out}"]

    def faulted(action: str, nth: int) -> subprocess.CompletedProcess:
        fault = {"target": "llm_recipe.components.eval.answers.AnswerLog.add", "nth": nth, "action": action}
        return subprocess.run([sys.executable, str(KILL_AT), json.dumps(fault),
                               *rc.run_args("eval", "eval/smollm2", mine)],
                              cwd=tmp_path, env=rc.cli_env(), capture_output=True, text=True, timeout=600)

    p = faulted("sigint", 3)  # Ctrl-C: exit 130, and the line says the same command continues
    assert p.returncode == 130, p.stderr[-2000:]
    said = [ln for ln in p.stderr.splitlines() if ln.startswith("recipe:")]  # (lm-eval's bar is redrawn after it)
    assert said == [f"recipe: interrupted; the answers so far are kept in {out / ANSWERS_DIR}: the same command "
                    "continues the evaluation"], p.stderr[-2000:]
    (kept,) = (out / ANSWERS_DIR).iterdir()
    first = len(kept.read_text().splitlines())
    assert 2 <= first <= 3
    p = faulted("kill", 4)  # kill -9 at the 4th new answer: 3 more kept
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert not (out / "results.json").exists()
    assert len(kept.read_text().splitlines()) == first + 3

    from llm_recipe.components.eval import lm as eval_lm

    scored = []
    original = eval_lm.RecipeLM.loglikelihood
    eval_lm.RecipeLM.loglikelihood = lambda self, requests, *a, **k: (scored.append(len(requests)),
                                                                       original(self, requests, *a, **k))[1]
    try:
        code, stdout, err = run(capsys, "eval", "eval/smollm2", mine)
    finally:
        eval_lm.RecipeLM.loglikelihood = original
    assert code == 0, err
    assert (f"eval: continuing an interrupted run of this evaluation: {first + 3} answers kept in {out / ANSWERS_DIR}"
            in stdout)
    assert scored == [12 - first - 3]  # piqa: 2 choices per item, 6 items; only the rest were scored
    got, want = (json.loads((d / "results.json").read_text()) for d in (out, ref))
    assert got["results"] == want["results"]
    # each answer as the uninterrupted run's, up to fp32 rounding: the rest are batched differently (padding)
    lls = [ll for s in got["samples"]["recipe_piqa"] for resp in s["resps"] for ll, _ in resp]
    want_lls = [ll for s in want["samples"]["recipe_piqa"] for resp in s["resps"] for ll, _ in resp]
    assert lls == pytest.approx(want_lls, rel=1e-6)
    assert not (out / ANSWERS_DIR).exists()
