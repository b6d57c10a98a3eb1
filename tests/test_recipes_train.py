"""The training recipes (full, kd, qat; lora in test_recipes_lora.py) end to end through `recipe run`, on tiny
random models with SmolLM2's tokenizer: the files a run writes, what other tools (transformers, peft, torchao)
read from them, the logged losses against independent references, every optimizer, every KD divergence, QAT's
delay and convert, config errors, and every shipped training config.

One run per recipe goes through a fresh `python -m llm_recipe.cli.main run ...` subprocess (exit codes, one-line errors,
nothing shared with pytest); the variants call the same `llm_recipe.cli.main.main` in-process to save ~5 s of imports each.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import recipes_common as rc
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IGNORE = -100
STEP_KEYS = rc.STEP_KEYS
KD_KEYS = STEP_KEYS | {"ce_loss", "kd_loss"}
LR = rc.LR


def first_window(config: str, overrides: list[str], accum: int) -> list[dict]:
    """The micro-batches of optimizer step 1, rebuilt from the run's own dataset settings and seed."""
    from omegaconf import OmegaConf

    from llm_recipe.components.config import load_config
    from llm_recipe.components.data.dataset import build_dataset, build_loader
    from llm_recipe.components.models.tokenizer import Tokenizer

    cfg = load_config(config, overrides)
    model_dir = cfg.model.checkpoint_dir if "model" in cfg else (cfg.student.checkpoint_dir or cfg.teacher.checkpoint_dir)
    ds = build_dataset(Tokenizer.from_dir(model_dir), **OmegaConf.to_container(cfg.dataset, resolve=True))
    it = iter(build_loader(ds, cfg.batch_size, seed=cfg.seed))
    return [next(it) for _ in range(accum)]


hf_model, assert_loads_like_hf, assert_peft_matches_merged = (rc.hf_model, rc.assert_loads_like_hf,
                                                          rc.assert_peft_matches_merged)


# ------------------------------------------------------------------------------------------------ models
@pytest.fixture(scope="module")
def kd_teacher(tmp_path_factory, embedded_model_dir) -> Path:
    """An untied random tiny Llama: a teacher whose distributions differ from the tiny (tied) student's."""
    return rc.make_llama(tmp_path_factory.mktemp("kd") / "teacher", embedded_model_dir, seed=1, tied=False)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir):
    """The full recipe in a subprocess: 3 steps of 2 accumulated micro-batches, a checkpoint at step 2."""
    work = tmp_path_factory.mktemp("full")
    out = work / "out"
    overrides = [*rc.COMMON, f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={out}", "max_steps=3",
                 "gradient_accumulation_steps=2", "save_every_n_steps=2", *LR]
    proc = rc.run_cli("full", "full/smollm2", overrides, cwd=work)
    rc.assert_ok(proc)
    return out, overrides, proc


# ------------------------------------------------------------------------------------------------ full
def test_full_recipe_writes_a_model_transformers_loads(full_run, tiny_model_dir):
    out, _, proc = full_run
    assert f"model: {out}/model" in proc.stdout
    # setup says what it does and how long each part took, then when the first step ended (counted from launch)
    assert re.search(r"setup: weights: [0-9.]+ s", proc.stdout) and "setup: optimizer ..." in proc.stdout
    # every part from the launch on: the process's start-up (imports, config) first, then each phase in order
    m = re.search(r"setup: first optimizer step done ([0-9.]+) s after launch \([0-9.]+ s after setup began\): "
                  r"start-up \(Python, imports, config\) ([0-9.]+) s, device ([0-9.]+) s, tokenizer and run folder "
                  r"([0-9.]+) s, data ([0-9.]+) s, weights ([0-9.]+) s, optimizer ([0-9.]+) s, step 1 ([0-9.]+) s\n",
                  proc.stdout)
    assert m, proc.stdout
    total, *parts = map(float, m.groups())
    if sys.platform == "linux":  # the launch from /proc (elsewhere: the log's creation, start-up ~0)
        assert float(m.group(2)) > 0.5  # importing torch alone takes longer: the launch is the process's start
    assert total - 1.0 <= sum(parts) <= total + 0.4  # the parts (each rounded) account for the time since launch
    assert [p.name for p in rc.complete_checkpoints(out)] == ["step_000002", "step_000003"]
    for ckpt in rc.complete_checkpoints(out):
        assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file()
        assert (ckpt / "tokenizer.json").is_file() and (ckpt / "recipe_state" / "state.json").is_file()
    rc.assert_metrics(out, 3, STEP_KEYS)
    rc.assert_png(out / "loss.png")
    # The final model is the last step's weights, it trained, and transformers reads it like we do.
    rc.assert_same_weights(out / "model", out / "checkpoints" / "step_000003")
    before, after = rc.weights(tiny_model_dir), rc.weights(out / "model")
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])
    assert_loads_like_hf(out / "model")


