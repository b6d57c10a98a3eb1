"""Every training recipe's save path under torchrun (2 processes, gloo, CPU): the same outputs as one process.

Each case trains the tiny model for a few steps once with 1 process (batch 4) and once with 2 (batch 2 each,
the same global batch), then compares what a user gets: the merged HF folder, the PEFT adapter (which PEFT
loads on the base with the logits of our merged model), the checkpoints (sharded on 2 processes, turned into
HF folders with `python -m llm_recipe.components.checkpoint.sharded`), metrics.jsonl, and QAT's converted folder.
Then rank 1 of a 2-process run is killed with SIGKILL mid-training: the launcher stops at once with one line naming
the rank and the signal, and the run resumes to the uninterrupted run's exact weights.

Runs are shared between assertions (module-scoped fixtures) to keep the file to a few minutes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import recipes_common as rc
import torch
from safetensors.torch import load_file

TWO = ["--nproc-per-node", "2", "--standalone"]
STEPS = 3
# AdamW (the configs' optimizer) at a constant lr: 1- vs 2-process runs differ only in reduction order.
# 40 chat rows keep 15 within 64 tokens (16 packed KD rows): 3 steps of global batch 4 fit in one epoch, where
# 2 ranks' batches of 2 are exactly the rows of 1 process's batch of 4.
TRAIN = ["device=cpu", "dtype=fp32", "dataset.max_seq_len=64", "dataset.limit=40", "dataset.shuffle=false",
         "gradient_accumulation_steps=1", "lr_scheduler.name=constant", "lr_scheduler.warmup_steps=0",
         "max_grad_norm=1.0", "keep_last_n=null", f"max_steps={STEPS}", "optimizer.lr=1e-3"]
LORA = "lora={rank: 4, alpha: 8.0, targets: [q_proj, v_proj, down_proj]}"


def cases(model: Path) -> dict[str, tuple[str, str, list[str]]]:
    kd = [*TRAIN, f"teacher.checkpoint_dir={model}", "student.every=null", "student.prune=null", "dataset.max_seq_len=48",
          "dataset.limit=16"]
    return {
        # Two micro-batches per step: FSDP gathers the layers and reduce-scatters the gradients once per step
        # (components/fsdp.py), so the first micro-batch's gradients stay local until the second's backward. 72
        # passages leave 34 rows with targets, more than the 3 x 8 the steps take: an epoch's end would pad the
        # ranks' shares by wrapping around (loader.py), which one process does not do.
        "lora": ("lora", "lora/smollm2", [*TRAIN, f"model.checkpoint_dir={model}", LORA, "save_every_n_steps=1",
                                         "gradient_accumulation_steps=2", "dataset.limit=72"]),
        # KD with a DoRA student on the teacher's own layers (so a PEFT adapter is written).
        "kd_dora": ("kd", "kd/smollm2_demo", [*kd, LORA, "lora.use_dora=true", "save_every_n_steps=null"]),
        # KD with a full, layer-pruned student.
        "kd_full": ("kd", "kd/smollm2_demo", [*kd, "student.keep_layers=[0,3]", "save_every_n_steps=2",
                                               "teacher.placement=shard"]),
        # QAT's fake quantization is discontinuous (int8 activations, int4 weights): reduction-order noise flips
        # roundings, so the 1- vs 2-process comparison is on update norms, with SGD (no per-element Adam signs).
        "qat": ("qat", "qat/smollm2", [*TRAIN, f"model.checkpoint_dir={model}", "qat.fake_quant_after_n_steps=1",
                                       "save_every_n_steps=null", "optimizer={_component_: torch.optim.SGD, lr: 0.1}"]),
    }


def run(recipe: str, config: str, overrides: list[str], cwd: Path, torchrun: list[str] = ()) -> str:
    """Run `recipe run ...` in a subprocess; its stdout."""
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", *torchrun, recipe, "--config", config,
                           *overrides], cwd=cwd, env=rc.cli_env(), capture_output=True, text=True, timeout=900)
    rc.assert_ok(proc)
    return proc.stdout


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model_dir):
    """case -> (1-process output_dir, 2-process output_dir), each run once per module, on first use."""
    root = tmp_path_factory.mktemp("dist")
    done: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in done:
            recipe, config, overrides = cases(tiny_model_dir)[case]
            one, two = root / f"{case}_1", root / f"{case}_2"
            assert rc.run_in_process(recipe, config, [*overrides, "batch_size=4", f"output_dir={one}"]) == 0
            out = run(recipe, config, [*overrides, "batch_size=2", f"output_dir={two}"], root, TWO)
            (root / f"{case}_2.stdout").write_text(out)  # read by `launch_log`
            done[case] = (one, two)
        return done[case]

    return get


def assert_close_weights(a: Path, b: Path, atol: float = 2e-5) -> None:
    wa, wb = rc.weights(a), rc.weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=atol, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def assert_close_updates(a: Path, b: Path, base: Path, rel: float = 0.05) -> None:
    """b's weights moved from base like a's: the difference is under `rel` of a's whole update (norms)."""
    wa, wb, w0 = rc.weights(a), rc.weights(b), rc.weights(base)
    assert wa.keys() == wb.keys()
    diff = torch.cat([(wb[k] - wa[k]).flatten() for k in wa]).norm()
    update = torch.cat([(wa[k] - w0[k]).flatten() for k in wa]).norm()
    assert update > 0 and diff < rel * update, (float(diff), float(update))


