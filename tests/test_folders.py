"""The output_dir lock (components/folders.py), failed writes (components/checkpoint/atomic.py) and checkpoint
manifests (components/checkpoint/manifest.py), in-process and fast; whole runs are in test_faults.py."""

import errno
import json
import logging
import os
import subprocess
import sys

import pytest

from llm_recipe.components.checkpoint import atomic_directory, verify_manifest, write_manifest
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.folders import LOCK_NAME, check_model_dir, check_output_dir, lock_output_dir


def test_lock_is_exclusive_and_released(tmp_path):
    out = tmp_path / "run"
    with lock_output_dir(out) as lock:
        owner = json.loads(lock.read_text())
        assert owner["pid"] == os.getpid()
        # another holder (a second open file, as another process would have) is refused, with the owner named
        with pytest.raises(RecipeError, match=rf"is in use by another run \(pid {os.getpid()} on "):
            with lock_output_dir(out):
                pass
        with pytest.raises(RecipeError, match="in use by another run"):
            check_output_dir(out)
    assert not (out / LOCK_NAME).exists()
    check_output_dir(out)


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": int(dead.stdout), "host": "h", "started": "t"}))
    check_output_dir(out)  # a file nobody holds is no obstacle
    with caplog.at_level(logging.WARNING, logger="llm_recipe.components.folders"):
        with lock_output_dir(out):
            assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the lock left by a run that did not finish (pid {dead.stdout.strip()} on h" in caplog.text


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    out = tmp_path / "run"
    code = ("import sys, time\nfrom llm_recipe.components.folders import lock_output_dir\n"
            "with lock_output_dir(sys.argv[1]):\n    print('locked', flush=True)\n    time.sleep(300)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RecipeError, match=f"pid {holder.pid} on"):
            check_output_dir(out)
    finally:
        holder.kill()
        holder.wait()
    with lock_output_dir(out):  # kill -9 released the flock; the file it left is taken over
        pass


def test_model_dir_checks(tmp_path):
    with pytest.raises(RecipeError, match="folder does not exist: /no/such/dir$"):
        check_model_dir("/no/such/dir")
    (tmp_path / "f").write_text("x")
    with pytest.raises(RecipeError, match="is a file, not a model folder$"):
        check_model_dir(tmp_path / "f")
    with pytest.raises(RecipeError, match="has no config.json$"):
        check_model_dir(tmp_path)


@pytest.mark.parametrize("err, reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    (PermissionError(errno.EACCES, "Permission denied"), "Permission denied"),
])
def test_a_failed_write_is_one_line_and_keeps_the_previous_folder(tmp_path, err, reason):
    target = tmp_path / "model"
    with atomic_directory(target) as d:
        (d / "a").write_text("old")
    with pytest.raises(RecipeError) as e:
        with atomic_directory(target) as d:
            (d / "a").write_text("new, half")
            raise err
    assert str(e.value) == f"cannot write {target}: {reason}; nothing under that name was changed"
    assert (target / "a").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_sharded_save_failing_for_a_full_disk_is_one_line_too(tmp_path):
    # torch.distributed.checkpoint (the sharded save under torchrun) wraps each rank's OSError in a
    # CheckpointException, which is a BaseException: it must read as the same one line, not a traceback
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    target = tmp_path / "step_2"
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as cause:
        failure = CheckpointException("save failed", {0: (cause, traceback.extract_tb(cause.__traceback__))})
    with pytest.raises(RecipeError) as e:
        with atomic_directory(target) as d:
            (d / "__0_0.distcp").write_text("half")
            raise failure
    assert str(e.value) == f"cannot write {target}: No space left on device; nothing under that name was changed"
    assert list(tmp_path.iterdir()) == []


def test_a_killed_write_leaves_a_temp_dir_that_the_next_write_removes(tmp_path):
    target = tmp_path / "model"
    (tmp_path / ".model.tmp-abc").mkdir()  # what a kill -9 mid-write leaves
    old = tmp_path / ".model.old-xyz"      # killed between moving the old copy aside and renaming the new one
    (old / "x").mkdir(parents=True)
    (old / "x" / "a").write_text("old")
    with atomic_directory(tmp_path / "other") as d:  # another folder's write leaves them alone
        (d / "b").write_text("b")
    assert (tmp_path / ".model.tmp-abc").exists() and old.exists()
    with atomic_directory(target) as d:
        assert (target / "a").read_text() == "old"  # the moved-aside copy was put back first
        (d / "a").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "other"]
    assert (target / "a").read_text() == "new"


def test_manifest_names_the_changed_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(os.urandom(1000))
    (tmp_path / "sub" / "b.json").write_text("{}")
    write_manifest(tmp_path)
    verify_manifest(tmp_path)
    data = bytearray((tmp_path / "a.bin").read_bytes())
    data[10] ^= 0x80
    (tmp_path / "a.bin").write_bytes(bytes(data))
    with pytest.raises(RecipeError, match=f"checkpoint file {tmp_path / 'a.bin'} is corrupt: its checksum"):
        verify_manifest(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(RecipeError, match=r"no manifest.json \(file checksums\)"):
        verify_manifest(tmp_path)


def test_set_aside_puts_back_folders_links_and_names_with_underscores(tmp_path):
    """overwrite=true's set-aside (components/set_aside.py) restores every name as it was, and what the stopped
    run wrote is removed; a folder set aside by an older version (names not numbered) comes back unrenamed."""
    from llm_recipe.components.set_aside import put_back, set_aside, set_aside_folders

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "shard_00000.safetensors").write_bytes(b"old")
    (tmp_path / "latest").symlink_to("model")
    aside = set_aside(tmp_path, [tmp_path / "model", tmp_path / "shard_00000.safetensors", tmp_path / "latest"], ".x-")
    assert set_aside_folders(tmp_path, ".x-") == [aside] and not (tmp_path / "model").exists()
    (tmp_path / "shard_00000.safetensors").write_bytes(b"new")  # the stopped run's
    put_back(tmp_path, aside, [tmp_path / "shard_00000.safetensors"])
    assert (tmp_path / "shard_00000.safetensors").read_bytes() == b"old" and (tmp_path / "model/config.json").is_file()
    assert (tmp_path / "latest").is_symlink() and not aside.exists()
    older = tmp_path / ".x-old"
    older.mkdir()
    (older / "manifest.json").write_text("{}")
    put_back(tmp_path, older, [])
    assert (tmp_path / "manifest.json").is_file()


def test_a_training_runs_folder_or_its_adapter_as_a_model_folder_names_the_model(tmp_path):
    """model.checkpoint_dir=<a run's output_dir> (or its adapter/) said only 'no config.json'."""
    run = tmp_path / "lora2"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "run.json").write_text("{}")
    (run / "adapter").mkdir()
    (run / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(RecipeError) as e:
        check_model_dir(run)
    assert str(e.value) == f"{run} is not a Hugging Face model folder: it has no config.json; it holds a training " \
        f"run: its model is {run / 'model'}"
    with pytest.raises(RecipeError) as e:
        check_model_dir(run / "adapter")
    assert str(e.value).endswith(f"; it is a PEFT adapter: the merged model is {run / 'model'}")
    with pytest.raises(RecipeError) as e:
        check_model_dir(tmp_path)
    assert str(e.value) == f"{tmp_path} is not a Hugging Face model folder: it has no config.json"