def test_full_recipe_logs_the_window_mean_cross_entropy(full_run, tiny_model_dir):
    # Step 1's loss is the initial model's cross-entropy over every target token of the accumulation window
    # (summed over both micro-batches, divided by their total target count), computed here with transformers.
    out, overrides, _ = full_run
    window = first_window("full/smollm2", overrides, accum=2)
    hf = hf_model(tiny_model_dir)
    total, n = 0.0, 0
    with torch.no_grad():
        for b in window:
            logits = hf(b["tokens"]).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE, reduction="sum"))
            n += int((b["labels"] != IGNORE).sum())
    logged = rc.read_metrics(out)[0]["loss"]
    assert logged == pytest.approx(total / n, rel=1e-5)


def test_logged_lr_is_the_rate_each_step_used(tmp_path, tiny_model_dir, capsys):
    """metrics.jsonl's lr at step N is the learning rate step N's update used: with 2 warmup steps to 1e-3 that is
    5e-4, 1e-3, then the cosine from 1e-3 (it used to log the rate of the step after: 1e-3, 1e-3, 5e-4, 0). A run
    shorter than its warmup says that its rate never reaches optimizer.lr."""
    for recipe, config, extra in (("full", "full/smollm2", [f"model.checkpoint_dir={tiny_model_dir}"]),
                                  ("kd", "kd/smollm2_demo", [f"teacher.checkpoint_dir={tiny_model_dir}",
                                                             "student.every=null", "student.prune=null"])):
        out = tmp_path / recipe
        assert rc.run_in_process(recipe, config, [*rc.COMMON, *extra, f"output_dir={out}", "max_steps=4",
                                                  "optimizer.lr=1e-3", "lr_scheduler.name=cosine",
                                                  "lr_scheduler.warmup_steps=2", "lr_scheduler.min_lr_ratio=0.0",
                                                  "save_every_n_steps=null"]) == 0
        lrs = [r["lr"] for r in rc.read_metrics(out)]
        assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4], abs=1e-12), (recipe, lrs)
    assert "warmup_steps" not in capsys.readouterr().out
    assert rc.run_in_process("full", "full/smollm2", [*rc.COMMON, f"model.checkpoint_dir={tiny_model_dir}",
                                                      f"output_dir={tmp_path / 'short'}", "max_steps=2",
                                                      "lr_scheduler.warmup_steps=3"]) == 0
    assert ("note: lr_scheduler.warmup_steps=3 >= the run's 2 optimizer steps: the learning rate never reaches "
            "optimizer.lr") in capsys.readouterr().out


