"""Faults during a run lose nothing: kill -9 at several moments (inside a step, halfway through a checkpoint file,
halfway through the final model, during a quantize export), a full disk during a save, Ctrl-C, corrupt
checkpoints, and an output folder without write permission. The expected messages come from
docs/reliability.md (tests/fixtures/reliability_doc.py).

Faults are injected without timing: tests/fixtures/kill_at.py runs the real CLI in a subprocess and sends
SIGKILL (or SIGINT) to it at the N-th call of a chosen function; the product code carries no test hooks. The
reference and the final resumed runs call the CLI in this process with one thread, which is bit-identical to the
one-thread subprocesses (as in test_resume.py).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import recipes_common as rc
import reliability_doc as doc
import torch
from safetensors import safe_open

from llm_recipe.components.checkpoint import load_recipe_state, verify_manifest
from llm_recipe.components.folders import LOCK_NAME

KILL_AT = Path(__file__).parent / "fixtures" / "kill_at.py"

STEPS = 6
CONFIG = "full/smollm2"


def train_args(model: Path, out: Path) -> list[str]:
    """6 steps of 2 accumulated micro-batches on the tiny model, a checkpoint every 2 steps (2 kept)."""
    return [*rc.COMMON, f"model.checkpoint_dir={model}", f"output_dir={out}", f"max_steps={STEPS}",
            "gradient_accumulation_steps=2", "optimizer.lr=1e-3", "lr_scheduler.warmup_steps=2",
            "save_every_n_steps=2", "keep_last_n=2"]


def run_with_fault(fault: dict | None, recipe: str, config: str, overrides: list[str], cwd: Path,
                   preexec_fn=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(KILL_AT), json.dumps(fault)] if fault else [sys.executable, "-m", "llm_recipe.cli.main"]
    return subprocess.run([*cmd, *rc.run_args(recipe, config, overrides)], cwd=cwd, env=rc.cli_env(),
                          capture_output=True, text=True, timeout=600, preexec_fn=preexec_fn)


def assert_killed(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == -signal.SIGKILL, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"


def steps_of(out: Path) -> list[str]:
    return [p.name for p in rc.complete_checkpoints(out)]


def can_clone(folder: Path) -> bool:
    """Whether `folder`'s filesystem makes copy-on-write clones (btrfs, XFS, ZFS: model/ clones the checkpoint)."""
    from llm_recipe.components.models.hf_io import _clone

    (folder / "probe").write_bytes(b"x")
    try:
        return _clone(folder / "probe", folder / "probe_clone")
    finally:
        for name in ("probe", "probe_clone"):
            (folder / name).unlink(missing_ok=True)


def hidden_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != LOCK_NAME)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> Path:
    """The uninterrupted run every faulted run must end up equal to."""
    out = tmp_path_factory.mktemp("faults") / "uninterrupted"
    assert rc.run_in_process("full", CONFIG, train_args(tiny_model_dir, out)) == 0
    return out


def assert_same_as_reference(out: Path, reference: Path) -> None:
    rc.assert_same_weights(out / "model", reference / "model")
    got, want = rc.read_metrics(out), rc.read_metrics(reference)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # no step lost or logged twice
    assert [(r["loss"], r["lr"]) for r in got] == [(r["loss"], r["lr"]) for r in want]
    assert not (out / LOCK_NAME).exists()


