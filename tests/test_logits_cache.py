"""The offline teacher end to end: the shipped config writes a sampled cache of 32 draws per token by default, from
which any kd.loss but forward_kl is a one-line error. `recipe run kd_logits ... cache.mode=topk` writes the
teacher's top-k at T (<= 200 bytes/token), a kill -9 mid-write then a rerun gives the same shards, `kd` trains
from it without the teacher, and every bad cache (incomplete, truncated, altered, another teacher, another run) is
a one-line error before anything trains. A sampled cache (`cache.mode=sampled`, the embedded SmolLM2 as teacher)
holds the teacher's seeded draws, the same whatever the batch and chunking, and `kd` trains from it with forward KL
only. The quality comparison with online KD on the embedded model is slow-marked."""

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

from llm_recipe.components.models.attention import document_mask

DATA = ["device=cpu", "dtype=fp32", "dataset.max_seq_len=48", "dataset.limit=24"]
BASE = [*DATA, "cache.items_per_shard=2", "batch_size=2", "num_output_chunks=2"]
CACHE = [*BASE, "cache.mode=topk"]  # the top-k tests pin the mode: the shipped default is sampled
KD = [*rc.KD_COMMON, "dataset.limit=24", "max_steps=2", "optimizer.lr=1e-3", "lr_scheduler.name=constant"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, embedded_model_dir) -> Path:
    # Wide enough (and untied) that writing 12 shards takes long enough to be killed mid-way.
    return rc.make_llama(tmp_path_factory.mktemp("lc") / "teacher", embedded_model_dir, seed=1, hidden=256,
                         intermediate=512, tied=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, teacher) -> Path:
    out = tmp_path_factory.mktemp("lc") / "cache"
    proc = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*CACHE, f"teacher.checkpoint_dir={teacher}",
                                                              f"output_dir={out}"], cwd=out.parent)
    rc.assert_ok(proc)
    assert "bytes/token at k=32" in proc.stdout
    return out


def test_cache_holds_the_teachers_top_k_within_200_bytes_per_token(cache, teacher):
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.logits_cache.manifest import unpack_ids
    from llm_recipe.components.losses.topk import teacher_topk
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer

    m = json.loads((cache / "manifest.json").read_text())
    assert m["complete"] and m["num_shards"] == 12 and m["top_k"] == 32
    assert m["payload_bytes_per_token"] == 162 and m["bytes_per_token"] <= 200
    ds = build_dataset(Tokenizer.from_dir(teacher), source="transfer:passages", max_seq_len=48, limit=24, packed=True)
    assert m["tokens"] == ds.num_loss_tokens()
    model, _ = load_model(teacher)
    batch = ds.collate([ds[2], ds[3]])  # shard 1
    with torch.no_grad():
        logits = model(batch["tokens"], mask=document_mask(batch["input_pos"]),
                       input_pos=batch["input_pos"]).flatten(0, 1)
    ref_v, ref_i, ref_t = teacher_topk(logits[batch["labels"].flatten() != -100], 32)
    shard = load_file(str(cache / "shard_00001.safetensors"))
    assert torch.equal(unpack_ids(shard["ids"]), ref_i)
    torch.testing.assert_close(shard["logprobs"].float(), ref_v, rtol=1e-3, atol=1e-3)  # fp16 storage
    torch.testing.assert_close(shard["tail"].float(), ref_t, rtol=1e-3, atol=1e-3)
    assert shard["offsets"].tolist() == [0, *torch.cumsum((batch["labels"] != -100).sum(1), 0).tolist()]