@pytest.mark.parametrize("name, state_type, tol", [
    pytest.param("AdamW8bit", "torchao.optim.subclass_8bit.OptimState8bit", 0.05),
    pytest.param("AdamW4bit", "torchao.optim.subclass_4bit.OptimState4bit", 0.25, marks=pytest.mark.slow),
    pytest.param("AdamWFp8", "torchao.optim.subclass_fp8.OptimStateFp8", 0.05, marks=pytest.mark.slow),
])
def test_low_bit_optimizers_train_like_adamw(tmp_path, tiny_model_dir, name, state_type, tol):
    # torchao's low-bit AdamW keeps quantized moments only for tensors of >= 4096 elements (a multiple of its
    # block size); the tiny model's q/o/gate/up/down projections (4096-8192) and embedding qualify, its k/v
    # projections (2048) and norms keep fp32 moments. Its step is torch.compiled: the first step takes tens of
    # seconds on a cold CPU cache.
    def run(opt: str) -> Path:
        out = tmp_path / opt.rsplit(".", 1)[-1]
        code = rc.run_in_process("full", "full/smollm2", [
            *rc.COMMON, f"model.checkpoint_dir={tiny_model_dir}", f"output_dir={out}", "max_steps=2", *LR,
            f"optimizer._component_={opt}"])
        assert code == 0
        return out

    ref, low = run("torch.optim.AdamW"), run(f"torchao.optim.{name}")
    rc.assert_metrics(low, 2, STEP_KEYS)
    state = (low / "checkpoints" / "step_000002" / "recipe_state" / "state.json").read_text()
    assert f'"__subclass__": "{state_type}"' in state
    # Two steps move each weight by at most ~2 * lr with either optimizer, and the low-bit updates follow the
    # fp32 ones: the typical (median) gap is a small part of the typical step. Medians, because block-wise
    # quantized second moments make a few outliers (measured with AdamW8bit: 2 embedding elements of 3.1M moved
    # ~0.5: a tiny v rounded to zero next to large ones in its block; bitsandbytes keeps embedding states in
    # 32 bits for this reason). Measured median gap / median step: 8bit and fp8 <= 0.005, 4bit <= 0.1.
    w0, wr, wl = rc.weights(tiny_model_dir), rc.weights(ref / "model"), rc.weights(low / "model")
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        step = (wr[key] - w0[key]).abs()
        assert 0 < step.max() <= 2.2e-3, key
        moved = step > 0  # embedding rows of tokens not in the batches have no gradient
        gap, low_step = (wl[key] - wr[key]).abs()[moved], (wl[key] - w0[key]).abs()[moved]
        assert gap.median() < tol * step[moved].median(), key
        assert low_step.median() > 0.5 * step[moved].median(), key


# ------------------------------------------------------------------------------------------------ kd
def kd_overrides(out: Path, teacher: Path, student: Path | None, *extra: str) -> list[str]:
    return [*rc.KD_COMMON, f"teacher.checkpoint_dir={teacher}",
            f"student.checkpoint_dir={student if student is not None else 'null'}", f"output_dir={out}",
            "max_steps=2", "dataset.packed=false", *LR, *extra]


@pytest.fixture(scope="module")
def kd_forward(tmp_path_factory, tiny_model_dir, kd_teacher):
    """KD (forward KL) of the tiny model (full student) from kd_teacher, in a subprocess, with the 8B config's
    `teacher.quantize: auto` (on a CPU: the exact teacher). Returns (output_dir, overrides, what it printed)."""
    work = tmp_path_factory.mktemp("kd")
    out = work / "out"
    overrides = kd_overrides(out, kd_teacher, tiny_model_dir, "kd.loss=forward_kl", "teacher.quantize=auto")
    proc = rc.run_cli("kd", "kd/smollm2_demo", overrides, cwd=work)
    rc.assert_ok(proc)
    return out, overrides, proc.stdout


def test_kd_recipe_logs_ce_and_kd_against_references(kd_forward, tiny_model_dir, kd_teacher):
    out, overrides, printed = kd_forward
    # teacher.quantize=auto on a CPU is the run-dtype teacher, said in one line; the references below check it is
    assert ("teacher.quantize=auto: null, the teacher runs in the run dtype: the teacher is on the CPU (fp8 matmuls "
            "need compute capability >= 8.9)\n") in printed
    rows = rc.assert_metrics(out, 2, KD_KEYS)
    rc.assert_png(out / "loss.png")
    assert_loads_like_hf(out / "model")
    for r in rows:  # loss = (1 - kd_ratio) * CE + kd_ratio * KD, kd_ratio 0.5 (rc.KD_COMMON)
        assert r["loss"] == pytest.approx(0.5 * r["ce_loss"] + 0.5 * r["kd_loss"], rel=1e-5)
    # Step 1 from transformers' logits: mean over target tokens of CE and of KL(p_teacher || p_student).
    (batch,) = first_window("kd/smollm2_demo", overrides, accum=1)
    with torch.no_grad():
        s = hf_model(tiny_model_dir)(batch["tokens"]).logits.flatten(0, 1).log_softmax(-1)
        t = hf_model(kd_teacher)(batch["tokens"]).logits.flatten(0, 1).log_softmax(-1)
    valid = batch["labels"].flatten() != IGNORE
    ce = F.nll_loss(s[valid], batch["labels"].flatten()[valid])
    kl = (t[valid].exp() * (t[valid] - s[valid])).sum(-1).mean()
    assert rows[0]["ce_loss"] == pytest.approx(float(ce), rel=1e-5)
    assert rows[0]["kd_loss"] == pytest.approx(float(kl), rel=1e-4)
    assert rows[0]["kd_loss"] > 0.1  # two different random models: a real divergence


