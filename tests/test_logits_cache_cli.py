"""`recipe run kd_logits` as a user meets it: a folder holding a cache of other settings is refused in one line that
names each differing key with both values and says `overwrite=true` replaces it; `overwrite=true` replaces any
cache, and puts the old one back when the build stops before its first shard (an error, Ctrl-C, or a kill, at the
next run); a cache of the same settings is left as it is; and the closing `recipe run kd ...` command, pasted, is
one that `kd` accepts with the cache (every cache check passes, and a tiny student trains from it)."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import recipes_common as rc

from llm_recipe.components.errors import RecipeError

# The embedded teacher on a few short rows: 8 items, 4 shards of 2, 8 draws per token.
SMALL = ["device=cpu", "dtype=fp32", "dataset.max_seq_len=48", "dataset.limit=8", "cache.items_per_shard=2",
         "batch_size=2", "num_output_chunks=2", "cache.samples=8"]


def build(out: Path, *extra: str) -> int:
    return rc.run_in_process("kd_logits", "kd_logits/smollm2_demo", [*SMALL, f"output_dir={out}", *extra])


def files(folder: Path) -> dict[str, bytes]:
    """Every file in `folder` (hidden ones included) by name, but the lock."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".recipe.lock"}


def errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("recipe: error:")]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A complete sampled cache of SMALL's settings; tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("klcli") / "cache"
    assert build(out) == 0
    return out


@pytest.fixture
def cache(built, tmp_path) -> Path:
    out = tmp_path / "cache"
    shutil.copytree(built, out)
    return out


def test_a_cache_of_other_settings_is_refused_naming_each_key_and_both_values(capsys, cache):
    before = files(cache)
    capsys.readouterr()
    assert build(cache, "dataset.limit=6", "cache.temperature=2.0") == 1
    (err,) = errors(capsys.readouterr().err)
    assert f"output_dir={cache} holds a cache built with other settings (" in err
    assert "dataset.limit: 8 in the cache, 6 now" in err and "cache.temperature: 1.0 in the cache, 2.0 now" in err
    assert "num_items" not in err and "sha256" not in err  # what follows from dataset.limit is not reported
    assert "overwrite=true replaces it" in err
    assert files(cache) == before


def test_overwrite_replaces_a_cache_of_other_settings_and_leaves_none_of_it(capsys, cache):
    capsys.readouterr()
    assert build(cache, "dataset.limit=6", "cache.items_per_shard=4", "overwrite=true") == 0
    out = capsys.readouterr().out
    assert f"overwrite=true: replacing the cache in {cache} (4 of 4 shards, complete)" in out
    m = json.loads((cache / "manifest.json").read_text())
    assert m["complete"] and m["run"]["dataset.limit"] == 6 and m["items_per_shard"] == 4
    names = sorted(files(cache))
    assert names == ["manifest.json", *(f"shard_{i:05d}.safetensors" for i in range(m["num_shards"]))]
    assert not [p for p in cache.iterdir() if p.is_dir()]  # nothing set aside is left


def test_a_cache_of_the_same_settings_is_kept_and_overwrite_builds_it_again(capsys, cache, built):
    capsys.readouterr()
    assert build(cache) == 0
    out = capsys.readouterr().out
    assert "already holds this cache, every shard verified: nothing to write (overwrite=true builds it again)" in out
    assert "teacher:" not in out  # the teacher never ran
    assert build(cache, "overwrite=true") == 0
    out = capsys.readouterr().out
    assert "overwrite=true: replacing the cache" in out and "target tokens to go in 4 shard(s)" in out
    assert files(cache) == files(built)  # the same bytes again


def test_auto_on_a_cpu_is_the_null_teacher_the_cache_was_built_with(capsys, cache, built):
    # the manifest records the precision this machine applies, never `auto`: the same targets, the same cache
    assert json.loads((built / "manifest.json").read_text())["teacher"]["quantize"] is None
    capsys.readouterr()
    assert build(cache, "teacher.quantize=auto") == 0
    out = capsys.readouterr().out
    assert "teacher.quantize=auto: null, the teacher runs in the run dtype: the teacher is on the CPU" in out
    assert "nothing to write" in out and files(cache) == files(built)