def assert_same_metrics(one: Path, two: Path, rel: float = 1e-4) -> None:
    a, b = rc.read_metrics(one), rc.read_metrics(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b, strict=True):
        for k in (k for k in ra if k.endswith("loss") or k in ("lr", "grad_norm")):
            assert rb[k] == pytest.approx(ra[k], rel=rel, abs=1e-6), (k, ra, rb)
    rc.assert_png(two / "loss.png")


def assert_checkpoints_match(one: Path, two: Path, tmp_path: Path, close=assert_close_weights) -> None:
    """Same steps; the 2-process ones are sharded, checksummed (every rank's shards in the manifest) and convert
    into the 1-process checkpoint's weights."""
    from llm_recipe.components.checkpoint.manifest import verify_manifest
    from llm_recipe.components.checkpoint.sharded import is_sharded_checkpoint

    c1, c2 = rc.complete_checkpoints(one), rc.complete_checkpoints(two)
    assert [p.name for p in c1] == [p.name for p in c2] and c1
    for a, b in zip(c1, c2, strict=True):
        assert not is_sharded_checkpoint(a) and is_sharded_checkpoint(b)
        assert not (b / "model.safetensors").exists()  # no full gather per save
        assert sorted(p.name for p in (b / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        listed = json.loads((b / "manifest.json").read_text())["files"]
        assert {"sharded/__0_0.distcp", "sharded/__1_0.distcp", "sharded/.metadata"} <= listed.keys()
        verify_manifest(b)
        out = tmp_path / f"{two.name}_{b.name}_hf"
        proc = subprocess.run([sys.executable, "-m", "llm_recipe.components.checkpoint.sharded", str(b), str(out)],
                              env=rc.cli_env(), capture_output=True, text=True, timeout=300)
        rc.assert_ok(proc)
        close(a, out)


def assert_flipped_shard_is_refused(two: Path, tmp_path: Path, capsys) -> None:
    """A flipped byte in one rank's shard is a one-line error when converting, never a silent conversion."""
    from llm_recipe.components.checkpoint.sharded import main as convert

    flipped = tmp_path / f"{two.name}_flipped"
    shutil.copytree(rc.complete_checkpoints(two)[-1], flipped)
    shard = flipped / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert convert([str(flipped), str(tmp_path / "no")]) == 1  # `python -m llm_recipe.components.checkpoint.sharded`
    err = capsys.readouterr().err
    assert err.startswith(f"recipe: error: checkpoint file {shard} is corrupt") and err.count("\n") == 1, err
    assert not (tmp_path / "no").exists()


def assert_adapter(one: Path, two: Path, base: Path) -> None:
    """The 2-process adapter equals the 1-process one and loads in PEFT with our merged model's logits."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    a1 = load_file(str(one / "adapter" / "adapter_model.safetensors"))
    a2 = load_file(str(two / "adapter" / "adapter_model.safetensors"))
    assert a1.keys() == a2.keys() and a1
    for k in a1:
        torch.testing.assert_close(a2[k], a1[k], atol=2e-5, rtol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokens = rc.sample_tokens()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, two / "adapter").eval()(tokens).logits
    torch.testing.assert_close(theirs, rc.our_logits(two / "model", tokens), atol=1e-4, rtol=0)


def launch_log(two: Path) -> str:
    """What the 2-process run of `pair` printed."""
    return (two.parent / f"{two.name}.stdout").read_text()


def test_lora_two_processes_match_one(pair, tiny_model_dir, tmp_path, capsys):
    one, two = pair("lora")
    assert "fsdp: layers gathered once" in launch_log(two)  # the schedule the comparison below covers
    assert_close_weights(one / "model", two / "model")
    assert_adapter(one, two, tiny_model_dir)
    assert_checkpoints_match(one, two, tmp_path)
    assert_flipped_shard_is_refused(two, tmp_path, capsys)
    assert_same_metrics(one, two)


@pytest.mark.slow  # ~35 s on 2 cores; the LoRA student on 2 processes stays in the default suite
def test_kd_dora_student_two_processes_match_one(pair, tiny_model_dir, tmp_path):
    one, two = pair("kd_dora")
    assert_close_weights(one / "model", two / "model")
    assert_adapter(one, two, tiny_model_dir)
    assert_checkpoints_match(one, two, tmp_path)  # the final step's checkpoint
    assert_same_metrics(one, two)


@pytest.mark.slow  # ~80 s on 2 shared cores; the default suite keeps KD's LoRA (DoRA) student case
def test_kd_full_student_two_processes_match_one(pair, tmp_path):
    from llm_recipe.components.models import read_model_args

    one, two = pair("kd_full")
    assert_close_weights(one / "model", two / "model")
    assert read_model_args(two / "model").num_layers == 2
    assert not (two / "adapter").exists()
    assert_checkpoints_match(one, two, tmp_path)
    assert_same_metrics(one, two)


@pytest.mark.slow  # ~30 s on 2 shared cores; the default suite keeps LoRA and DoRA in 2 processes, QAT in 1
def test_qat_two_processes_match_one(pair, tiny_model_dir, tmp_path):
    from llm_recipe.components.quantization.export_hf import load_hf_torchao

    one, two = pair("qat")
    assert rc.read_metrics(one)[0]["loss"] == pytest.approx(rc.read_metrics(two)[0]["loss"], rel=1e-6)
    assert_close_updates(one / "model", two / "model", tiny_model_dir)
    assert (two / "model" / "quantization.json").read_text() == (one / "model" / "quantization.json").read_text()
    assert_checkpoints_match(one, two, tmp_path,
                             close=lambda a, b: assert_close_updates(a, b, tiny_model_dir))
    assert_same_metrics(one, two, rel=2e-3)
    # The converted (8da4w) folder: written on rank 0 from the saved merged weights; close to 1 process's.
    tokens = rc.sample_tokens()
    with torch.no_grad():
        q1 = load_hf_torchao(one / "quantized")[0].eval()(tokens)
        q2 = load_hf_torchao(two / "quantized")[0].eval()(tokens)
    assert (q2 - q1).abs().mean() < 0.05 * q1.abs().mean()


def test_qlora_unshardable_nf4_is_one_line_error(tmp_path, tiny_model_dir):
    """The tiny model's 64x64 NF4 weights hold one double-quantization factor each, which FSDP2 cannot split
    over 2 ranks: a one-line error naming the weight, not an AssertionError from inside torchao. Said once: every
    rank failed the same way and printed it, between torchrun's lines for each worker and a summary line."""
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", *TWO, "lora", "--config", "lora/smollm2",
                           *TRAIN, f"model.checkpoint_dir={tiny_model_dir}", LORA, "lora.quantize_base=true",
                           f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=rc.cli_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if "recipe: error:" in ln and "NF4 weight" in ln]
    assert lines and "layers.0.attn.q_proj.weight" in lines[0] and "block_size*scaler_block_size" in lines[0]
    assert "AssertionError" not in proc.stderr
    assert proc.stderr.count("recipe: error:") == 1 and proc.stderr.splitlines()[-1] == lines[0], proc.stderr[-3000:]
    assert "closing signal" not in proc.stderr and "failed (exitcode" not in proc.stderr, proc.stderr[-3000:]


def _worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of worker `rank` of a `recipe run --nproc-per-node N` launcher (its child with RANK=rank)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            if f"RANK={rank}".encode() in (stat.parent / "environ").read_bytes().split(b"\0"):
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def launch_two_and(act, recipe: str, config: str, args: list[str], tmp_path: Path,
                   torchrun: list[str] = TWO) -> tuple[subprocess.Popen, str, float]:
    """Launch `recipe run --nproc-per-node 2`, call `act(launcher)` until it returns True (it acted: a kill, a
    signal): (the launcher, what it printed, seconds from the act to its exit)."""
    log = open(tmp_path / "launch.log", "w")  # noqa: SIM115 (closed below; the children write to it)
    proc = subprocess.Popen([sys.executable, "-m", "llm_recipe.cli.main", "run", *torchrun, recipe, "--config", config,
                             *args],
                            cwd=tmp_path, env=rc.cli_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline, acted_at = time.monotonic() + 600, None
    try:
        while proc.poll() is None and time.monotonic() < deadline and acted_at is None:
            if act(proc):
                acted_at = time.monotonic()
            time.sleep(0.01)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "launch.log").read_text()
    assert acted_at is not None, f"finished before it could be interrupted:\n{text[-3000:]}"
    return proc, text, time.monotonic() - acted_at


def kill_rank_1_after_a_checkpoint(recipe: str, config: str, args: list[str], out: Path,
                                   tmp_path: Path) -> tuple[subprocess.Popen, str, float]:
    """kill -9 rank 1 once a checkpoint is complete (`launch_two_and`)."""
    def kill(launcher: subprocess.Popen) -> bool:
        victim = _worker_pid(launcher.pid, 1) if rc.complete_checkpoints(out) else None
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
        return victim is not None

    return launch_two_and(kill, recipe, config, args, tmp_path)


def test_killed_rank_stops_the_run_with_one_line_and_resume_matches_uninterrupted(pair, tiny_model_dir, tmp_path):
    """Kill -9 rank 1 of a 2-process LoRA run after its first (sharded) checkpoint: the launcher exits within a
    minute (no hang in a collective) with a last line naming rank 1 and the signal; resumed on 2 processes, the
    final weights, adapter and logged losses equal the uninterrupted 2-process run's exactly."""
    _, ref = pair("lora")
    recipe, config, overrides = cases(tiny_model_dir)["lora"]
    out = tmp_path / "crashed"
    args = [*overrides, "batch_size=2", f"output_dir={out}"]
    proc, text, waited = kill_rank_1_after_a_checkpoint(recipe, config, args, out, tmp_path)
    assert waited < 60, "the other rank hung after rank 1 died"
    assert proc.returncode == 1 and not (out / "model").exists(), text[-3000:]
    last = [ln for ln in text.splitlines() if ln.strip()][-1]
    assert last.startswith("recipe: error: rank 1 was killed by SIGKILL") and "resume=true" in last, last
    killed_at_step = int(rc.complete_checkpoints(out)[-1].name.split("_")[1])
    assert 1 <= killed_at_step < STEPS
    time.sleep(1)  # let the killed workers' ports close before the next rendezvous
    run(recipe, config, [*args, "resume=true"], tmp_path, TWO)
    rc.assert_same_weights(out / "model", ref / "model")
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (out, ref))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed, uninterrupted = rc.read_metrics(out), rc.read_metrics(ref)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]