def test_kd_loss_kinds(tmp_path, kd_forward, tiny_model_dir, kd_teacher):
    # Same student, teacher, data and seed: step 1's losses relate as the divergences' definitions say.
    fwd = rc.read_metrics(kd_forward[0])[0]

    def step1(kind: str, *extra: str) -> dict:
        out = tmp_path / kind
        code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, kd_teacher, tiny_model_dir,
                                                                      f"kd.loss={kind}", "max_steps=1", *extra))
        assert code == 0
        (row,) = rc.assert_metrics(out, 1, KD_KEYS)
        assert row["ce_loss"] == pytest.approx(fwd["ce_loss"], rel=1e-5)  # same batch, same student
        return row

    rev = step1("reverse_kl")["kd_loss"]
    sym = step1("symmetric_kl", "kd.ratio=0.25")["kd_loss"]
    jsd = step1("jsd", "kd.beta=0.3")["kd_loss"]
    skew = step1("skew_kl", "kd.alpha=0.2")["kd_loss"]
    f = fwd["kd_loss"]
    assert rev > 0.1 and abs(rev - f) > 1e-3 * f
    assert sym == pytest.approx(0.25 * f + 0.75 * rev, rel=1e-4)
    # Generalised JSD is bounded by the binary entropy of its mixture weight (per token).
    assert 0 < jsd < -(0.3 * math.log(0.3) + 0.7 * math.log(0.7))
    # Skew KL(p_T || a p_T + (1 - a) p_S) <= (1 - a) KL(p_T || p_S) (convexity), and is not the plain KL.
    assert 0 < skew < 0.8 * f


def test_kd_qat_student_trains_through_fake_quantizers(tmp_path, kd_forward, tiny_model_dir, kd_teacher):
    # KD-QAT: same student, teacher, batch and seed as kd_forward, but the student's linears are fake-quantized
    # (8da4w) from step 1, so its CE differs; the folder carries quantization.json for convert / 8da4w evals.
    out = tmp_path / "out"
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, kd_teacher, tiny_model_dir, "kd.loss=forward_kl",
                                                                  "max_steps=1", "qat={scheme: 8da4w, group_size: 32}"))
    assert code == 0
    (row,) = rc.assert_metrics(out, 1, KD_KEYS)
    plain = rc.read_metrics(kd_forward[0])[0]["ce_loss"]
    assert abs(row["ce_loss"] - plain) > 1e-4 * plain
    meta = json.loads((out / "model" / "quantization.json").read_text())
    assert meta["method"] == "qat" and meta["scheme"] == "8da4w" and meta["group_size"] == 32
    assert_loads_like_hf(out / "model")


@pytest.mark.parametrize("convert", [True, False])
def test_kd_qat_ends_as_the_qat_recipe_does(tmp_path, kd_teacher, capsys, convert):
    """KD-QAT reads qat.convert as `recipe run qat` does: true (the default) converts the trained, layer-pruned
    student into output_dir/quantized, the PTQ of its saved weights; false writes none and prints the command that
    converts it later. It used to end with fake-quantized float weights and no word about either."""
    out = tmp_path / "out"
    qat = "qat={scheme: 8da4w, group_size: 32}" if convert else "qat={scheme: 8da4w, group_size: 32, convert: false}"
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, kd_teacher, None, "student.keep_layers=[0,3]",
                                                                  "max_steps=1", qat))
    assert code == 0
    printed = capsys.readouterr().out
    assert f"student (QAT-trained weights + quantization.json): {out}/model\n" in printed
    if convert:
        assert f"quantized (8da4w): {out}/quantized\n" in printed
        assert_quantized_export(out)
    else:
        assert not (out / "quantized").exists()
        assert (f"qat.convert=false: convert it with `recipe run quantize --config quantize/smollm2_8da4w "
                f"model.checkpoint_dir={out}/model output_dir={out}/quantize scheme=8da4w group_size=32`\n") in printed