def test_kill_at_several_points_then_resume_is_bit_identical(tmp_path, tiny_model_dir, reference, capsys):
    out = tmp_path / "out"
    args = train_args(tiny_model_dir, out)
    resume = [*args, "resume=true"]

    # 1. kill -9 inside optimizer step 3: its forward and backward ran, its update did not
    assert_killed(run_with_fault({"target": "llm_recipe.components.training.optimizer_step", "nth": 3}, "full", CONFIG, args,
                                 tmp_path))
    assert steps_of(out) == ["step_000002"]
    assert (out / LOCK_NAME).exists()  # a killed run cannot clean up: the next run takes its lock over

    # 2. resumed; kill -9 halfway through writing step 4's recipe state (the file is cut to half its size)
    p = run_with_fault({"target": "llm_recipe.components.checkpoint.state.save_tensors", "action": "truncate"}, "full", CONFIG,
                       resume, tmp_path)
    assert_killed(p)
    doc.expect("stale-lock", p.stderr, out=out)
    doc.expect("kill-in-step", p.stdout, out=out)
    assert steps_of(out) == ["step_000002"]  # the half-written step 4 is only a hidden temp folder
    assert [n.split(".tmp-")[0] for n in hidden_leftovers(out / "checkpoints")] == [".step_000004"]

    # 3. resumed from step 2 again; kill -9 halfway through writing the final model: on a filesystem with clones
    #    after model/'s first cloned file, elsewhere with its streamed weights cut to half their size
    fault = ({"target": "llm_recipe.components.models.hf_io._clone", "nth": 2, "path_contains": "step_000006"}
             if can_clone(tmp_path) else
             {"target": "llm_recipe.components.models.hf_io.save_tensors", "action": "truncate",
              "path_contains": ".model.tmp-"})
    p = run_with_fault(fault, "full", CONFIG, resume, tmp_path)
    assert_killed(p)
    doc.expect("kill-mid-save", p.stdout, out=out)
    assert steps_of(out) == ["step_000004", "step_000006"]
    assert not (out / "model").exists() and [n.split(".tmp-")[0] for n in hidden_leftovers(out)] == [".model"]

    # 4. resumed from the last checkpoint: completes, equal to the uninterrupted run, no leftovers
    capsys.readouterr()
    assert rc.run_in_process("full", CONFIG, resume) == 0
    doc.expect("kill-final-write", capsys.readouterr().out, out=out)
    assert_same_as_reference(out, reference)
    assert hidden_leftovers(out) == [] and hidden_leftovers(out / "checkpoints") == []


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, tiny_model_dir, reference):
    # the uninterrupted run as it stood after step 5 (a checkpoint every 2 steps: step 4 is the newest)
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "model")
    shutil.rmtree(out / "checkpoints" / "step_000006")
    prev = out / "checkpoints" / "step_000004"
    limit = max(f.stat().st_size for f in prev.rglob("*") if f.is_file()) - 1

    def small_disk() -> None:  # files may not grow past `limit` bytes: the write fails with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [*train_args(tiny_model_dir, out), "resume=true"]
    p = run_with_fault(None, "full", CONFIG, args, tmp_path, preexec_fn=small_disk)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("recipe: error:")]
    doc.expect("disk-full", line, out=out)
    # the previous checkpoint is complete and loads; nothing half-written is left
    assert steps_of(out) == ["step_000004"] and hidden_leftovers(out / "checkpoints") == []
    verify_manifest(prev)
    assert load_recipe_state(prev)["step"] == 4
    # with room again, resuming gives the uninterrupted run's weights
    assert rc.run_in_process("full", CONFIG, args) == 0
    assert_same_as_reference(out, reference)


@pytest.mark.parametrize("signal_name, status", [("sigint", 130), ("sigterm", 143)])
def test_ctrl_c_checkpoints_at_the_next_step_boundary_and_exits_130(tmp_path, tiny_model_dir, reference, signal_name,
                                                                    status):
    """Ctrl-C (SIGINT), or the SIGTERM a job scheduler sends before it kills a job: the step finishes, its checkpoint
    is written, the exit status is 128 + the signal, and resume=true gives the uninterrupted run's weights."""
    out = tmp_path / "out"
    args = train_args(tiny_model_dir, out)
    # the signal arrives inside optimizer step 3
    p = run_with_fault({"target": "llm_recipe.components.training.optimizer_step", "nth": 3, "action": signal_name},
                       "full", CONFIG, args, tmp_path)
    assert p.returncode == status, p.stderr
    assert "Traceback" not in p.stderr
    doc.expect("ctrl-c", p.stderr, out=out)
    assert steps_of(out) == ["step_000002", "step_000003"]  # step 3 finished and was saved (3 is off the cadence)
    assert [r["step"] for r in rc.read_metrics(out)] == [1, 2, 3]
    assert not (out / "model").exists() and not (out / LOCK_NAME).exists()
    assert rc.run_in_process("full", CONFIG, [*args, "resume=true"]) == 0
    assert_same_as_reference(out, reference)



