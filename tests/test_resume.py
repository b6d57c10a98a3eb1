"""Resume after a hard crash, for every training recipe: a run killed with SIGKILL after its first checkpoint
and resumed with `resume=true` ends with bit-identical weights, the same logged losses and no duplicated
metrics lines; plus the errors around resuming (no checkpoint, a NaN loss keeps the last good checkpoint).

The killed run is a real `recipe run` subprocess; the reference and resumed runs call the same CLI entry
point in-process with one thread (bit-identical to the subprocess, which also runs with OMP_NUM_THREADS=1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import recipes_common as rc
import torch
from safetensors.torch import load_file

STEPS = 6
LORA = ["lora.rank=4", "lora.alpha=8.0"]


def recipe_case(recipe: str, model: Path) -> tuple[str, list[str]]:
    """(config, overrides) of a 6-step run that crosses epoch boundaries (5 chat rows: 3 batches per epoch,
    2 per optimizer step) and, for QAT, the fake-quantization switch at step 3."""
    train = [*rc.COMMON, f"max_steps={STEPS}", "gradient_accumulation_steps=2", "optimizer.lr=1e-3",
             "lr_scheduler.name=cosine", "lr_scheduler.warmup_steps=2"]
    if recipe == "full":
        return "full/smollm2", [*train, f"model.checkpoint_dir={model}"]
    if recipe == "lora":
        return "lora/smollm2", [*train, f"model.checkpoint_dir={model}", *LORA]
    if recipe == "qat":
        return "qat/smollm2", [*train, f"model.checkpoint_dir={model}", "qat.fake_quant_after_n_steps=3",
                               "qat.convert=false"]
    # kd: a 2-layer student pruned from the teacher, on packed passages (block-causal masks, input_pos).
    return "kd/smollm2_demo", [*rc.KD_COMMON, f"max_steps={STEPS}", "gradient_accumulation_steps=2",
                               "optimizer.lr=1e-3", f"teacher.checkpoint_dir={model}", "student.keep_layers=[0,3]",
                               "dataset.limit=4"]


@pytest.mark.parametrize("recipe, optimizer", [
    ("full", None), ("lora", None), ("kd", None), ("qat", None),
    # torchao's quantized optimizer states (tensor subclasses) through the recipe state; compiled step: slow.
    pytest.param("full", "torchao.optim.AdamW8bit", marks=pytest.mark.slow),
    pytest.param("kd", "torchao.optim.AdamW4bit", marks=pytest.mark.slow),
])
def test_resume_after_sigkill_is_bit_identical(tmp_path, tiny_model_dir, recipe, optimizer, capsys):
    config, overrides = recipe_case(recipe, tiny_model_dir)
    if optimizer is not None:
        overrides.append(f"optimizer._component_={optimizer}")
    ref, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"
    assert rc.run_in_process(recipe, config, [*overrides, f"output_dir={ref}"]) == 0

    ckpt_overrides = [*overrides, f"output_dir={crashed}", "save_every_n_steps=1", "keep_last_n=2"]
    killed_at = rc.run_and_kill(recipe, config, ckpt_overrides, crashed, cwd=tmp_path)
    assert 1 <= killed_at < STEPS
    capsys.readouterr()
    assert rc.run_in_process(recipe, config, [*ckpt_overrides, "resume=true"]) == 0
    first = [ln for ln in capsys.readouterr().out.splitlines() if "first optimizer step done" in ln]
    assert len(first) == 1 and f", step {killed_at + 1} " in first[0]  # the resumed process's first step

    rc.assert_same_weights(crashed / "model", ref / "model")
    if optimizer is not None:  # the resumed optimizer state really held quantized moments
        assert '"__subclass__": "torchao.optim.' in (rc.complete_checkpoints(crashed)[-1] / "recipe_state" / "state.json").read_text()
    if recipe == "lora":
        a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (crashed, ref))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed, uninterrupted = rc.read_metrics(crashed), rc.read_metrics(ref)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # no duplicated (re-run) steps
    loss_keys = [k for k in uninterrupted[0] if k.endswith("loss")]
    assert [[r[k] for k in loss_keys] for r in resumed] == [[r[k] for k in loss_keys] for r in uninterrupted]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in uninterrupted]


def test_extending_a_finished_run_continues_with_the_next_batches(tmp_path, tiny_model_dir, capsys):
    """A finished 3-step run resumed with max_steps=6 trains steps 4-6 on the micro-batches an uninterrupted 6-step
    run saw there (constant lr, so the schedule does not depend on max_steps): the same losses and weights. The
    loop used to take one more window from the loader after the last step, so the extension skipped it. Resumed
    with the same max_steps first, the finished run says that nothing is left and leaves its checkpoint as it was."""
    config, overrides = recipe_case("full", tiny_model_dir)
    overrides = [o for o in overrides if not o.startswith(("max_steps=", "lr_scheduler."))]
    overrides += ["lr_scheduler.name=constant", "lr_scheduler.warmup_steps=0"]
    ref, extended = tmp_path / "six", tmp_path / "three_then_six"
    assert rc.run_in_process("full", config, [*overrides, "max_steps=6", f"output_dir={ref}"]) == 0
    assert rc.run_in_process("full", config, [*overrides, "max_steps=3", f"output_dir={extended}"]) == 0
    (last,) = rc.complete_checkpoints(extended)
    written = {p: p.stat().st_mtime_ns for p in last.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert rc.run_in_process("full", config, [*overrides, "max_steps=3", f"output_dir={extended}",
                                              "resume=true"]) == 0
    out = capsys.readouterr().out
    assert f"resume: {last.name} is step 3 of 3, the run's last: nothing left to train" in out
    assert {p: p.stat().st_mtime_ns for p in last.rglob("*") if p.is_file()} == written
    assert [r["step"] for r in rc.read_metrics(extended)] == [1, 2, 3]
    assert rc.run_in_process("full", config, [*overrides, "max_steps=6", f"output_dir={extended}",
                                              "resume=true"]) == 0
    assert [r["loss"] for r in rc.read_metrics(extended)] == [r["loss"] for r in rc.read_metrics(ref)]
    rc.assert_same_weights(extended / "model", ref / "model")
    # a shorter max_steps than the run has trained is refused before anything loads: run.json and the final model
    # stay the 6-step run's (it used to rewrite the step-6 model as a "4-step" run's final one, run.json saying 4)
    run_json = (extended / "run.json").read_text()
    model = {p: p.stat().st_mtime_ns for p in (extended / "model").rglob("*") if p.is_file()}
    proc = rc.run_cli("full", config, [*overrides, "max_steps=4", f"output_dir={extended}", "resume=true"],
                      cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    (line,) = rc.error_lines(proc)
    assert "override 'max_steps=4': key 'max_steps': 4 is fewer than the 6 steps" in line, line
    assert "step_000006" in line and "max_steps >= 6" in line, line
    assert (extended / "run.json").read_text() == run_json
    assert {p: p.stat().st_mtime_ns for p in (extended / "model").rglob("*") if p.is_file()} == model


def test_resume_without_checkpoint_is_one_line_error(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    proc = rc.run_cli("full", "full/smollm2", [*rc.COMMON, f"model.checkpoint_dir={tiny_model_dir}",
                                               f"output_dir={out}", "resume=true"], cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    assert "resume=true" in line and f"{out}/checkpoints" in line and "no complete checkpoint" in line
    assert not (out / "metrics.jsonl").exists()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model_dir):
    # lr 1e30: step 1's loss is finite, its update blows the weights up, step 2's loss is not finite.
    out = tmp_path / "out"
    proc = rc.run_cli("full", "full/smollm2", [*rc.COMMON, f"model.checkpoint_dir={tiny_model_dir}",
                                               f"output_dir={out}", "max_steps=4", "save_every_n_steps=1",
                                               "optimizer.lr=1e30", "lr_scheduler.name=constant"], cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    last_good = out / "checkpoints" / "step_000001"
    assert "at step 2" in line and str(last_good) in line, line
    assert [p.name for p in rc.complete_checkpoints(out)] == ["step_000001"]
    assert all(torch.isfinite(t).all() for t in rc.weights(last_good).values())
    assert not (out / "model").exists()
    assert [r["step"] for r in rc.read_metrics(out)] == [1]
    rc.assert_png(out / "loss.png")  # drawn from the good steps, to look at what went wrong
