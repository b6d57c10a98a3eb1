"""Issue 24, items 3 and 4: every file we read is checked before it is used (one line naming the file and the line
or tensor), and `recipe lm_eval` turns unknown or unreachable tasks into one line, with no 30 s of retries.

Each test names the docs/reliability.md row it pins (section "Input files, lm_eval and install") and reads the
message from there."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import reliability_doc as doc
import torch

SMALL = ["device=cpu", "dtype=fp32", "max_steps=1", "batch_size=2", "dataset.limit=8", "dataset.max_seq_len=32",
         "save_every_n_steps=null", "tensorboard=false"]


def one_error(code: int, err: str) -> str:
    errors = [ln for ln in err.splitlines() if ln.startswith("recipe: error:")]
    assert code == 1 and "Traceback" not in err and len(errors) == 1, err
    return errors[0]


def _small_vocab_model(path: Path, embedded: Path, vocab: int = 1000) -> Path:
    """A tiny random Llama whose config.json and weights agree on `vocab` rows, with SmolLM2's 49152-id tokenizer."""
    from llm_recipe.components.models import ModelArgs, build_model, save_model

    args = ModelArgs.from_hf_config({
        "model_type": "llama", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True})
    torch.manual_seed(0)
    save_model(build_model(args), args, path, tokenizer_dir=embedded)
    return path


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ----------------------------------------------------------------------------------------------- encodings


@pytest.mark.parametrize("row_id,name,data", [
    ("data-utf8", "latin1.jsonl", b'{"text": "a first passage"}\n{"text": "caf\xe9 au lait"}\n'),
    ("data-utf8-csv", "latin1.csv", b"text\na first passage\ncaf\xe9 au lait\n"),
])
def test_data_file_that_is_not_utf8_names_file_line_and_column(row_id, name, data, tmp_path, monkeypatch, capsys,
                                                               tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_bytes(data)
    code, _, err = doc.run_cli(["run", "full", "--config", "full/smollm2", f"model.checkpoint_dir={tiny_model_dir}",
                         f"output_dir={tmp_path}/out", f"dataset.source={tmp_path}/{name}", "dataset.format=text",
                         *SMALL], capsys)
    doc.expect(row_id, one_error(code, err), tmp=tmp_path)


def test_config_file_that_is_not_utf8_names_its_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"# a kd config\nkd:\n  loss: forward_kl  # r\xe9sum\xe9\n")
    code, _, err = doc.run_cli(["validate", "latin1.yaml", "--recipe", "kd"], capsys)
    doc.expect("config-utf8", one_error(code, err), tmp=tmp_path)


@pytest.mark.parametrize("recipe,config,model_key,extra", [
    ("kd", "kd/smollm2_demo", "teacher.checkpoint_dir", ["student.prune=null"]),  # the teacher would load first
    ("full", "full/smollm2", "model.checkpoint_dir", []),
    ("lora", "lora/smollm2", "model.checkpoint_dir", []),
    ("qat", "qat/smollm2", "model.checkpoint_dir", []),
])
@pytest.mark.parametrize("key", ["data_files", "source"])
def test_a_data_file_that_is_not_there_fails_before_any_weights_load(recipe, config, model_key, extra, key, tmp_path,
                                                                   monkeypatch, capsys, tiny_model_dir):
    """A missing `dataset.data_files` entry (or `dataset.source` path) was found only when the data was built,
    after the weights loaded (minutes for an 8B teacher): now it is the recipe's first check, the same line for
    every training recipe, naming the key, the override and the path."""
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "missing.jsonl"
    data = ["dataset.source=json", f"dataset.data_files={missing}"] if key == "data_files" else [
        f"dataset.source={missing}"]
    code, out, err = doc.run_cli(["run", recipe, "--config", config, f"{model_key}={tiny_model_dir}",
                                  f"output_dir={tmp_path}/out", "dataset.format=text", *data, *SMALL, *extra], capsys)
    assert "setup:" not in out, out  # nothing was loaded: no data, layers or weights phase began
    assert one_error(code, err) == (f"recipe: error: override '{data[-1]}': key 'dataset.{key}': no such file or "
                                    f"directory: {missing}")


@pytest.mark.parametrize("recipe,config", [("full", "full/smollm2"), ("lora", "lora/smollm2")])
def test_a_bad_data_row_fails_before_the_weights_load(recipe, config, tmp_path, monkeypatch, capsys, tiny_model_dir):
    """full / lora / qat tokenized their rows after the weights loaded (minutes for an 8B QLoRA base): a bad row
    is now one line before them, as kd's."""
    monkeypatch.chdir(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "response": "d"}\n')
    code, out, err = doc.run_cli(["run", recipe, "--config", config, f"model.checkpoint_dir={tiny_model_dir}",
                                  f"output_dir={tmp_path}/out", f"dataset.source={rows}", "dataset.format=instruct",
                                  *SMALL], capsys)
    assert "setup: data ..." in out and "setup: weights" not in out, out
    assert one_error(code, err) == f"recipe: error: {rows}:2: missing column 'output'; row has instruction, response"