def test_a_second_ctrl_c_stops_at_once_even_inside_one_long_c_call(tmp_path):
    """Two Ctrl-Cs while the main thread is inside one C call (a CPU step's backward can take a minute): Python
    would run its handler once, for both, after the call; the user was told the second one stops now. The first
    is said at once, the second ends the process with 130 long before the call would have returned."""
    script = tmp_path / "long_call.py"
    script.write_text(
        "import torch\n"
        "from llm_recipe.components import interrupt\n"
        "torch.set_num_threads(1)\n"
        "eye = torch.eye(1200, dtype=torch.float64)\n"
        "interrupt.note_training()\n"
        "with interrupt.StopRequest.install():\n"
        "    print('ready', flush=True)\n"
        "    torch.linalg.matrix_power(eye, 2**62)  # one C call of ~60 matmuls: tens of seconds on one core\n"
        "    print('returned', flush=True)\n")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    p.send_signal(signal.SIGINT)
    first = p.stderr.readline() + p.stderr.readline()  # a blank line (the progress bar's), then the message
    assert "Ctrl-C: stopping after this step and writing a checkpoint (Ctrl-C again stops now)" in first
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=20)
    finally:
        p.kill()
    assert p.returncode == 130 and "returned" not in out
    assert "recipe: interrupted during training (second Ctrl-C): the current step was not saved" in err


def test_a_torchrun_worker_takes_the_launchers_signal_and_leaves_its_own_sigterm_to_torchrun(monkeypatch):
    """Under `recipe run --nproc-per-node N` a worker's stop request is the launcher's SIGUSR2 (a SIGTERM passed
    on) or SIGUSR1 (a Ctrl-C); a second one stops at once. Its own SIGTERM keeps the default action: torchrun sends
    it to stop the ranks after one failed, and a rank blocked in a collective with a dead peer must die at once.
    Under plain torchrun nothing is caught (torchrun stops its workers itself)."""
    from llm_recipe.components import interrupt

    monkeypatch.setenv(interrupt.FORWARDED_ENV, "1")
    with interrupt.StopRequest.install(ranks=2, main=False) as stop:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.raise_signal(signal.SIGUSR2)
        assert stop.requested and stop.signum == signal.SIGTERM
        assert stop.agreed({"stop": 1.0}) and not stop.agreed({"stop": 0.0})  # the ranks' sum decides
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGUSR2)
    with interrupt.StopRequest.install(ranks=1, main=False) as stop:  # `--nproc-per-node 1`: both kinds
        signal.raise_signal(signal.SIGUSR1)
        assert stop.requested and stop.signum == signal.SIGINT and stop.agreed({})
    monkeypatch.delenv(interrupt.FORWARDED_ENV)
    with interrupt.StopRequest.install(ranks=2, main=False):
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_a_step_is_checkpointed_once_when_ctrl_c_comes_on_a_save_step(monkeypatch):
    """Ctrl-C (or a scheduler's SIGTERM) inside a step that ends on the save cadence: the loop's save and the
    interrupt's save are one write (it rewrote the whole checkpoint, doubling the save time inside the grace period
    a scheduler gives before SIGKILL)."""
    from llm_recipe.components.train_state import TrainState

    state = TrainState.__new__(TrainState)  # only the save bookkeeping is under test
    state.last_checkpoint, state.saved_step, written = None, None, []
    state.rt = SimpleNamespace(is_main=False)  # no rank-0 line about the (not written) folder
    monkeypatch.setattr(state, "_write", lambda step: written.append(step) or Path(f"checkpoints/step_{step:06d}"),
                        raising=False)
    assert state.save(2) == state.save(2) == Path("checkpoints/step_000002")  # the cadence's save, then Ctrl-C's
    state.save(3)
    assert written == [2, 3]
    assert state.final_checkpoint() == Path("checkpoints/step_000003")  # model/ may copy what this process wrote


def test_a_resumed_finished_run_writes_its_final_model_anew(monkeypatch):
    """A finished run resumed (e.g. resume_with_changes=true with another LoRA base or dtype): its final save is the
    restored checkpoint, which model/ must not copy (it holds the old base's merge, the old code's config); a
    checkpoint this process writes after it may be."""
    from llm_recipe.components.train_state import TrainState

    state = TrainState.__new__(TrainState)
    state.rt, state.written = SimpleNamespace(is_main=False), None
    state.last_checkpoint, state.saved_step = Path("checkpoints/step_000004"), 4  # what restore() sets
    monkeypatch.setattr(state, "_write", lambda step: Path(f"checkpoints/step_{step:06d}"), raising=False)
    assert state.save(4) == Path("checkpoints/step_000004") and state.final_checkpoint() is None
    state.save(5)
    assert state.final_checkpoint() == Path("checkpoints/step_000005")