def _fail_teacher_load(*args, **kwargs):
    raise RecipeError("teacher.checkpoint_dir: model.safetensors is unreadable")


def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where,fault,code", [("load_model", _fail_teacher_load, 1), ("teacher_rows", _ctrl_c, 130)],
                         ids=["error-loading-the-teacher", "ctrl-c-in-the-first-shard"])
def test_overwrite_puts_the_old_cache_back_when_the_build_stops_before_its_first_shard(capsys, monkeypatch, cache,
                                                                                      where, fault, code):
    from llm_recipe.recipes import kd_logits

    before = files(cache)
    monkeypatch.setattr(kd_logits, where, fault)
    capsys.readouterr()
    assert build(cache, "dataset.limit=6", "overwrite=true") == code
    err = capsys.readouterr().err
    assert f"recipe: overwrite=true: the earlier cache in {cache} was put back as it was" in err
    assert files(cache) == before and not [p for p in cache.iterdir() if p.is_dir()]


def test_a_killed_overwrite_is_put_back_by_the_next_run(capsys, monkeypatch, cache):
    """kill -9 before the first shard (here: the in-process put-back turned off, which leaves the folder as a kill
    does): the next run in the folder finds the set-aside cache and puts it back."""
    from llm_recipe.components.logits_cache.writer import CacheWriter
    from llm_recipe.recipes import kd_logits

    before = files(cache)
    monkeypatch.setattr(kd_logits, "load_model", _fail_teacher_load)
    monkeypatch.setattr(CacheWriter, "put_back", lambda self: False)
    assert build(cache, "dataset.limit=6", "overwrite=true") == 1
    assert [p.name for p in cache.iterdir() if p.is_dir()][0].startswith(".overwritten-cache-")
    monkeypatch.undo()
    capsys.readouterr()
    assert build(cache) == 0
    out = capsys.readouterr().out
    assert "a build with overwrite=true was stopped before it wrote a shard: the cache it was replacing is back" in out
    assert "nothing to write" in out and files(cache) == before


# ------------------------------------------------------------------------------------------- the closing command