# ----------------------------------------------------------------------------------------------- config.json vs weights


def test_config_vocab_size_that_disagrees_with_the_weights_names_tensor_key_and_shapes(tiny_model_dir, tmp_path,
                                                                                      monkeypatch, capsys):
    bad = _edit_config(tiny_model_dir, tmp_path / "bad", vocab_size=1000)
    monkeypatch.chdir(tmp_path)
    code, _, err = doc.run_cli(["run", "generate", "--config", "generate/smollm2", f"model.checkpoint_dir={bad}",
                         "device=cpu", "prompt=hi", "max_new_tokens=2"], capsys)
    line = one_error(code, err)
    assert "size mismatch" not in err
    doc.expect("config-vocab-weights", line, dir=bad)


def test_config_with_fewer_layers_than_the_weights_is_refused_before_building(tiny_model_dir, tmp_path):
    from llm_recipe.components.errors import RecipeError
    from llm_recipe.components.models import load_model

    bad = _edit_config(tiny_model_dir, tmp_path / "bad", num_hidden_layers=3)
    with pytest.raises(RecipeError) as e:
        load_model(bad)
    doc.expect("config-layers-weights", f"recipe: error: {e.value}", dir=bad)


def test_a_checkpoint_that_matches_its_config_passes(tiny_model_dir):
    from llm_recipe.components.models.args import check_weight_shapes

    check_weight_shapes(tiny_model_dir)


# ----------------------------------------------------------------------------------------------- tokenizers, kd


def test_pruned_student_with_another_vocabulary_is_refused_before_layer_scoring(embedded_model_dir, tmp_path,
                                                                               monkeypatch, capsys):
    """kd/smollm2_demo scores layers (student.prune): the vocabulary check comes first, on every config path."""
    import llm_recipe.components.models.prune as prune

    student = _small_vocab_model(tmp_path / "student", embedded_model_dir)

    def no_scoring(*a, **k):
        raise AssertionError("layer scoring ran before the vocabulary check")

    monkeypatch.setattr(prune, "score_layers", no_scoring)
    monkeypatch.chdir(tmp_path)
    # the same line with and without importance scoring (keep 3 of the student's 4 layers: the shipped keep, 20, is
    # itself refused at load against its config.json)
    for extra in (["student.prune.keep=3"], ["student.prune=null"]):
        code, _, err = doc.run_cli(["run", "kd", "--config", "kd/smollm2_demo", f"student.checkpoint_dir={student}",
                             f"output_dir={tmp_path}/out", *SMALL, *extra], capsys)
        doc.expect("kd-student-vocab", one_error(code, err), student=student)
    assert not (tmp_path / "out" / "layer_importance.json").exists()


def test_different_tokenizers_are_refused_before_layer_scoring(tiny_model_dir, embedded_model_dir, tmp_path,
                                                               monkeypatch, capsys):
    import llm_recipe.components.models.prune as prune

    student = tmp_path / "student"
    shutil.copytree(tiny_model_dir, student)
    tok = json.loads((student / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 49152, "content": "<|other|>"})
    (student / "tokenizer.json").write_text(json.dumps(tok))
    cfg = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**cfg, "vocab_size": 49152}))
    monkeypatch.setattr(prune, "score_layers", lambda *a, **k: pytest.fail("layer scoring ran first"))
    monkeypatch.chdir(tmp_path)
    code, _, err = doc.run_cli(["run", "kd", "--config", "kd/smollm2_demo", f"teacher.checkpoint_dir={embedded_model_dir}",
                         f"student.checkpoint_dir={student}", f"output_dir={tmp_path}/out", "student.prune.keep=3",
                         *SMALL], capsys)
    line = doc.expect("kd-tokenizers-differ", one_error(code, err), student=student, teacher=embedded_model_dir)
    # `recipe validate` reads the same files where the folders are here, and gives the same line
    code, _, err = doc.run_cli(["validate", "kd/smollm2_demo", f"teacher.checkpoint_dir={embedded_model_dir}",
                                f"student.checkpoint_dir={student}", "student.prune.keep=3"], capsys)
    assert one_error(code, err) == line


def test_eval_of_a_model_smaller_than_its_tokenizer_is_one_line(embedded_model_dir, tmp_path):
    from llm_recipe.components.errors import RecipeError
    from llm_recipe.components.quantization import load_checkpoint

    small = _small_vocab_model(tmp_path / "small", embedded_model_dir)
    with pytest.raises(RecipeError) as e:
        load_checkpoint(small)
    doc.expect("model-vocab-tokenizer", f"recipe: error: {e.value}", dir=small)