def test_kd_layer_pruned_student(tmp_path, tiny_model_dir, capsys):
    # lr 1e-30 (0 is refused) keeps the initial student bit for bit: updates of that size round away in fp32.
    # Teacher layers 0 and 3 become student layers 0 and 1, the rest is shared.
    out = tmp_path / "out"
    # (an int8 teacher, the quantization CPUs run: setup times it apart from the weights)
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, tiny_model_dir, None, "student.keep_layers=[0,3]",
                                                                  "optimizer.lr=1e-30", "teacher.quantize=int8_weight_only"))
    assert code == 0
    printed = capsys.readouterr().out
    assert "student: 2 of 4 teacher layers kept: [0, 3]" in printed
    assert "setup: teacher weights ..." in printed and "setup: first optimizer step done" in printed
    assert re.search(r"teacher weights [0-9.]+ s, teacher int8_weight_only [0-9.]+ s, student weights", printed)
    cfg = json.loads((out / "model" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    teacher, student = rc.weights(tiny_model_dir), rc.weights(out / "model")
    expected = {}
    for k, v in teacher.items():
        if k.startswith("model.layers."):
            i = int(k.split(".")[2])
            if i in (0, 3):
                expected[k.replace(f"layers.{i}.", f"layers.{[0, 3].index(i)}.")] = v
        else:
            expected[k] = v
    assert student.keys() == expected.keys()
    assert all(torch.equal(student[k], expected[k]) for k in expected)
    assert_loads_like_hf(out / "model")


def test_kd_lora_student(tmp_path, tiny_model_dir, kd_teacher):
    out = tmp_path / "out"
    lora = "lora={rank: 4, alpha: 8.0, dropout: 0.0, targets: [q_proj, v_proj, down_proj], use_dora: false, quantize_base: false}"
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, kd_teacher, tiny_model_dir, lora))
    assert code == 0
    rc.assert_metrics(out, 2, KD_KEYS)
    assert_peft_matches_merged(tiny_model_dir, out)


def test_kd_pruned_lora_student_writes_the_merged_model_only(tmp_path, tiny_model_dir, capsys):
    # every=2 of 4 layers keeps [0, 2, 3] (every second layer plus the last). Its adapters would apply to no
    # existing base folder, so only the merged model is written.
    out = tmp_path / "out"
    lora = "lora={rank: 4, alpha: 8.0, dropout: 0.0, targets: [q_proj], use_dora: false, quantize_base: false}"
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, tiny_model_dir, None, lora, "student.every=2",
                                                                  "max_steps=1"))
    assert code == 0
    printed = capsys.readouterr().out
    assert "student: 3 of 4 teacher layers kept: [0, 2, 3]" in printed and "adapter: not written" in printed
    assert not (out / "adapter").exists()
    assert json.loads((out / "model" / "config.json").read_text())["num_hidden_layers"] == 3
    teacher, student = rc.weights(tiny_model_dir), rc.weights(out / "model")
    for i, t in enumerate([0, 2, 3]):  # frozen (non-target) weights are the kept teacher layers'
        k = "model.layers.{}.self_attn.k_proj.weight"
        assert torch.equal(student[k.format(i)], teacher[k.format(t)])
    q = "model.layers.{}.self_attn.q_proj.weight"
    assert not torch.equal(student[q.format(1)], teacher[q.format(2)])  # the merged adapter trained
    assert_loads_like_hf(out / "model")