def closing_command(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    (i,) = [i for i, ln in enumerate(lines) if ln.startswith("train from it: ")]
    assert i + 1 == len(lines) or not lines[i + 1].startswith("  note:"), lines[i + 1]
    words = shlex.split(lines[i][len("train from it: "):])
    assert words[:4] == ["recipe", "run", "kd", "--config"], lines[i]
    return words[4:]


def check_kd_accepts(config: str, overrides: list[str]):
    """What `recipe run kd --config CONFIG OVERRIDES` checks of its cache before it trains, all of it: the config
    loads and validates, and the cache matches the run's teacher, tokenizer, loss, dataset keys, temperature and
    tokenized data (the checks kd runs: components/teacher.py, components/logits_cache/reader.py)."""
    from llm_recipe.components.config import load_recipe_config
    from llm_recipe.components.data.dataset import build_dataset
    from llm_recipe.components.folders import check_model_dir
    from llm_recipe.components.logits_cache import LogitsCache
    from llm_recipe.components.teacher import check_teacher_and_student
    from llm_recipe.components.training import load_tokenizer
    from llm_recipe.recipes.kd import CONFIG

    cfg = load_recipe_config(config, overrides, CONFIG, recipe="kd")
    student = cfg.student.checkpoint_dir or cfg.teacher.checkpoint_dir
    for folder in (student, cfg.teacher.checkpoint_dir):
        if folder is not None:
            check_model_dir(folder)
    tokenizer = load_tokenizer(student)
    check_teacher_and_student(cfg.teacher, student, tokenizer.vocab_size, cfg.kd.loss_fn().kind)
    cache = LogitsCache.for_run(cfg.teacher.logits_dir, cfg.dataset.kwargs(), student, cfg.teacher.checkpoint_dir,
                                cfg.kd.loss_fn().temperature)
    cache.dataset(build_dataset(tokenizer, cfg.dataset))
    return cfg


def test_the_closing_command_of_the_shipped_config_trains_from_the_cache(capsys, tmp_path, built, tiny_model_dir):
    capsys.readouterr()
    assert build(built) == 0  # the finished cache: nothing to write, and the command again
    words = closing_command(capsys.readouterr().out)
    config, overrides = words[0], words[1:]
    assert config == "kd/smollm2_demo" and f"teacher.logits_dir={built}" in overrides
    assert {"dataset.limit=8", "dataset.max_seq_len=48"} <= set(overrides)  # what differs from kd/smollm2_demo
    check_kd_accepts(config, overrides)
    # The command without them is refused, in one line saying what to add (values as YAML writes them).
    with pytest.raises(RecipeError, match="dataset.limit differs: the cache was built with 8, this run has null; "
                                          "train with dataset.limit=8 to use this cache, or build a cache"):
        check_kd_accepts(config, [f"teacher.logits_dir={built}"])
    # Pasted as is, with only what a test changes (a tiny student, one step on the CPU): kd trains from the cache.
    out = tmp_path / "kd"
    assert rc.run_in_process("kd", config, [*overrides, "device=cpu", "dtype=fp32", "max_steps=1", "student.prune=null",
                                            f"student.checkpoint_dir={tiny_model_dir}", f"output_dir={out}"]) == 0
    assert rc.read_metrics(out)[0]["kd_loss"] > 0


def test_the_closing_command_names_a_free_output_dir_when_the_kd_configs_own_holds_a_run(capsys, tmp_path,
                                                                                        monkeypatch, built):
    """The kd run the cache was built for often already ran in the kd config's output_dir, and a new run there is
    refused: the command then names a free folder beside it."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert build(built) == 0
    assert not [w for w in closing_command(capsys.readouterr().out) if w.startswith("output_dir=")]
    for taken in ("outputs/kd_smollm2_demo", "outputs/kd_smollm2_demo_from_cache"):
        (tmp_path / taken).mkdir(parents=True)
        (tmp_path / taken / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert build(built) == 0
    words = closing_command(capsys.readouterr().out)
    assert [w for w in words if w.startswith("output_dir=")] == ["output_dir=outputs/kd_smollm2_demo_from_cache_2"]
    check_kd_accepts(words[0], words[1:])


def test_the_closing_command_covers_teacher_temperature_and_loss(capsys, tmp_path, tmp_path_factory,
                                                                  embedded_model_dir):
    """A top-k cache of another teacher at T = 2 names the teacher and kd.temperature (and says so when the kd
    config's student cannot be cut from that teacher); a sampled cache with a kd config that trains jsd names
    kd.loss=forward_kl (without jsd's beta); with kd_config null the command carries every key the cache fixes and
    works with the shipped kd config in place of KD_CONFIG."""
    root = tmp_path_factory.mktemp("klcli")
    topk = ["cache.mode=topk", "cache.top_k=4", "cache.temperature=2.0"]
    capsys.readouterr()
    four = rc.make_llama(root / "four", embedded_model_dir, seed=3)  # kd/smollm2_demo keeps 20 of its layers
    assert build(tmp_path / "four", f"teacher.checkpoint_dir={four}", *topk) == 0
    out = capsys.readouterr().out
    assert "  note: kd refuses it as it stands (kd_config=kd/smollm2_demo: " in out and "student.prune.keep" in out
    teacher = rc.make_llama(root / "teacher", embedded_model_dir, seed=3, layers=24)
    assert build(tmp_path / "topk", f"teacher.checkpoint_dir={teacher}", *topk) == 0
    words = closing_command(capsys.readouterr().out)
    assert f"teacher.checkpoint_dir={teacher}" in words and "kd.temperature=2.0" in words
    check_kd_accepts(words[0], words[1:])

    jsd = tmp_path / "kd_jsd.yaml"
    text = (Path(__file__).parents[1] / "configs" / "kd" / "smollm2_demo.yaml").read_text()
    jsd.write_text(text.replace("loss: forward_kl ", "loss: jsd       ").replace("beta: null", "beta: 0.3 "))
    sampled = tmp_path / "sampled"
    assert build(sampled, f"kd_config={jsd}") == 0
    words = closing_command(capsys.readouterr().out)
    assert words[0] == str(jsd) and "kd.loss=forward_kl" in words and "kd.beta=null" in words
    check_kd_accepts(words[0], words[1:])

    assert build(sampled, "kd_config=null") == 0
    words = closing_command(capsys.readouterr().out)
    assert words[0] == "KD_CONFIG" and "dataset.source=transfer:passages" in words
    check_kd_accepts("kd/smollm2_demo", words[1:])


def test_a_kd_config_whose_folders_are_not_here_still_gets_its_command(capsys, tmp_path):
    """The shipped 8B kd_logits config names kd/llama3_1_8b_to_llama3_2_1b, whose default student and teacher folders
    a user who passed other paths has not downloaded: the built cache is kept, the run succeeds, and the closing
    command names the folders the cache was built with (it ended in "no tokenizer.json" after the build on a GPU)."""
    kd = tmp_path / "kd_elsewhere.yaml"
    text = (Path(__file__).parents[1] / "configs" / "kd" / "smollm2_demo.yaml").read_text()
    missing = tmp_path / "not_downloaded"
    text = text.replace("checkpoint_dir: ${embedded_model:}", f"checkpoint_dir: {missing / 'teacher'}")
    kd.write_text(text.replace("checkpoint_dir: null    ", f"checkpoint_dir: {missing / 'student'}", 1))
    capsys.readouterr()
    assert build(tmp_path / "c", f"kd_config={kd}") == 0
    words = closing_command(capsys.readouterr().out)
    teacher = [w for w in words if w.startswith("teacher.checkpoint_dir=")]
    student = [w for w in words if w.startswith("student.checkpoint_dir=")]
    assert len(teacher) == 1 and "not_downloaded" not in teacher[0]
    assert student == [teacher[0].replace("teacher.", "student.")]  # kd_logits tokenized with the teacher's folder
    assert (tmp_path / "c" / "manifest.json").is_file()


def test_a_kd_config_that_does_not_load_is_one_line_before_the_teacher_runs(capsys, tmp_path):
    capsys.readouterr()
    assert build(tmp_path / "c", "kd_config=kd/no_such_config") == 1
    log = capsys.readouterr()
    (err,) = errors(log.err)
    assert err.startswith("recipe: error: kd_config=kd/no_such_config: ")
    assert "teacher:" not in log.out and not (tmp_path / "c" / "manifest.json").exists()


def test_recipe_run_under_torchrun_checks_a_kd_logits_config_before_launching(tmp_path, monkeypatch):
    """`recipe run --nproc-per-node N kd_logits ...` validates once and launches (the training runs' pre-launch
    folder checks are for recipes with `resume`; kd_logits has `overwrite` only)."""
    from llm_recipe.cli import main as cli

    launched = []
    monkeypatch.setattr(cli, "launch_torchrun", lambda *a: launched.append(a) or 0)
    for value in ("false", "true"):
        assert cli.main(["run", "--nproc-per-node", "2", "kd_logits", "--config", "kd_logits/smollm2_demo",
                         f"output_dir={tmp_path}", f"overwrite={value}"]) == 0
    assert len(launched) == 2


@pytest.mark.parametrize("key,value", [
    ("dataset.split", "train[:90%]"), ("dataset.split", "null"), ("dataset.split", "1e5"), ("dataset.split", "a: b"),
    ("dataset.source", "transfer:passages"), ("dataset.source", "my data/file.jsonl"),
    ("dataset.column_map", {"text": "passage"}), ("dataset.data_files", ["a.json", "b.json"]),
    ("dataset.limit", None), ("dataset.limit", 500), ("dataset.packed", False), ("kd.temperature", 2.0),
])
def test_each_value_of_the_closing_command_reads_back_as_the_caches(key, value):
    """The command's overrides are shell words that `recipe run` types back into the cache's values."""
    from omegaconf import OmegaConf

    from llm_recipe.components.config import load_config
    from llm_recipe.components.logits_cache.manifest import override

    (word,) = shlex.split(override(key, value))
    got = OmegaConf.select(load_config("kd/smollm2_demo", [word]), key)
    assert (OmegaConf.to_container(got) if OmegaConf.is_config(got) else got) == value