def test_kill_9_while_writing_then_rerun_gives_identical_shards(tmp_path, cache, teacher):
    out = tmp_path / "cache"
    args = ["run", "kd_logits", "--config", "kd_logits/smollm2_demo", *CACHE, f"teacher.checkpoint_dir={teacher}",
            f"output_dir={out}"]
    log = open(tmp_path / "killed.log", "w")  # noqa: SIM115 (closed below; the child writes to it)
    proc = subprocess.Popen([sys.executable, "-m", "llm_recipe.cli.main", *args], cwd=tmp_path, env=rc.cli_env(),
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if json.loads((out / "manifest.json").read_text())["shards"]:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
            time.sleep(0.002)
    finally:
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    killed = json.loads((out / "manifest.json").read_text())
    assert not killed["complete"] and 0 < len(killed["shards"]) < 12
    (out / "shard_00011.safetensors").write_bytes(b"half a shard")  # as if killed mid-write without the rename
    rerun = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*CACHE, f"teacher.checkpoint_dir={teacher}",
                                                               f"output_dir={out}"], cwd=tmp_path)
    rc.assert_ok(rerun)
    assert f"resuming: {len(killed['shards'])} of 12 shards" in rerun.stdout
    for i in range(12):
        name = f"shard_{i:05d}.safetensors"
        assert (out / name).read_bytes() == (cache / name).read_bytes(), name
    assert json.loads((out / "manifest.json").read_text())["shards"] == json.loads(
        (cache / "manifest.json").read_text())["shards"]


def test_teacher_embedding_on_the_host_writes_the_same_shards(tmp_path, cache, teacher, monkeypatch, capsys):
    """The cache writer with the teacher's embedding on the host (forced on this CPU run, as prepare_teacher does
    on a GPU): byte for byte the same shards."""
    from llm_recipe.components.models import host_embedding

    monkeypatch.setattr(host_embedding, "why_not_on_host", lambda model, device: None)
    out = tmp_path / "cache"
    assert rc.run_in_process("kd_logits", "kd_logits/smollm2_demo", [*CACHE, f"teacher.checkpoint_dir={teacher}",
                                                                     f"output_dir={out}"]) == 0
    assert "teacher embeddings: on the host" in capsys.readouterr().out
    for i in range(12):
        name = f"shard_{i:05d}.safetensors"
        assert (out / name).read_bytes() == (cache / name).read_bytes(), name


def kd_args(out: Path, cache: Path, student: Path, *extra: str) -> list[str]:
    return [*KD, "teacher.checkpoint_dir=null", f"teacher.logits_dir={cache}", f"student.checkpoint_dir={student}",
            f"output_dir={out}", *extra]


def test_kd_trains_from_the_cache_without_the_teacher(tmp_path, cache, tiny_model_dir, teacher):
    out = tmp_path / "kd"
    proc = rc.run_cli("kd", "kd/smollm2_demo", kd_args(out, cache, tiny_model_dir), cwd=tmp_path)
    rc.assert_ok(proc)
    rows = rc.assert_metrics(out, 2, {"loss", "ce_loss", "kd_loss"})
    assert rows[0]["kd_loss"] > 0.1 and rows[0]["loss"] == pytest.approx(0.5 * rows[0]["ce_loss"]
                                                                          + 0.5 * rows[0]["kd_loss"], rel=1e-5)
    # Naming the teacher it was built from is fine too (its fingerprint matches); other kinds still train.
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_args(tmp_path / "jsd", cache, tiny_model_dir,
                                                              f"teacher.checkpoint_dir={teacher}", "kd.loss=jsd",
                                                              "kd.beta=0.5", "max_steps=1"))
    assert code == 0


def _error(capsys, tmp_path: Path, cache: Path, student: Path, *extra: str) -> str:
    out = tmp_path / "kd_bad"
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_args(out, cache, student, *extra))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("recipe: error:")]
    assert code == 1 and len(err) == 1, err
    assert not (out / "metrics.jsonl").exists()  # nothing trained
    return err[0]


@pytest.mark.parametrize("override,field", [
    ("dataset.max_seq_len=40", "dataset.max_seq_len"), ("dataset.packed=false", "dataset.packed"),
    ("dataset.limit=20", "dataset.limit"), ("kd.temperature=2.0", "kd.temperature"),
    ("dataset.source=transfer:chat", "dataset.source"),
])
def test_a_cache_of_another_run_is_a_one_line_error_naming_the_field(capsys, tmp_path, cache, tiny_model_dir,
                                                                     override, field):
    assert f"{field} differs" in _error(capsys, tmp_path, cache, tiny_model_dir, override)