@pytest.mark.parametrize("damage, row", [
    ("flip", "flipped-byte"), ("delete", "missing-file"), ("truncate", "truncated-file"),
])
def test_corrupt_checkpoint_is_refused_on_resume(tmp_path, tiny_model_dir, reference, capsys, damage, row):
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    ckpt = rc.complete_checkpoints(out)[-1]
    target = ckpt / ("config.json" if damage == "delete" else "recipe_state/tensors.safetensors")
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        os.truncate(target, target.stat().st_size - 1)
    capsys.readouterr()
    code = rc.run_in_process("full", CONFIG, [*train_args(tiny_model_dir, out), "resume=true"])
    captured = capsys.readouterr()
    assert code == 1, captured.err
    (line,) = [ln for ln in captured.err.splitlines() if ln.startswith("recipe: error:")]
    doc.expect(row, line, file=target)
    assert "resuming from" not in captured.out  # refused before anything loads


def test_kill_during_quantize_export_then_rerun_gives_the_same_files(tmp_path, tiny_model_dir):
    args = [f"model.checkpoint_dir={tiny_model_dir}", "formats=[hf,gguf]", "gguf_qtype=Q8_0", "perplexity.limit=2",
            "perplexity.max_seq_len=32", "device=cpu"]
    ref, out = tmp_path / "uninterrupted", tmp_path / "out"
    assert rc.run_in_process("quantize", "quantize/smollm2_8da4w", [*args, f"output_dir={ref}"]) == 0
    # kill -9 halfway through writing the torchao HF export's weights
    p = run_with_fault({"target": "llm_recipe.components.quantization.export_hf.save_file", "action": "truncate"}, "quantize",
                       "quantize/smollm2_8da4w", [*args, f"output_dir={out}"], tmp_path)
    assert_killed(p)
    assert not (out / "hf").exists() and not (out / "report.json").exists()
    # the same command, killed after the HF export is complete, as the GGUF export starts: hf/ and no report.json
    p = run_with_fault({"target": "llm_recipe.recipes.quantize.export_gguf", "action": "kill"}, "quantize",
                       "quantize/smollm2_8da4w", [*args, f"output_dir={out}"], tmp_path)
    assert_killed(p)
    assert (out / "hf").is_dir() and not (out / "report.json").exists()
    p = run_with_fault(None, "quantize", "quantize/smollm2_8da4w", [*args, f"output_dir={out}"], tmp_path)
    rc.assert_ok(p)
    doc.expect("kill-export", p.stdout)
    for rel in ("hf/config.json", "model-Q8_0.gguf"):
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel
    # safetensors writes its metadata map in hash order, so compare the tensors and the metadata, not the bytes
    (ta, ma), (tb, mb) = (_safetensors(d / "hf" / "model.safetensors") for d in (out, ref))
    assert ma == mb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    a, b = (json.loads((d / "report.json").read_text()) for d in (out, ref))
    assert a["perplexity_after"] == b["perplexity_after"] and a["perplexity_before"] == b["perplexity_before"]
    assert hidden_leftovers(out) == [".quantize_run.json"]  # what the run was computed from (result_runs.py)


def _safetensors(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_output_dir_without_write_permission(tmp_path, tiny_model_dir):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    prefix = []
    if os.geteuid() == 0:  # root writes anywhere: run it as root without the capability to ignore permissions
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and util-linux setpriv is not installed")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps=-all"]
    try:
        p = subprocess.run([*prefix, sys.executable, "-m", "llm_recipe.cli.main", *rc.run_args("full", CONFIG, [
            f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={ro}/out"])], cwd=tmp_path, env=rc.cli_env(),
            capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("recipe: error:")]
        doc.expect("output-readonly", line, ro=ro)
        assert not (ro / "out").exists()
    finally:
        os.chmod(ro, 0o755)