@pytest.mark.parametrize("signum", [pytest.param(signal.SIGTERM, id="sigterm"),
                                    pytest.param(signal.SIGINT, id="ctrl-c", marks=pytest.mark.slow)])
def test_signal_to_the_launcher_checkpoints_every_rank_at_one_step(tiny_model_dir, tmp_path, signum):
    """SIGTERM (what SLURM sends at a job's time limit) or Ctrl-C to `recipe run --nproc-per-node 2`: the ranks
    finish the same step, write its sharded checkpoint (off the save cadence) and the launcher exits 128 + the
    signal with rank 0's one line, no traceback; resume=true continues from that step. torchrun alone stopped the
    workers at once: a SignalException traceback, exit 1, no checkpoint."""
    signal_the_launcher(tiny_model_dir, tmp_path, signum, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_sigterm_to_the_launcher_on_two_gpus(tiny_model_dir, tmp_path):
    """The same on 2 GPUs: the stop flag rides in the step's NCCL reduction."""
    signal_the_launcher(tiny_model_dir, tmp_path, signal.SIGTERM, "cuda")



@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_killed_rank_on_two_gpus_stops_the_other_at_once(tiny_model_dir, tmp_path):
    """kill -9 of rank 1 on 2 GPUs: rank 0, blocked in an NCCL collective with a dead peer, dies on torchrun's
    SIGTERM at once (a Python handler for it would only run once the collective returned: torchrun's SIGKILL 30 s
    later, reported as an out-of-memory kill); one line names rank 1 and the signal."""
    recipe, config, overrides = cases(tiny_model_dir)["lora"]
    out = tmp_path / "out"
    args = [*(o.replace("device=cpu", "device=cuda") for o in overrides), "batch_size=2", f"output_dir={out}",
            "max_steps=400"]
    _, text, waited = kill_rank_1_after_a_checkpoint(recipe, config, args, out, tmp_path)
    assert waited < 20, text[-3000:]
    last = [ln for ln in text.splitlines() if ln.strip()][-1]
    assert last.startswith("recipe: error: rank 1 was killed by SIGKILL") and "torchrun then stopped rank(s) 0" in last, last


def test_ctrl_c_to_a_one_process_torchrun_launch_checkpoints(tiny_model_dir, tmp_path):
    """`--nproc-per-node 1` (or `gpu` on a one-GPU machine): the launcher's forwarded Ctrl-C is taken as in a
    plain one-process run (it was a KeyboardInterrupt at once: no checkpoint)."""
    recipe, config, overrides = cases(tiny_model_dir)["lora"]
    out = tmp_path / "out"
    args = [*overrides, "batch_size=2", f"output_dir={out}", "max_steps=40", "save_every_n_steps=null"]

    def after_step_1(launcher: subprocess.Popen) -> bool:
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text():
            os.kill(launcher.pid, signal.SIGINT)
            return True
        return False

    proc, text, _ = launch_two_and(after_step_1, recipe, config, args, tmp_path, ["--nproc-per-node", "1",
                                                                                  "--standalone"])
    assert proc.returncode == 130, text[-3000:]
    (ckpt,) = rc.complete_checkpoints(out)
    said = [ln for ln in text.splitlines() if ln.startswith("recipe: ")]
    assert said[-1].startswith(f"recipe: interrupted after step {int(ckpt.name.split('_')[1])}: checkpoint "), said


def signal_the_launcher(tiny_model_dir: Path, tmp_path: Path, signum: int, device: str) -> None:
    from llm_recipe.components.checkpoint.manifest import verify_manifest

    recipe, config, overrides = cases(tiny_model_dir)["lora"]
    out = tmp_path / "out"
    args = [*(o.replace("device=cpu", f"device={device}") for o in overrides), "batch_size=2", f"output_dir={out}",
            "max_steps=40", "save_every_n_steps=null"]
    metrics = out / "metrics.jsonl"

    def after_step_1(launcher: subprocess.Popen) -> bool:  # the launcher only, as `kill PID` or a terminal's Ctrl-C
        if metrics.exists() and metrics.read_text():
            os.kill(launcher.pid, signum)
            return True
        return False

    proc, text, _ = launch_two_and(after_step_1, recipe, config, args, tmp_path)
    assert proc.returncode == 128 + signum, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    (ckpt,) = rc.complete_checkpoints(out)  # the interrupt's: save_every_n_steps=null writes no other
    step = int(ckpt.name.split("_")[1])
    assert 1 <= step < 40
    last = [ln for ln in text.splitlines() if ln.strip()][-1]
    assert last.startswith(f"recipe: interrupted after step {step}: checkpoint ") and "resume=true" in last, last
    assert text.count("recipe: interrupted") == 1, text[-3000:]  # rank 0 says it; the launcher adds nothing
    assert sorted(p.name for p in (ckpt / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    verify_manifest(ckpt)
    assert [r["step"] for r in rc.read_metrics(out)] == list(range(1, step + 1))
    assert not (out / "model").exists()
    # resumed on 1 process: one line saying to relaunch on 2, before any shard loads
    one = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", recipe, "--config", config, *args,
                          "resume=true"], cwd=tmp_path, env=rc.cli_env(), capture_output=True, text=True, timeout=300)
    assert one.returncode == 1 and one.stderr.splitlines()[-1] == (
        f"recipe: error: {ckpt} was written by a run on 2 processes and this one has 1: resume=true continues on the "
        "same count; relaunch as `recipe run --nproc-per-node 2 --standalone <recipe> ...` (one machine), or start "
        "a new run in another output_dir"), one.stderr[-2000:]
    assert "Warning" not in one.stderr
    # on 3: the launcher says it before any rank starts (each rank said it after loading, between torchrun's lines);
    # on a 2-GPU machine 3 ranks on cuda are refused first, for want of a third GPU
    three = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", "--nproc-per-node", "3", "--standalone",
                            recipe, "--config", config, *args, "resume=true"], cwd=tmp_path, env=rc.cli_env(),
                           capture_output=True, text=True, timeout=300)
    said = (f"recipe: error: {ckpt} was written by a run on 2 processes and this one has 3: resume=true continues on "
            "the same count; relaunch as `recipe run --nproc-per-node 2 --standalone <recipe> ...` (one machine), or "
            "start a new run in another output_dir") if device == "cpu" or torch.cuda.device_count() >= 3 else (
            "recipe: error: 3 processes on device='cuda', but only 2 GPU(s) are visible: one GPU per process "
            "(--nproc-per-node)")
    assert three.returncode == 1 and three.stderr.strip() == said, three.stderr[-2000:]
    time.sleep(1)  # let the workers' ports close before the next rendezvous
    run(recipe, config, [*args, "resume=true", f"max_steps={step + 1}"], tmp_path, TWO)
    assert [r["step"] for r in rc.read_metrics(out)] == list(range(1, step + 2))
    assert (out / "model" / "model.safetensors").exists()

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~2 min (two launchers + the 2-process reference run)
def test_two_nodes_on_one_host_match_two_processes(pair, tiny_model_dir, tmp_path):
    """`recipe run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT kd ...` started
    twice (as on two machines; here both on localhost) trains the KD student of the 2-process run."""
    _, ref = pair("kd_full")
    recipe, config, overrides = cases(tiny_model_dir)["kd_full"]
    out = tmp_path / "two_nodes"
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"localhost:{_free_port()}", "--rdzv-id", "recipe-test"]
    cmd = [sys.executable, "-m", "llm_recipe.cli.main", "run", *launch, recipe, "--config", config, *overrides, "batch_size=2",
           f"output_dir={out}"]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=rc.cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [n.communicate(timeout=900)[0] for n in nodes]
    for n, text in zip(nodes, logs, strict=True):
        assert n.returncode == 0, text[-4000:]
    assert_close_weights(ref / "model", out / "model", atol=1e-6)
    assert [r["loss"] for r in rc.read_metrics(out)] == pytest.approx([r["loss"] for r in rc.read_metrics(ref)],
                                                                        rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("case", ["lora", "kd_dora", "kd_full", "qat"])
@pytest.mark.parametrize("compile", [False, True])
def test_two_gpus_match_one(case, compile, tiny_model_dir, tmp_path):
    """The CPU cases above on 2 GPUs (NCCL), eager and compiled: finish, match 1 GPU, adapters load in PEFT."""
    recipe, config, overrides = cases(tiny_model_dir)[case]
    overrides = [o.replace("device=cpu", "device=cuda") for o in overrides] + [f"compile={str(compile).lower()}"]
    one, two = tmp_path / "one", tmp_path / "two"
    run(recipe, config, [*overrides, "batch_size=4", f"output_dir={one}"], tmp_path)
    run(recipe, config, [*overrides, "batch_size=2", f"output_dir={two}"], tmp_path, TWO)
    if case == "qat":  # fake quantization is discontinuous: compare the updates, as the CPU test does
        assert_close_updates(one / "model", two / "model", tiny_model_dir)
        assert_checkpoints_match(one, two, tmp_path, close=lambda a, b: assert_close_updates(a, b, tiny_model_dir))
        return
    assert_close_weights(one / "model", two / "model", atol=1e-4)
    if (one / "adapter").is_dir():
        assert_adapter(one, two, tiny_model_dir)
    assert_checkpoints_match(one, two, tmp_path)


@pytest.mark.slow  # ~2 min: lm-eval imports and task building in 3 processes
def test_eval_two_processes_split_requests_and_match_one(tiny_model_dir, tmp_path):
    """`recipe run --nproc-per-node 2 eval ...`: lm-eval gives each rank half the requests (its log says so per
    rank) and rank 0 reports the same metrics as one process."""
    import json

    args = [f"model.checkpoint_dir={tiny_model_dir}", "limit=8", "tasks=[recipe_copa]", "device=cpu",
            "log_samples=true"]
    run("eval", "eval/smollm2", [*args, f"output_dir={tmp_path / 'one'}"], tmp_path)
    run("eval", "eval/smollm2", [*args, f"output_dir={tmp_path / 'two'}"], tmp_path, TWO)
    one, two = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert one["results"] == two["results"] and one["results"]["recipe_copa"]["sample_len"] == 8
    # both ranks' per-item samples were gathered on rank 0: the 8 items, each once
    assert sorted(s["doc_id"] for s in two["samples"]["recipe_copa"]) == list(range(8))


@pytest.mark.slow  # ~35 s: a 2-process QLoRA run; the default suite converts sharded LoRA checkpoints (test_lora_two_processes_match_one)
def test_a_sharded_qlora_checkpoint_converts_to_the_runs_model(tmp_path, tiny_model_dir):
    """QLoRA on 2 processes: its checkpoints leave the frozen NF4 base out, and converting one with `--base` gives
    the weights the run's own `model/` holds at that step (the NF4-rounded base in the run's dtype plus the merged
    adapter), not the adapter on the unrounded base. 256-wide projections: NF4 shards evenly over 2 ranks."""
    model = rc.make_llama(tmp_path / "m256", tiny_model_dir, seed=5, hidden=256, intermediate=512, layers=1,
                          heads=4, kv_heads=4)
    out = tmp_path / "qlora"
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "run", *TWO, "lora", "--config", "lora/smollm2",
                           *TRAIN, f"model.checkpoint_dir={model}", LORA, "lora.quantize_base=nf4",
                           "save_every_n_steps=1", f"output_dir={out}"], cwd=tmp_path, env=rc.cli_env(),
                          capture_output=True, text=True, timeout=600)
    rc.assert_ok(proc)
    # the final export gathers the NF4 base on every rank and waits for each part (components/fsdp.py)
    assert "unwaited collective" not in proc.stderr
    last = rc.complete_checkpoints(out)[-1]
    assert last.name == f"step_{STEPS:06d}"
    converted = tmp_path / "converted"
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.components.checkpoint.sharded", str(last), str(converted),
                           "--base", str(model)], env=rc.cli_env(), capture_output=True, text=True, timeout=300)
    rc.assert_ok(proc)
    got, want = rc.weights(converted), rc.weights(out / "model")
    assert set(got) == set(want)
    for k, w in want.items():
        assert got[k].dtype == w.dtype, k
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