def test_a_mismatched_cache_is_refused_before_the_student_layers_are_scored(capsys, tmp_path, cache,
                                                                             tiny_model_dir):
    """With student.prune the layer scoring takes seconds to minutes: a cache of another run fails first."""
    code = rc.run_in_process("kd", "kd/smollm2_demo", kd_args(tmp_path / "kd_bad", cache, tiny_model_dir,
                                                              "dataset.limit=20", "student.prune.keep=1"))
    log = capsys.readouterr()
    assert code == 1 and "recipe: error: teacher.logits_dir=" in log.err and "dataset.limit differs" in log.err
    assert "student layers" not in log.out + log.err, "the layers were scored before the cache was checked"


def test_other_tokenizer_and_other_teacher_are_refused(capsys, tmp_path, cache, tiny_copy, tiny_model_dir):
    cfg = json.loads((tiny_copy / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"] + "{# another template #}"
    (tiny_copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "tokenizer (tokenizer.json + chat template) differs" in _error(capsys, tmp_path, cache, tiny_copy)
    err = _error(capsys, tmp_path, cache, tiny_model_dir, f"teacher.checkpoint_dir={tiny_model_dir}")
    assert "is not the teacher the cache was built from" in err


def test_damaged_or_unfinished_caches_are_one_line_errors(capsys, tmp_path, cache, tiny_model_dir):
    bad = tmp_path / "bad"
    shutil.copytree(cache, bad)
    shard = bad / "shard_00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    assert "shard 3: shard_00003.safetensors is truncated" in _error(capsys, tmp_path, bad, tiny_model_dir)
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert "shard 3: shard_00003.safetensors fails its checksum" in _error(capsys, tmp_path, bad, tiny_model_dir)
    shard.unlink()
    assert "shard_00003.safetensors is missing" in _error(capsys, tmp_path, bad, tiny_model_dir)
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**m, "complete": False}))
    assert "the cache is incomplete" in _error(capsys, tmp_path, bad, tiny_model_dir)
    (bad / "manifest.json").write_text("{")
    assert "manifest.json: not valid JSON" in _error(capsys, tmp_path, bad, tiny_model_dir)


def test_rebuilding_into_a_cache_of_another_run_is_refused(tmp_path, cache, teacher):
    proc = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*CACHE, f"teacher.checkpoint_dir={teacher}",
                                                              f"output_dir={cache}", "cache.top_k=16"], cwd=tmp_path)
    (err,) = rc.error_lines(proc)
    assert "holds a cache built with other settings (cache.top_k: 32 in the cache, 16 now)" in err


def test_the_shipped_config_builds_a_sampled_cache_from_which_only_forward_kl_trains(capsys, tmp_path,
                                                                                     tiny_model_dir):
    """No cache.mode: 32 draws per token (the shipped and the typed default; docs/kd_study.md "Sampled cache"); kd
    with kd.loss=reverse_kl from it is one line naming kd.loss and cache.mode and how to rebuild the cache."""
    out = tmp_path / "default"
    proc = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*DATA, "batch_size=4", f"output_dir={out}"],
                      cwd=tmp_path)
    rc.assert_ok(proc)
    assert "bytes/token at 32 samples per token (at most 193: every draw distinct)" in proc.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert (m["mode"], m["samples"], m["payload_bytes_per_token"]) == ("sampled", 32, 193) and "top_k" not in m
    assert m["bytes_per_token"] < 193
    err = _error(capsys, tmp_path, out, tiny_model_dir, "kd.loss=reverse_kl")
    assert f"kd.loss=reverse_kl cannot be trained from teacher.logits_dir={out}: a sampled cache (cache.mode=sampled" in err
    assert "rebuild the cache with `recipe run kd_logits ... cache.mode=topk`" in err


SAMPLED = [*BASE, "cache.mode=sampled", "cache.samples=8"]


@pytest.fixture(scope="module")
def sampled_cache(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lc") / "sampled"
    proc = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*SAMPLED, f"output_dir={out}"], cwd=out.parent)
    rc.assert_ok(proc)
    assert "bytes/token at 8 samples per token (at most 49" in proc.stdout
    return out


