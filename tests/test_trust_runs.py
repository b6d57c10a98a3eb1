"""Trust: a new run never mixes with an earlier run in the same output_dir, and running out of memory is one line.

Runs and output folders: a new run (resume=false) into a folder holding another run's trained outputs is refused
(one line naming the folder and what it holds, and the ways on); `overwrite=true` deletes them first; every run
has an id (output_dir/run.json) recorded in its checkpoints, and resume=true continues only that run; an
overwrite=true run that fails during setup puts the earlier run back.

Out of memory: an allocation failure in a training step or during setup is `recipe: error: out of memory ...`
(where, the micro-batch shape, peak memory, what to change), exit 1, with the last good checkpoint kept and
metrics.jsonl holding only completed steps. The failure is injected in this process by monkeypatching the loss
(or the model loader) to raise what torch raises; the product code has no test hooks.
The expected messages come from docs/reliability.md (tests/fixtures/reliability_doc.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import recipes_common as rc
import reliability_doc as doc
import torch

CONFIG = "full/smollm2"


def args(model: Path, out: Path, *extra: str) -> list[str]:
    return [*rc.COMMON, f"model.checkpoint_dir={model}", f"output_dir={out}", "save_every_n_steps=1", *extra]


def run(capsys, overrides: list[str], recipe: str = "full", config: str = CONFIG) -> tuple[int, str, str]:
    return rc.run_captured(capsys, recipe, config, overrides)


one_error = rc.one_error


def run_id(out: Path) -> str:
    return json.loads((out / "run.json").read_text())["run_id"]


def checkpoint_run_ids(out: Path) -> list[str]:
    return [json.loads((p / "recipe_state" / "state.json").read_text())["state"]["run_id"]
            for p in rc.complete_checkpoints(out)]


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------ runs and output folders


def test_a_new_run_never_mixes_with_an_earlier_run(tmp_path, tiny_model_dir, capsys):
    """The issue's sequence: 3 steps, then a new 2-step run into the same folder, then resume=true to step 4."""
    out = tmp_path / "out"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=3"))[0] == 0
    first = run_id(out)
    assert checkpoint_run_ids(out) == [first] * 3
    before = snapshot(out)

    # a new run without resume is refused before anything loads or changes
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=2"))
    assert code == 1
    line = doc.expect("output-holds-run", one_error(err), out=out)
    for what in (first, "checkpoints/step_000003", "model/", "metrics.jsonl with steps 1-3"):
        assert what in line, line
    assert snapshot(out) == before

    # overwrite=true deletes the earlier run's outputs first: nothing of it can be resumed into or mixed (an
    # on-policy run's held-out score and wandb's folder included); files we do not write stay
    (out / "on_policy_eval.json").write_text("{}")
    (out / "wandb").mkdir()
    (out / "notes.txt").write_text("mine")
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=2", "overwrite=true"))
    assert code == 0, err
    (said,) = [ln for ln in stdout.splitlines() if ln.startswith("overwrite=true: deleted the earlier run's ")]
    assert all(name in said for name in ("checkpoints", "model", "metrics.jsonl", "run.json", "on_policy_eval.json",
                                         "wandb")) and str(out) in said
    assert not (out / "on_policy_eval.json").exists() and not (out / "wandb").exists()
    assert (out / "notes.txt").read_text() == "mine"
    second = run_id(out)
    assert second != first
    assert [p.name for p in rc.complete_checkpoints(out)] == ["step_000001", "step_000002"]
    assert checkpoint_run_ids(out) == [second] * 2
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2]

    # resume continues the second run (its newest checkpoint, not the first run's higher step 3), same run id
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=4", "resume=true"))
    assert code == 0, err
    assert f"resuming from {out}/checkpoints/step_000002" in stdout
    assert run_id(out) == second and set(checkpoint_run_ids(out)) == {second}
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2, 3, 4]  # one run, no step twice


def test_overwrite_keeps_the_earlier_run_when_the_new_one_fails_during_setup(tmp_path, tiny_model_dir, capsys):
    """overwrite=true with a mistake found during setup (here a dataset file with a broken line, found after the
    weights load) leaves the earlier run exactly as it was; a run whose setup passes deletes it, leaving nothing
    hidden behind."""
    out = tmp_path / "out"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=2"))[0] == 0
    before, first = snapshot(out), run_id(out)
    bad = tmp_path / "bad.jsonl"  # there (the early file check passes) but unreadable: found when the data loads
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=2", "overwrite=true", f"dataset.source={bad}"))
    assert code == 1 and "bad.jsonl" in one_error(err)
    assert f"the earlier run in {out} was put back" in err
    assert snapshot(out) == before and run_id(out) == first
    assert not list(out.glob(".overwritten*"))
    assert run(capsys, args(tiny_model_dir, out, "max_steps=1", "overwrite=true"))[0] == 0
    assert run_id(out) != first and [r["step"] for r in rc.read_metrics(out)] == [1]
    assert not list(out.glob(".overwritten*"))