def test_kd_teacher_vocab_padding_is_trimmed(tmp_path, kd_forward, tiny_model_dir, kd_teacher, capsys):
    # The teacher's head gets 64 extra rows past the tokenizer (like Qwen's 151936 vs 151665), with large
    # weights: if they were not sliced off, they would dominate the teacher's softmax and change the KD loss.
    from safetensors.torch import save_file

    padded = tmp_path / "padded"
    shutil.copytree(kd_teacher, padded)
    w = rc.weights(kd_teacher)
    emb = w["model.embed_tokens.weight"]
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        w[k] = torch.cat([w[k], 10 * torch.randn(64, emb.shape[1])])
    save_file(w, str(padded / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((padded / "config.json").read_text())
    cfg["vocab_size"] = emb.shape[0] + 64
    (padded / "config.json").write_text(json.dumps(cfg))

    out = tmp_path / "out"
    capsys.readouterr()
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_overrides(out, padded, tiny_model_dir, "kd.loss=forward_kl",
                                                                  "max_steps=1"))
    assert code == 0
    printed = capsys.readouterr()
    assert "differ only by padding" in printed.out + printed.err
    (row,) = rc.read_metrics(out)
    assert row["kd_loss"] == pytest.approx(rc.read_metrics(kd_forward[0])[0]["kd_loss"], rel=1e-4)


def test_kd_tokenizer_mismatch_fails_before_training(tmp_path, tiny_model_dir, kd_teacher):
    other = tmp_path / "other_tokenizer"
    shutil.copytree(kd_teacher, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"  # same size, two ids swapped: the ids no longer mean the same tokens
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "out"
    proc = rc.run_cli("kd", "kd/smollm2_demo", kd_overrides(out, other, tiny_model_dir), cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = rc.error_lines(proc)
    assert "tokenizers differ" in line
    assert not (out / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------ qat
def qat_overrides(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return [*rc.COMMON, f"model.checkpoint_dir={model_dir}", f"output_dir={out}", "max_steps=2", *LR, *extra]


def assert_quantized_export(out: Path) -> None:
    """output_dir/quantized holds the PTQ of the trained float model: load_hf_torchao and transformers agree."""
    from llm_recipe.components.models import load_model
    from llm_recipe.components.quantization import quantize_model
    from llm_recipe.components.quantization.export_hf import load_hf_torchao

    meta = json.loads((out / "model" / "quantization.json").read_text())
    assert "8da4w" in json.dumps(meta)
    tokens = rc.sample_tokens()
    qmodel, args = load_hf_torchao(out / "quantized")
    assert type(qmodel.layers[0].attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    ref, _ = load_model(out / "model")
    quantize_model(ref.eval(), "8da4w", group_size=32)
    with torch.no_grad():
        ours = qmodel(tokens)
        torch.testing.assert_close(ours, ref(tokens), rtol=0, atol=1e-5)
    torch.testing.assert_close(rc.hf_logits(out / "quantized", tokens), ours, rtol=0, atol=1e-4)


def test_qat_recipe_delays_fake_quant_and_converts(tmp_path, full_run, tiny_model_dir):
    # With fake quantization off for the first optimizer step, step 1 is the full recipe's step 1 exactly
    # (same model, data, seed and accumulation); convert then writes a torchao folder.
    out = tmp_path / "out"
    proc = rc.run_cli("qat", "qat/smollm2", qat_overrides(tiny_model_dir, out, "gradient_accumulation_steps=2",
                                                          "qat.fake_quant_after_n_steps=1"), cwd=tmp_path)
    rc.assert_ok(proc)
    # said where the step's time and memory change
    assert "qat: fake quantization on from step 2 (the first 1 trained without it)" in proc.stdout + proc.stderr
    assert "never turns on" not in proc.stdout + proc.stderr
    rows = rc.assert_metrics(out, 2, STEP_KEYS)
    rc.assert_png(out / "loss.png")
    assert rows[0]["loss"] == pytest.approx(rc.read_metrics(full_run[0])[0]["loss"], rel=1e-6)
    assert_loads_like_hf(out / "model")
    assert_quantized_export(out)


def test_a_qat_run_shorter_than_its_delay_says_it_never_fake_quantizes(tmp_path, full_run, tiny_model_dir):
    # A run shortened with max_steps (as the README suggests on a CPU) that ends before fake quantization would
    # turn on is plain training: the log says so instead of calling the result QAT-trained in silence.
    out = tmp_path / "out"
    proc = rc.run_cli("qat", "qat/smollm2", qat_overrides(tiny_model_dir, out, "gradient_accumulation_steps=2",
                                                          "qat.fake_quant_after_n_steps=2", "qat.convert=false"),
                      cwd=tmp_path)
    rc.assert_ok(proc)
    assert ("note: fake quantization never turns on: qat.fake_quant_after_n_steps=2 and the run has 2 steps"
            in proc.stdout + proc.stderr)
    rows = rc.assert_metrics(out, 2, STEP_KEYS)
    assert rows[0]["loss"] == pytest.approx(rc.read_metrics(full_run[0])[0]["loss"], rel=1e-6)


def test_qat_without_delay_fake_quantizes_from_step_1(tmp_path, full_run, tiny_model_dir):
    out = tmp_path / "out"
    code = rc.run_in_process("qat", "qat/smollm2", qat_overrides(tiny_model_dir, out, "gradient_accumulation_steps=2",
                                                                 "qat.fake_quant_after_n_steps=null", "max_steps=1",
                                                                 "qat.convert=false"))
    assert code == 0
    full1 = rc.read_metrics(full_run[0])[0]["loss"]
    assert abs(rc.read_metrics(out)[0]["loss"] - full1) > 1e-4 * full1  # measured ~8e-4 relative
    assert not (out / "quantized").exists()


def test_qat_with_lora_converts_the_merged_model(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    lora = "lora={rank: 4, alpha: 8.0, dropout: 0.0, targets: [q_proj, v_proj, gate_proj], use_dora: false, quantize_base: false}"
    code = rc.run_in_process("qat", "qat/smollm2", qat_overrides(tiny_model_dir, out, lora, "qat.fake_quant_after_n_steps=null"))
    assert code == 0
    rc.assert_metrics(out, 2, STEP_KEYS)
    assert (out / "adapter" / "adapter_config.json").is_file()
    before, after = rc.weights(tiny_model_dir), rc.weights(out / "model")
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(before["model.layers.0.self_attn.k_proj.weight"], after["model.layers.0.self_attn.k_proj.weight"])
    assert_quantized_export(out)


# ------------------------------------------------------------------------------------------------ config errors
@pytest.mark.parametrize("insert_after, line, key", [("seed: 0", "learning_rate: 0.1", "learning_rate"),
                                                     ("  max_seq_len: 256", "  max_len: 64", "dataset.max_len")])
def test_unknown_key_in_a_copied_config(tmp_path, insert_after, line, key):
    src = rc.REPO / "configs" / "full" / "smollm2.yaml"
    lines = src.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith(insert_after)) + 1
    lines.insert(at, line)
    cfg = tmp_path / "my_full.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    proc = rc.run_cli("full", str(cfg), [f"output_dir={tmp_path / 'out'}"], cwd=tmp_path)
    assert proc.returncode == 1
    (err,) = rc.error_lines(proc)
    assert f"my_full.yaml:{at + 1}: unknown key '{key}'" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ shipped configs
@pytest.mark.slow
@pytest.mark.parametrize("config", ["full/smollm2", "lora/smollm2", "kd/smollm2_demo", "qat/smollm2"])
def test_shipped_config_runs_on_the_embedded_model(tmp_path, config):
    # The shipped configs as users run them (embedded SmolLM2-135M via ${embedded_model:}), only shortened.
    out = tmp_path / "out"
    proc = rc.run_cli(config.split("/")[0], config, [f"output_dir={out}", "device=cpu", "max_steps=2",
                                                     "dataset.limit=16", "batch_size=2", "save_every_n_steps=null"],
                      cwd=tmp_path)
    rc.assert_ok(proc)
    rc.assert_metrics(out, 2, KD_KEYS if config.startswith("kd") else STEP_KEYS)
    assert_loads_like_hf(out / "model")
    if config.startswith("qat"):
        assert_quantized_export(out)