def test_sampled_cache_holds_the_teachers_seeded_draws(tmp_path, sampled_cache, embedded_model_dir):
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.logits_cache import LogitsCache, item_uniforms
    from llm_recipe.components.losses.sampled import teacher_samples
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer

    m = json.loads((sampled_cache / "manifest.json").read_text())
    assert (m["mode"], m["samples"], m["sample_seed"], m["payload_bytes_per_token"]) == ("sampled", 8, 0, 49)
    assert "top_k" not in m and m["bytes_per_token"] < 49
    ds = build_dataset(Tokenizer.from_dir(embedded_model_dir), source="transfer:passages", max_seq_len=48, limit=24,
                       packed=True)
    model, _ = load_model(embedded_model_dir)
    cache = LogitsCache(sampled_cache)
    for item in (2, 3):
        batch = ds.collate([ds[item]])
        with torch.no_grad():
            logits = model(batch["tokens"], mask=document_mask(batch["input_pos"]),
                           input_pos=batch["input_pos"]).flatten(0, 1)[batch["labels"].flatten() != -100]
        logp, ids, counts = teacher_samples(logits, item_uniforms(0, item, logits.shape[0], 8))
        got_logp, got_ids, got_counts = cache.rows(item)
        assert torch.all(got_counts.sum(-1) == 8)
        assert (got_ids == ids).all(-1).float().mean() > 0.99 and (got_counts == counts).all(-1).float().mean() > 0.99
        torch.testing.assert_close(got_logp.float()[got_counts > 0], logp[got_counts > 0], rtol=1e-3, atol=2e-3)
    # Another batch size and chunking: the same uniforms per item, so the same draws wherever the teacher's logits
    # round the same. Batch shapes change float rounding (here up to one fp16 step of a stored log-prob), which moves
    # a draw that sits on a CDF boundary: 15 of 9,024 draws on a 2-core Xeon (AVX-512). Uniforms that followed the
    # batch would change nearly every draw. (The same settings give the same bytes: test_logits_cache_cli.py.)
    again = tmp_path / "again"
    rc.assert_ok(rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*SAMPLED, "batch_size=1", "num_output_chunks=3",
                                                                   f"output_dir={again}"], cwd=tmp_path))
    other = LogitsCache(again)
    draws = moved = 0
    for item in range(m["num_items"]):
        logp_a, ids_a, counts_a = cache.rows(item)
        logp_b, ids_b, counts_b = other.rows(item)
        same = ((ids_a == ids_b) & (counts_a == counts_b)).all(-1)
        for r in (~same).nonzero().flatten().tolist():
            a = {i: c for i, c in zip(ids_a[r].tolist(), counts_a[r].tolist(), strict=True) if c}
            b = {i: c for i, c in zip(ids_b[r].tolist(), counts_b[r].tolist(), strict=True) if c}
            moved += sum(abs(a.get(k, 0) - b.get(k, 0)) for k in a.keys() | b.keys()) // 2
        draws += int(counts_a.sum())
        kept = same.unsqueeze(-1) & (counts_a > 0)
        torch.testing.assert_close(logp_b.float()[kept], logp_a.float()[kept], rtol=1e-3, atol=2e-3)
    assert draws > 1000 and moved <= 0.005 * draws, (moved, draws)


def test_kd_trains_from_the_sampled_cache_with_forward_kl_only(capsys, tmp_path, sampled_cache, tiny_model_dir):
    out = tmp_path / "kd"
    rc.assert_ok(rc.run_cli("kd", "kd/smollm2_demo", kd_args(out, sampled_cache, tiny_model_dir), cwd=tmp_path))
    rows = rc.assert_metrics(out, 2, {"loss", "ce_loss", "kd_loss"})
    assert rows[0]["kd_loss"] > 0.1 and rows[0]["loss"] == pytest.approx(0.5 * rows[0]["ce_loss"]
                                                                          + 0.5 * rows[0]["kd_loss"], rel=1e-5)
    err = _error(capsys, tmp_path, sampled_cache, tiny_model_dir, "kd.loss=jsd", "kd.beta=0.5")
    assert f"kd.loss=jsd cannot be trained from teacher.logits_dir={sampled_cache}" in err
    assert "kd.temperature differs" in _error(capsys, tmp_path, sampled_cache, tiny_model_dir, "kd.temperature=2.0")
    bad = tmp_path / "bad"
    shutil.copytree(sampled_cache, bad)
    m = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**m, "mode": "dense"}))
    assert "cache.mode='dense' is not one this version reads" in _error(capsys, tmp_path, bad, tiny_model_dir)


