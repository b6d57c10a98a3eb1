"""Recipe state checkpoints: round trip, atomicity, keep_last_n, latest-complete lookup and RNG restore."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_recipe.components.checkpoint.state import (
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_recipe_state,
    restore_rng,
    save_checkpoint,
    write_recipe_state,
)
from llm_recipe.components.errors import RecipeError


def _write_model(d: Path) -> None:
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(d / "model.safetensors"))
    (d / "config.json").write_text("{}")


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def test_round_trip_keeps_types_and_values(tmp_path):
    shared = torch.randn(4, 4)
    state = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 2)}, 1: {}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1], "fused": None}],
        },
        "tensors": [
            torch.tensor([1, 2], dtype=torch.int64),
            torch.ones(2, dtype=torch.bfloat16),
            torch.tensor(True),
        ],
        "aliases": [shared, shared[1]],  # share memory: must still save
        "empty": torch.zeros(0),
        "np": np.arange(5, dtype=np.uint32),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "nan": float("nan"),
        "dunder": {"__tensor__": "not a tensor"},
        "device": torch.device("cpu"),  # no JSON form: goes through the weights_only torch.save path
    }
    write_recipe_state(tmp_path / "recipe_state", state)
    _assert_same(state, load_recipe_state(tmp_path))


class Custom:
    pass


def test_unsafe_object_fails_at_save_not_at_resume(tmp_path):
    with pytest.raises(TypeError, match="Custom.*weights_only=True"):
        write_recipe_state(tmp_path / "rs", {"x": Custom()})


def test_save_checkpoint_layout_and_load(tmp_path):
    out = save_checkpoint(tmp_path, 7, _write_model, {"epoch": 1, "data": {"pos": 12}})
    assert out == tmp_path / "checkpoints" / "step_000007"
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.arange(6.0).reshape(2, 3))
    meta = json.loads((out / "recipe_state" / "state.json").read_text())
    assert meta["state"]["data"] == {"pos": 12}
    state = load_recipe_state(out)
    assert state["step"] == 7 and state["epoch"] == 1 and state["data"]["pos"] == 12
    assert latest_checkpoint(tmp_path) == out


def test_crash_inside_write_model_leaves_previous_latest(tmp_path):
    first = save_checkpoint(tmp_path, 10, _write_model, {"epoch": 0})

    def crashing(d: Path) -> None:
        _write_model(d)
        raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 20, crashing, {"epoch": 0})
    assert not (tmp_path / "checkpoints" / "step_000020").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000010"]
    assert latest_checkpoint(tmp_path) == first
    assert load_recipe_state(latest_checkpoint(tmp_path))["step"] == 10


def test_latest_ignores_temp_and_incomplete_dirs(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    good = save_checkpoint(tmp_path, 3, _write_model, {})
    root = tmp_path / "checkpoints"
    (root / "step_000009").mkdir()  # no recipe_state: incomplete
    (root / "step_000009" / "config.json").write_text("{}")
    (root / ".step_000012.tmp-abc" / "recipe_state").mkdir(parents=True)
    (root / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == good
    # A later save clears stale temp dirs of crashed saves.
    save_checkpoint(tmp_path, 4, _write_model, {})
    assert not (root / ".step_000012.tmp-abc").exists()


def test_keep_last_n_prunes_oldest_never_the_new_one(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, _write_model, {}, keep_last_n=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 4]
    # A checkpoint of an older step than the ones present is still kept when just written.
    save_checkpoint(tmp_path, 2, _write_model, {}, keep_last_n=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    with pytest.raises(RecipeError, match="keep_last_n=0"):
        save_checkpoint(tmp_path, 5, _write_model, {}, keep_last_n=0)


def _draw():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        torch.rand(3).tolist(),
        torch.randn(2, 2).tolist(),
    )


def test_restore_rng_reproduces_random_numbers(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draw()  # move away from the seeded state
    save_checkpoint(tmp_path, 5, _write_model, {"rng": capture_rng()})
    expected = _draw()
    _draw()
    state = load_recipe_state(latest_checkpoint(tmp_path))
    restore_rng(state)
    assert _draw() == expected
    restore_rng(state["rng"])  # the rng dict itself works too
    assert _draw() == expected


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(RecipeError, match="state.json is missing"):
        load_recipe_state(tmp_path)
    write_recipe_state(tmp_path / "recipe_state", {"x": 1})
    meta = json.loads((tmp_path / "recipe_state" / "state.json").read_text())
    meta["state"] = {"__subclass__": "os.system", "tensors": {}, "ctx": [], "size": [], "stride": []}
    (tmp_path / "recipe_state" / "state.json").write_text(json.dumps(meta))
    with pytest.raises(RecipeError, match="os.system"):
        load_recipe_state(tmp_path)


def test_converting_a_missing_or_one_process_checkpoint_says_which(tmp_path, capsys):
    """`python -m llm_recipe.components.checkpoint.sharded DIR OUT`: a folder that does not exist is named as
    missing (it was called 'not a sharded checkpoint'), a one-process checkpoint as already a HF folder."""
    from llm_recipe.components.checkpoint.sharded import main as convert

    missing = tmp_path / "checkpoints" / "step_000009"
    assert convert([str(missing), str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == (f"recipe: error: {missing}: no such checkpoint folder (checkpoints are "
                                       "output_dir/checkpoints/step_N)\n")
    one = tmp_path / "one"
    one.mkdir()
    _write_model(one)
    assert convert([str(one), str(tmp_path / "hf")]) == 1
    assert "one-process checkpoints already are HF folders" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


# the filesystem clones; it has no clones (EOPNOTSUPP); it refuses this clone now (OpenZFS without
# zfs_bclone_wait_dirty answers EAGAIN for blocks not yet synced, as the checkpoint's are): streamed again
@pytest.mark.parametrize("clones", [True, errno.EOPNOTSUPP, errno.EAGAIN], ids=["clones", "none", "refused"])
def test_the_final_model_clones_the_checkpoint_or_is_written_again(tmp_path, tiny_model_dir, monkeypatch, clones):
    """model/ (and the PEFT adapter) made from the final checkpoint's HF folder hold the same files, byte for byte,
    as when the weights are gathered, merged and serialized again (a 7B LoRA run wrote 15 GB twice at its end);
    cloned where the filesystem can (emulated: a clone that copies), streamed from the model again otherwise (a copy
    was slower than that on a GPU machine's ext4 disk). Never hard links: a user's edit of model/ leaves the
    checkpoint, and its manifest, as they were; model/ outlives the checkpoint."""
    import fcntl

    from llm_recipe.components.checkpoint.manifest import verify_manifest
    from llm_recipe.components.models import LoRASettings, load_model, save_model
    from llm_recipe.components.models.loader import merged_state_dict
    from llm_recipe.components.runtime import setup_runtime
    from llm_recipe.components.training import write_final_model

    rt = setup_runtime("cpu", "fp32", 0)
    lora = LoRASettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    model, args = load_model(tiny_model_dir, dtype=torch.float32, device="cpu", lora=lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.normal_()  # adapters that change the merged weights
    full = rt.full_state_dict(model)
    ckpt = save_checkpoint(tmp_path / "run", 2, lambda d: save_model(model, args, d, tiny_model_dir,
                                                                     state_dict=merged_state_dict(model, full)),
                           {"step": 2})
    cloned = []

    def ioctl(fd, request, src_fd):  # the clone request, done as a copy (tmpfs and ext4 have no clones)
        if clones is not True:
            raise OSError(clones, os.strerror(clones))
        os.lseek(src_fd, 0, 0)
        os.write(fd, os.read(src_fd, os.fstat(src_fd).st_size))
        cloned.append(request)

    monkeypatch.setattr(fcntl, "ioctl", ioctl)
    monkeypatch.setattr(os, "link", lambda *a: pytest.fail("model/ must not hard-link the checkpoint"))
    extra = {"quantization.json": "{}\n"}
    fresh = write_final_model(tmp_path / "fresh", rt, model, args, tiny_model_dir, lora=lora, extra_files=extra)
    cloned.clear()
    reused = write_final_model(tmp_path / "run", rt, model, args, tiny_model_dir, lora=lora, extra_files=extra,
                               checkpoint=ckpt)
    for a, b in ((fresh, reused), (fresh.parent / "adapter", reused.parent / "adapter")):
        names = sorted(p.name for p in a.iterdir())
        assert names == sorted(p.name for p in b.iterdir()) and "manifest.json" not in names
        assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names), a
    assert len(cloned) == (len([f for f in ckpt.iterdir() if f.is_file()]) - 1 if clones is True else 0)  # no manifest
    (reused / "config.json").write_text("{}")  # a user's edit of model/
    (reused / "model.safetensors").write_bytes(b"")
    verify_manifest(ckpt)  # the checkpoint is untouched: it still resumes
    shutil.rmtree(ckpt)  # a user clearing checkpoints/ keeps the model
    assert (fresh / "model.safetensors").stat().st_size > 0