# ----------------------------------------------------------------------------------------------- lm_eval


def _lm_eval(args: list[str], cwd: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and "proxy" not in k.lower()}
    base.update(OMP_NUM_THREADS="1", HF_HOME=str(cwd / "hf_home"), **env)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llm_recipe.cli.main", "lm_eval", *args], cwd=cwd, env=base,
                          capture_output=True, text=True, timeout=300)
    return proc, time.monotonic() - start


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lm_eval_unknown_task_is_one_line(tiny_model_dir, tmp_path):
    proc, _ = _lm_eval(["--model", "recipe", "--model_args", f"checkpoint={tiny_model_dir}", "--tasks", "nope_task",
                        "--limit", "1", "--device", "cpu"], tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    doc.expect("lm-eval-unknown-task", proc.stderr)


def test_lm_eval_stock_task_with_the_hub_unreachable_fails_at_once(tiny_model_dir, tmp_path):
    """A stock task whose data is not cached, the Hub not answering: no 30 s of retries, one line."""
    proc, took = _lm_eval(["--model", "recipe", "--model_args", f"checkpoint={tiny_model_dir}", "--tasks",
                           "hellaswag", "--limit", "1", "--device", "cpu"], tmp_path,
                          HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "note: the Hugging Face Hub does not answer: running offline" in proc.stderr
    doc.expect("lm-eval-offline-task", proc.stderr)
    # the Hub's retries would log "Retrying in Ns" and add 30 s+ of backoff; the bound leaves room for a loaded machine
    assert "Retrying" not in proc.stderr and took < 60, f"{took:.0f} s: retried the Hub"


def test_lm_eval_missing_checkpoint_fails_before_lm_eval_starts(tmp_path):
    """A wrong checkpoint folder is the whole of stderr: no lm-eval task setup logged before the error."""
    proc, _ = _lm_eval(["--model", "recipe", "--model_args", f"checkpoint={tmp_path / 'nope'}", "--tasks",
                        "recipe_copa", "--limit", "2", "--device", "cpu"], tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Selected Tasks" not in proc.stderr and "Initializing" not in proc.stderr, proc.stderr[-3000:]
    doc.expect("lm-eval-missing-checkpoint", proc.stderr, dir=tmp_path / "nope")


@pytest.mark.slow  # ~20 s on 2 cores (a whole lm-eval run) for a filtered log line: `make test-all` runs it
def test_lm_eval_outside_a_git_repository_prints_no_git_error(tiny_model_dir, tmp_path):
    from llm_recipe.components.eval.quiet import in_git_work_tree

    if in_git_work_tree(tmp_path):
        pytest.skip("the temp folder is inside a git work tree")
    proc, _ = _lm_eval(["--model", "recipe", "--model_args", f"checkpoint={tiny_model_dir}", "--tasks", "recipe_copa",
                        "--limit", "2", "--device", "cpu", "--batch_size", "2"], tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe_copa" in proc.stdout and "Running loglikelihood" in proc.stderr  # the rest of stderr still shows
    assert doc.row("lm-eval-git").id == "lm-eval-git"
    assert "not a git repository" not in proc.stderr, proc.stderr[-2000:]


def test_the_stderr_filter_drops_only_the_git_line(tmp_path, monkeypatch, capfd):
    from llm_recipe.components.eval import quiet

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(quiet, "in_git_work_tree", lambda path=None: False)
    with quiet.no_git_noise():
        os.write(2, b"before\nprogress 50%\r")
        subprocess.run(["sh", "-c", "echo 'fatal: not a git repository (or any of the parent directories): .git' >&2"])
        os.write(2, b"progress 100%\nafter\n")
    err = capfd.readouterr().err
    assert err == "before\nprogress 50%\rprogress 100%\nafter\n", err
    # the same bytes in one read (as under load, when the pump lags): the bar's \r-line and the git line together
    with quiet.no_git_noise():
        os.write(2, b"before\nprogress 50%\rfatal: not a git repository (or any of the parent directories): .git\n"
                    b"progress 100%\nafter\n")
    err = capfd.readouterr().err
    assert err == "before\nprogress 50%\rprogress 100%\nafter\n", err


def test_a_split_name_a_local_file_does_not_have_is_an_error(tmp_path):
    """A .jsonl file is one split, `train` (as datasets.load_dataset reads it): `split: test` used to train on the
    whole file in silence; slices of `train` pick rows."""
    from llm_recipe.components.data import sources
    from llm_recipe.components.errors import RecipeError

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(10)))
    with pytest.raises(RecipeError, match=r"dataset.split: 'test', but .*rows.jsonl is one file, whose rows are the "
                                          r"split 'train'"):
        sources.load_rows(str(path), split="test")
    assert len(sources.load_rows(str(path), split="train[80%:]")) == 2