def test_rebuilding_a_cache_with_another_mode_or_sample_count_is_refused(tmp_path, cache, sampled_cache, teacher):
    proc = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*SAMPLED, f"output_dir={sampled_cache}",
                                                              "cache.samples=16"], cwd=tmp_path)
    (err,) = rc.error_lines(proc)
    assert "holds a cache built with other settings (cache.samples: 8 in the cache, 16 now)" in err
    proc = rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*SAMPLED, f"teacher.checkpoint_dir={teacher}",
                                                              f"output_dir={cache}"], cwd=tmp_path)
    (err,) = rc.error_lines(proc)
    assert "holds a cache built with other settings (cache.mode: topk in the cache, sampled now)" in err


@pytest.mark.slow
def test_kd_from_the_top32_or_sampled_cache_matches_online_kd_on_the_embedded_model(tmp_path, embedded_model_dir,
                                                                                     tiny_model_dir):
    """SmolLM2-135M teaches the tiny student for 12 steps, online, from its top-32 cache and from a cache of 32
    draws per token: the students end within a few percent of each other on the full-vocabulary objective
    (CE + forward KL)."""
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.models import load_model
    from llm_recipe.components.models.tokenizer import Tokenizer

    data = ["dataset.max_seq_len=48", "dataset.limit=24"]
    cache = tmp_path / "cache"
    rc.assert_ok(rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*CACHE, *data, f"output_dir={cache}"],
                            cwd=tmp_path))
    sample = tmp_path / "sample"
    rc.assert_ok(rc.run_cli("kd_logits", "kd_logits/smollm2_demo", [*BASE, *data, f"output_dir={sample}",
                                                                    "cache.mode=sampled"], cwd=tmp_path))
    common = [*KD, *data, "max_steps=12", "batch_size=4", f"student.checkpoint_dir={tiny_model_dir}",
              "optimizer.lr=3e-3"]
    online, cached = tmp_path / "online", tmp_path / "cached"
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*common, f"output_dir={online}"]) == 0
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*common, f"output_dir={cached}",
                                                       f"teacher.logits_dir={cache}"]) == 0
    assert rc.run_in_process("kd", "kd/smollm2_demo", [*common, f"output_dir={tmp_path / 'sampled'}",
                                                       f"teacher.logits_dir={sample}"]) == 0
    ds = build_dataset(Tokenizer.from_dir(embedded_model_dir), source="transfer:passages", max_seq_len=48,
                       limit=24, packed=True)
    batch = ds.collate([ds[i] for i in range(len(ds))])
    valid = batch["labels"] != -100

    def logp(folder: Path) -> torch.Tensor:
        model, _ = load_model(folder)
        with torch.no_grad():
            return model(batch["tokens"], mask=document_mask(batch["input_pos"]),
                         input_pos=batch["input_pos"])[valid].log_softmax(-1)

    t = logp(embedded_model_dir)

    def objective(folder: Path) -> float:
        s = logp(folder)
        ce = -s.gather(1, batch["labels"][valid][:, None]).mean()
        return float(0.5 * ce + 0.5 * (t.exp() * (t - s)).sum(-1).mean())

    start, a, b = objective(tiny_model_dir), objective(online / "model"), objective(cached / "model")
    c = objective(tmp_path / "sampled" / "model")
    print(f"objective: start {start:.4f}, online {a:.4f}, top-32 cache {b:.4f}, sampled cache (N = 32) {c:.4f}")
    assert a < 0.8 * start and b < 0.8 * start and c < 0.8 * start  # all learnt
    assert b == pytest.approx(a, rel=0.05), (start, a, b)
    assert c == pytest.approx(a, rel=0.05), (start, a, c)