def test_an_overwrite_killed_during_setup_gives_the_earlier_run_back_to_the_next_run(tmp_path, tiny_model_dir,
                                                                                     capsys):
    """kill -9 (or the kernel's out-of-memory killer) during an overwrite=true run's setup leaves the earlier run set
    aside: the next run in the folder puts it back first, so resume=true continues it (it said "no complete
    checkpoint", and a plain new run then deleted the hidden earlier run)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=2"))[0] == 0
    before, first = snapshot(out), run_id(out)
    kill = {"target": "llm_recipe.components.training.build_train_loader", "nth": 1, "action": "kill"}
    p = subprocess.run([sys.executable, str(Path(__file__).parent / "fixtures" / "kill_at.py"), json.dumps(kill),
                        *rc.run_args("full", CONFIG, args(tiny_model_dir, out, "max_steps=2", "overwrite=true"))],
                       cwd=tmp_path, env=rc.cli_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == -9, p.stderr[-3000:]
    assert list(out.glob(".overwritten*")) and run_id(out) != first  # the killed run's run.json, the earlier aside

    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true"))
    assert code == 0, err
    assert f"note: {out}: a run with overwrite=true was stopped during its setup: the earlier run it was replacing " \
           "is back" in stdout
    assert f"resuming from {out}/checkpoints/step_000002" in stdout and run_id(out) == first
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2, 3] and not list(out.glob(".overwritten*"))
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoints/step_000001")} == \
        {k: v for k, v in before.items() if k.startswith("checkpoints/step_000001")}


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, tiny_model_dir, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert run(capsys, args(tiny_model_dir, out, "max_steps=2"))[0] == 0
    # a checkpoint of run a copied into b, under a higher step than b's own: resume must not pick it up
    foreign = b / "checkpoints" / "step_000009"
    shutil.copytree(a / "checkpoints" / "step_000002", foreign)
    code, stdout, err = run(capsys, args(tiny_model_dir, b, "max_steps=12", "resume=true"))
    assert code == 1
    doc.expect("run-id-mismatch", one_error(err), ckpt=foreign, a=run_id(a), b=run_id(b), out=b)
    assert "resuming from" not in stdout
    assert [r["step"] for r in rc.read_metrics(b)] == [1, 2]


def test_resume_with_other_values_is_refused_unless_accepted(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """A resume whose values differ from the run's start in keys that change what it computes (a learning rate, the
    data: e.g. an override forgotten on the resume command) is refused before anything loads, naming each key and
    both values; keys that only change where, how often or how fast it writes pass and are said;
    resume_with_changes=true continues with the new values and run.json records them."""
    out = tmp_path / "out"
    constant = "lr_scheduler.name=constant"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=2", "optimizer.lr=2e-4", constant))[0] == 0
    before = snapshot(out)
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=4", "resume=true", "dataset.limit=10",
                                         constant))
    assert code == 1
    doc.expect("resume-changed-values", one_error(err), out=out,
               changes="dataset.limit: 12 -> 10, optimizer.lr: 0.0002 -> 2e-05")
    assert "resuming from" not in stdout and snapshot(out) == before
    # under torchrun the launcher refuses it once, before any worker starts
    from llm_recipe.cli import main as cli

    monkeypatch.setattr(cli, "launch_torchrun", lambda *a: pytest.fail("torchrun was launched"))
    capsys.readouterr()
    code = cli.main(["run", "--nproc-per-node", "2", "full", "--config", CONFIG,
                     *args(tiny_model_dir, out, "max_steps=4", "resume=true", "dataset.limit=10", constant)])
    assert code == 1
    doc.expect("resume-changed-values", one_error(capsys.readouterr().err), out=out,
               changes="dataset.limit: 12 -> 10, optimizer.lr: 0.0002 -> 2e-05")

    # the same command with the values put back: only max_steps and the save cadence changed, and it says so
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true", "optimizer.lr=2e-4",
                                         "save_every_n_steps=2", constant))
    assert code == 0, err
    assert "resuming with changed values: max_steps: 2 -> 3, save_every_n_steps: 1 -> 2" in stdout
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2, 3]

    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=4", "resume=true",
                                         "resume_with_changes=true", "save_every_n_steps=2", constant))
    assert code == 0, err
    assert "resuming with changed values: max_steps: 3 -> 4, optimizer.lr: 0.0002 -> 2e-05" in stdout
    assert [r["lr"] for r in rc.read_metrics(out)][-1] == pytest.approx(2e-5)
    record = json.loads((out / "run.json").read_text())
    assert record["values"]["optimizer.lr"] == 2e-5  # the next resume compares with the values it now runs with
    assert record["resumed_with_changes"][-1]["from"] == "step_000003"
    assert record["resumed_with_changes"][-1]["changes"]["optimizer.lr"] == [2e-4, 2e-5]


def test_resume_on_changed_data_files_is_refused_unless_accepted(tmp_path, tiny_model_dir, capsys):
    """The data file edited between a run and its resume (rows added, removed or rewritten) made the checkpoint's
    data position count other rows, and the resume said nothing: run.json now fingerprints each local data file
    (its bytes), so a changed file is refused before anything loads, naming it; the same bytes written again pass;
    resume_with_changes=true continues and records the change."""
    out, rows = tmp_path / "out", tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"text": "row {i} of the first file"}}\n' for i in range(8)))
    data = [f"dataset.source={rows}", "dataset.format=text", "lr_scheduler.name=constant"]
    assert run(capsys, args(tiny_model_dir, out, "max_steps=1", *data))[0] == 0
    assert list(json.loads((out / "run.json").read_text())["data_files"]) == [str(rows.resolve())]
    rows.write_text(rows.read_text())  # the same bytes again (a new modification time): the same data
    assert run(capsys, args(tiny_model_dir, out, "max_steps=2", "resume=true", *data))[0] == 0
    rows.write_text(rows.read_text().replace("first", "second"))
    before = snapshot(out)
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true", *data))
    assert code == 1 and "resuming from" not in stdout and snapshot(out) == before
    assert one_error(err) == (f"recipe: error: resume=true, but the data files changed since the run in {out} started "
                              f"({out}/run.json): {rows.resolve()} (other contents); the checkpoint's data position "
                              "counts rows of the data it trained on: put the files back, or add "
                              "resume_with_changes=true to continue on the new rows from that position (or start a "
                              "new run: overwrite=true or another output_dir)")
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true", "resume_with_changes=true",
                                         *data))
    assert code == 0, err
    assert f"resuming with changed data files: {rows.resolve()} (other contents)" in stdout
    record = json.loads((out / "run.json").read_text())
    assert record["resumed_with_changes"][-1]["data_files"] == [f"{rows.resolve()} (other contents)"]
    assert run(capsys, args(tiny_model_dir, out, "max_steps=4", "resume=true", *data))[0] == 0  # the new data now


def test_a_folder_source_fingerprints_its_data_not_its_hidden_folders(tmp_path):
    """A data folder that is a git (or `hf download`) checkout: `git status` rewrites .git/index, which is not data
    and must not stop a resume."""
    from llm_recipe.components.data.dataset import DatasetConfig
    from llm_recipe.components.data.identity import data_changes, data_identity
    @dataclass
    class Sections:  # data_identity reads every DatasetConfig of a typed config
        dataset: DatasetConfig

    (tmp_path / "ds" / ".git").mkdir(parents=True)
    (tmp_path / "ds" / "train.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "ds" / ".git" / "index").write_bytes(b"1")
    cfg = Sections(DatasetConfig(source=str(tmp_path / "ds")))
    before = data_identity(cfg)
    assert list(before) == [str((tmp_path / "ds" / "train.jsonl").resolve())]
    (tmp_path / "ds" / ".git" / "index").write_bytes(b"22")
    assert data_changes(before, data_identity(cfg)) == []
    (tmp_path / "ds" / "train.jsonl").write_text('{"text": "b"}\n')
    assert data_changes(before, data_identity(cfg)) == [f"{(tmp_path / 'ds' / 'train.jsonl').resolve()} (other contents)"]


def test_a_resume_that_cannot_load_changes_nothing(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """A resume whose checkpoint could not fit is refused in one line and leaves the run as it was, run.json
    included, so the unchanged command still resumes it: a changed LoRA rank (even with resume_with_changes=true),
    a run of another recipe, and a checkpoint that fails to load for any other reason (after setup accepted the
    changed values: run.json records them only once the checkpoint has loaded)."""
    out = tmp_path / "lora"
    lora = ["lora.rank=8", "lora.alpha=16"]
    assert run(capsys, args(tiny_model_dir, out, "max_steps=2", *lora), "lora", "lora/smollm2")[0] == 0
    record = json.loads((out / "run.json").read_text())
    assert (record["recipe"], record["command"]) == ("full", "lora")  # `recipe run lora` is full.py's loop
    before = snapshot(out)
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true", "resume_with_changes=true",
                                         "lora.rank=4", "lora.alpha=16"), "lora", "lora/smollm2")
    assert code == 1
    doc.expect("resume-shape-changed", one_error(err), out=out, changes="lora.rank: 8 -> 4")
    assert snapshot(out) == before

    code, _, err = run(capsys, [*rc.KD_COMMON, f"teacher.checkpoint_dir={tiny_model_dir}", "student.keep_layers=[0,1]",
                                f"output_dir={out}", "max_steps=3", "resume=true"], "kd", "kd/smollm2_demo")
    assert code == 1
    doc.expect("resume-other-recipe", one_error(err), out=out, recipe="lora", own="kd")
    assert snapshot(out) == before
    # the same loop (full.py) without the lora section: another command, said as such (it listed lora.* changes)
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true"), "full", "full/smollm2")
    assert code == 1
    doc.expect("resume-other-recipe", one_error(err), out=out, recipe="lora", own="full")
    assert snapshot(out) == before
    # a new run there: the refusal offers the command that can resume it (plain resume=true is refused, above)
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=3"), "full", "full/smollm2")
    assert code == 1 and ": `recipe run lora ... resume=true` continues it; overwrite=true deletes" in one_error(err)
    assert snapshot(out) == before

    from llm_recipe.components.runtime import Runtime

    def no_fit(*a, **k):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
    monkeypatch.setattr(Runtime, "load_optimizer_state_dict", no_fit)
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true", "resume_with_changes=true",
                                         "optimizer.lr=1e-5", *lora), "lora", "lora/smollm2")
    assert code == 1 and "resuming with changed values: max_steps: 2 -> 3, optimizer.lr:" in stdout
    doc.expect("resume-does-not-fit", one_error(err), ckpt=out / "checkpoints" / "step_000002",
               why="loaded state dict contains a parameter group that doesn't match the size of optimizer's group")
    assert snapshot(out) == before
    monkeypatch.undo()
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=3", "resume=true", *lora), "lora", "lora/smollm2")
    assert code == 0, err  # the unchanged command resumes the run
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2, 3]


def test_a_recipe_never_writes_into_another_recipes_output_dir(tmp_path, tiny_model_dir, capsys):
    """quantize into a training run's folder, or a training run into a kd_logits cache's folder: refused before
    anything loads, naming what the folder holds; nothing in it changes."""
    out = tmp_path / "out"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=1"))[0] == 0
    before = snapshot(out)
    code, stdout, err = run(capsys, [f"model.checkpoint_dir={out / 'model'}", f"output_dir={out}", "device=cpu",
                                     "perplexity.limit=2"], recipe="quantize", config="quantize/smollm2_8da4w")
    assert code == 1
    doc.expect("output-other-recipe", one_error(err), out=out, held="a training run",
               names="checkpoints, metrics.jsonl, model, ...", recipe="quantize", own="quantize exports")
    assert snapshot(out) == before
    # nor inside the run's outputs: its next resume=true deleted eval results written into its model/
    for recipe, config, inside, where in (("eval", "eval/smollm2", "model", out / "model" / "scores"),
                                          ("quantize", "quantize/smollm2_8da4w", "checkpoints",
                                           out / "checkpoints" / "step_000001")):
        code, _, err = run(capsys, [f"model.checkpoint_dir={out / 'model'}", f"output_dir={where}", "device=cpu"],
                           recipe=recipe, config=config)
        assert code == 1
        doc.expect("output-inside-outputs", one_error(err), out=where, inside=out / inside, held="a training run",
                   folder=out, recipe=recipe)
        assert snapshot(out) == before

    cache = tmp_path / "cache"  # what `recipe run kd_logits` leaves: a manifest and its shards
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    (cache / "shard_00000.safetensors").write_bytes(b"")
    code, _, err = run(capsys, args(tiny_model_dir, cache, "max_steps=1"))
    assert code == 1
    doc.expect("output-other-recipe", one_error(err), out=cache, held="a kd_logits cache",
               names="manifest.json, shard_00000.safetensors", recipe="full", own="a training run")
    assert sorted(p.name for p in cache.iterdir()) == ["manifest.json", "shard_00000.safetensors"]


def test_what_counts_as_an_earlier_run(tmp_path, tiny_model_dir, capsys):
    from llm_recipe.components.runs import previous_run

    out = tmp_path / "out"
    out.mkdir()
    # a run that stopped during setup leaves run.json, an empty metrics.jsonl and the lock: nothing to mix with
    (out / "run.json").write_text(json.dumps({"run_id": "0" * 32, "started": "earlier"}))
    (out / "metrics.jsonl").write_text("")
    (out / ".recipe.lock").write_text("")
    (out / "notes.txt").write_text("mine\n")  # a file we do not write is never touched
    assert previous_run(out) == []
    # a run killed after logging steps but before its first checkpoint: resume has nothing to continue, and says
    # how to start over
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert previous_run(out) == [f"run {'0' * 32} started earlier", "metrics.jsonl with steps 1-1"]
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=2", "resume=true"))
    assert code == 1 and "run overwrite=true to start fresh" in one_error(err)
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=2", "overwrite=true"))
    assert code == 0, err
    assert run_id(out) != "0" * 32 and (out / "notes.txt").read_text() == "mine\n"
    assert not [p for p in out.iterdir() if ".del-" in p.name]


# ----------------------------------------------------------------------------------------------- out of memory

CUDA_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB"
CPU_OOM = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("error", [torch.OutOfMemoryError(CUDA_OOM), RuntimeError(CPU_OOM), MemoryError()],
                         ids=["cuda", "cpu-allocator", "memory-error"])
def test_out_of_memory_in_a_step_is_one_line_and_keeps_the_last_checkpoint(tmp_path, tiny_model_dir, capsys,
                                                                          monkeypatch, error):
    import llm_recipe.components.training as training

    real, calls = training.kd_and_ce, []

    def loss_running_out_at_step_3(*a, **kw):  # gradient_accumulation_steps=1: call n is step n
        calls.append(1)
        if len(calls) == 3:
            raise error
        return real(*a, **kw)

    monkeypatch.setattr(training, "kd_and_ce", loss_running_out_at_step_3)
    out = tmp_path / "out"
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=4"))
    assert code == 1
    line = one_error(err)
    if isinstance(error, MemoryError):  # says nothing of the size it wanted
        line = line.replace(" resident on the CPU)", " resident on the CPU; it tried to allocate 2.00 GiB)")
    doc.expect("oom-step", line, out=out)
    # the last good checkpoint is kept, metrics hold the completed steps only (whole lines), the lock is released
    assert [p.name for p in rc.complete_checkpoints(out)] == ["step_000001", "step_000002"]
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["step"] for r in rc.read_metrics(out)] == [1, 2]
    assert not (out / "model").exists() and not (out / ".recipe.lock").exists()

    # with the memory back, resume=true finishes the run from there
    monkeypatch.setattr(training, "kd_and_ce", real)
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=4", "resume=true"))
    assert code == 0, err
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2, 3, 4]


def test_out_of_memory_during_setup_is_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from llm_recipe.recipes import full  # the module `recipe run full` runs

    def load_model_out_of_memory(*a, **kw):
        raise torch.OutOfMemoryError(CUDA_OOM)

    monkeypatch.setattr(full, "load_model", load_model_out_of_memory)
    out = tmp_path / "out"
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=2", "batch_size=4",
                                    "gradient_accumulation_steps=2"))
    assert code == 1
    doc.expect("oom-setup", one_error(err), out=out)
    assert not rc.complete_checkpoints(out) and not (out / ".recipe.lock").exists()
    # it stopped before training: the same command runs again once memory allows (no overwrite needed)
    monkeypatch.undo()
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=1"))
    assert code == 0, err


def test_out_of_memory_advice_for_kd_names_the_teacher_settings():
    from llm_recipe.components.config import load_config
    from llm_recipe.components.oom import out_of_memory_message

    cfg = load_config("kd/smollm2_demo", ["batch_size=8", "activation_checkpointing=false"])
    msg = out_of_memory_message(torch.OutOfMemoryError(CUDA_OOM), cfg)
    assert msg.startswith("out of memory while setting up, before step 1 (peak ")
    assert "batch_size=4 gradient_accumulation_steps=" in msg and "activation_checkpointing=true" in msg
    assert "teacher.quantize=fp8 (GPU)" in msg and "teacher.logits_dir=<a kd_logits cache>" in msg
    cached = load_config("kd/smollm2_demo", ["teacher.logits_dir=/some/cache"])
    assert "teacher." not in out_of_memory_message(MemoryError(), cached)


def test_torchrun_launch_is_refused_once_before_any_worker_starts(tmp_path, tiny_model_dir, capsys):
    from llm_recipe.cli.main import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n')
    capsys.readouterr()
    code = main(["run", "--nproc-per-node", "2", "--standalone", "full", "--config", CONFIG,
                 *args(tiny_model_dir, out, "max_steps=2")])
    err = capsys.readouterr().err
    assert code == 1
    doc.expect("output-holds-run", one_error(err), out=out)
    assert "worker" not in err and sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_overwrite_refuses_to_train_from_the_outputs_it_deletes(tmp_path, tiny_model_dir, capsys):
    """`overwrite=true model.checkpoint_dir=<out>/model`: the earlier run's model/ was set aside before the weights
    loaded, and the run failed on "no config.json" in a folder that was there a moment before. Refused first,
    naming the key, with the earlier run left as it was; a model folder elsewhere in output_dir is not an output."""
    out = tmp_path / "run"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=1"))[0] == 0
    before = snapshot(out)
    code, _, err = run(capsys, args(out / "model", out, "max_steps=1", "overwrite=true"))
    assert code == 1 and one_error(err) == (
        f"recipe: error: override 'model.checkpoint_dir={out / 'model'}': key 'model.checkpoint_dir': "
        f"{out / 'model'} is among the outputs of the earlier run in {out}, which overwrite=true deletes: copy it "
        "elsewhere first and read it from there, or choose another output_dir")
    assert snapshot(out) == before
    shutil.copytree(tiny_model_dir, out / "base")  # the user's own folder inside output_dir: kept, so allowed
    assert run(capsys, args(out / "base", out, "max_steps=1", "overwrite=true"))[0] == 0
    assert (out / "base" / "config.json").is_file() and (out / "model" / "config.json").is_file()


def test_resume_and_overwrite_together_are_refused_and_change_nothing(tmp_path, tiny_model_dir, capsys):
    """`resume=true overwrite=true`: one continues the run in output_dir, the other deletes it; resume won in silence.
    Refused in one line before anything moves, in one process and before torchrun starts."""
    out = tmp_path / "run"
    assert run(capsys, args(tiny_model_dir, out, "max_steps=1"))[0] == 0
    before = snapshot(out)
    want = (f"recipe: error: resume=true and overwrite=true contradict each other: resume=true continues the run in "
            f"{out}, overwrite=true deletes its outputs and starts a new one; set only one")
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=2", "resume=true", "overwrite=true"))
    assert code == 1 and one_error(err) == want
    from llm_recipe.cli.main import main

    code = main(["run", "--nproc-per-node", "2", "--standalone", "full", "--config", CONFIG,
                 *args(tiny_model_dir, out, "max_steps=2", "resume=true", "overwrite=true")])
    assert code == 1 and one_error(capsys.readouterr().err) == want
    assert snapshot(out) == before


def test_a_run_stopped_in_setup_leaves_nothing_that_gets_in_the_way(tmp_path, tiny_model_dir, capsys):
    """A run refused during setup (here a dataset file that does not parse) had written run.json: the corrected
    command then said "overwrite=true: deleted the earlier run's run.json" without overwrite=true, and resume=true
    there listed "changed values" of a run that never trained a step instead of saying there is no checkpoint."""
    out = tmp_path / "run"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{broken\n')
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=1", f"dataset.source={bad}", "dataset.format=text"))
    assert code == 1 and f"{bad}:2: invalid JSON" in one_error(err)
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=1", "resume=true"))
    assert code == 1 and one_error(err).startswith(f"recipe: error: resume=true but {out}/checkpoints has no complete "
                                                   "checkpoint"), err
    code, stdout, err = run(capsys, args(tiny_model_dir, out, "max_steps=1"))
    assert code == 0, err
    assert "overwrite=true" not in stdout + err


def test_a_refused_run_leaves_no_empty_folder(tmp_path, tiny_model_dir, capsys):
    """resume=true into a folder that does not exist is refused (no checkpoint); it left the empty folder."""
    out = tmp_path / "never"
    code, _, err = run(capsys, args(tiny_model_dir, out, "max_steps=1", "resume=true"))
    assert code == 1 and "has no complete checkpoint" in one_error(err)
    assert not out.exists()