def test_a_collective_at_teacher_setup_needs_every_rank_to_have_a_shard():
    """kd_logits sets up its teacher (and broadcasts the fp8 drift decision) only on ranks with shards to write:
    with fewer shards left than ranks, a broadcast among the busy ones would hang, so it is skipped then."""
    from types import SimpleNamespace

    from llm_recipe.components.logits_cache.writer import CacheWriter

    w = CacheWriter.__new__(CacheWriter)  # the shard bookkeeping alone, without a folder
    w.header, w.rt, w.records = {"num_shards": 3}, SimpleNamespace(rank=0, world_size=2), {}
    assert w.todo() == [0, 2] and w.todo(1) == [1] and w.every_rank_has_work()
    w.records = {"1": {}}  # rank 1's only shard is written (a resumed build)
    assert w.todo() == [0, 2] and w.todo(1) == [] and not w.every_rank_has_work()
    w.rt = SimpleNamespace(rank=0, world_size=4)  # 3 shards on 4 ranks
    w.records = {}
    assert not w.every_rank_has_work()


def test_teacher_fingerprint_tells_apart_teachers_in_pytorch_model_bin(tmp_path, tiny_model_dir):
    """A folder with pytorch_model.bin instead of safetensors (hf_io reads both): two teachers with the same
    config.json and other weights get other fingerprints, so a cache of one is refused for the other."""
    from llm_recipe.components.logits_cache.manifest import teacher_fingerprint

    folders = []
    for i, scale in enumerate((1.0, 1.001)):
        d = tmp_path / f"bin{i}"
        d.mkdir()
        shutil.copy(tiny_model_dir / "config.json", d / "config.json")
        sd = {k: v * scale for k, v in load_file(tiny_model_dir / "model.safetensors").items()}
        torch.save(sd, d / "pytorch_model.bin")
        folders.append(d)
    assert teacher_fingerprint(folders[0]) != teacher_fingerprint(folders[1])
    assert teacher_fingerprint(folders[0]) == teacher_fingerprint(folders[0])


def test_a_teacher_head_padded_past_the_tokenizer_caches_the_tokenizers_tokens(tmp_path, embedded_model_dir,
                                                                              tiny_model_dir, capsys):
    """Qwen2.5-7B's head has 152064 rows for 151665 tokens, its small siblings' 151936: live KD slices both heads to
    the tokenizer, and so does the cache now (it kept the teacher's whole head, so kd refused every student with a
    smaller head, after scoring its layers and loading its weights)."""
    teacher = rc.make_llama(tmp_path / "padded", embedded_model_dir, seed=3, vocab=49152 + 64, tied=False)
    out = tmp_path / "cache"
    assert rc.run_in_process("kd_logits", "kd_logits/smollm2_demo",
                             [*CACHE, f"teacher.checkpoint_dir={teacher}", f"output_dir={out}"]) == 0
    assert ("the teacher's head has 49216 rows and the tokenizer 49152 tokens: the cache holds the distribution over "
            "the 49152 tokens") in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["vocab_size"] == 49152
    assert rc.run_in_process("kd", "kd/smollm2_demo", kd_args(tmp_path / "kd", out, tiny_model_dir, "max_steps=1")) == 0
    assert rc.read_metrics(tmp_path / "kd")[0]["kd_loss"] > 0
    # a cache whose vocabulary is larger than the student's head (one built before this, from a padded teacher) is
    # refused before the student's layers are scored or any weights load
    from llm_recipe.components.errors import RecipeError
    from llm_recipe.components.teacher import TeacherSettings, check_teacher_and_student

    old = tmp_path / "old_cache"
    old.mkdir()
    manifest = json.loads((out / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 49216}))
    with pytest.raises(RecipeError, match=r"the student's head has 49152 rows, fewer than the cache's vocabulary "
                                          r"\(49216 tokens\)"):
        check_teacher_and_student(TeacherSettings(logits_dir=str(old)), tiny_model_dir, 49152, "forward_kl")
