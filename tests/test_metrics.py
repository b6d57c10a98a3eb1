"""MetricLogger: metrics.jsonl content and resume truncation, loss.png, optional backends, non-finite loss."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch
from matplotlib import colors
from matplotlib.image import imread

from llm_recipe.components.errors import RecipeError
from llm_recipe.components.metrics import MetricLogger, NonFiniteLossError, check_finite, read_metrics, redact


def _lines(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_content_one_line_per_step_flushed(tmp_path):
    logger = MetricLogger(tmp_path, total_steps=3, progress=False)
    logger.log(1, loss=torch.tensor(2.5), lr=1e-3, tokens_per_s=np.float32(100.0))
    # Flushed at once: readable while the run is going.
    assert _lines(tmp_path) == [{"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0}]
    logger.log(2, loss=2.0, kd_loss=torch.tensor(0.5, dtype=torch.bfloat16), note="x")
    logger.close()
    assert _lines(tmp_path)[1] == {"step": 2, "loss": 2.0, "kd_loss": 0.5, "note": "x"}


def test_resume_truncates_steps_after_the_checkpoint(tmp_path):
    logger = MetricLogger(tmp_path, total_steps=6, progress=False)
    for s in range(1, 6):
        logger.log(s, loss=10.0 - s)
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # torn line of a crash
    logger = MetricLogger(tmp_path, total_steps=6, start_step=3, progress=False)
    logger.log(4, loss=0.25)
    logger.close()
    assert [(r["step"], r["loss"]) for r in _lines(tmp_path)] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 0.25)]
    # A fresh run (start_step=0) starts a fresh file.
    MetricLogger(tmp_path, total_steps=6, progress=False).close()
    assert read_metrics(tmp_path) == []


def test_progress_bar_shows_step_loss_and_throughput(tmp_path, capsys):
    logger = MetricLogger(tmp_path, total_steps=10, start_step=2)
    logger.log(3, loss=1.23456, tokens_per_s=512.0, peak_memory_gib=1.5)
    logger._bar.refresh()
    logger.close()
    err = capsys.readouterr().err
    assert "3/10" in err and "loss=1.2346" in err and "tok/s=512" in err and "mem=1.5GiB" in err


def _has_color(img, color, min_pixels=30):
    rgb = np.array(colors.to_rgb(color))
    close = np.abs(img[..., :3] - rgb).max(axis=-1) < 0.02
    return int(close.sum()) >= min_pixels


def test_close_writes_loss_png_with_every_loss_curve(tmp_path):
    logger = MetricLogger(tmp_path, total_steps=20, progress=False)
    for s in range(1, 21):
        logger.log(s, loss=5.0 / s, ce_loss=3.0 / s, kd_loss=2.0 / s, tokens_per_s=1000.0 + s)
    logger.close()
    png = tmp_path / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(png)
    assert img.shape[:2] == (450, 800)
    # One line per loss key in matplotlib's default colour cycle, and nothing for tokens_per_s.
    assert all(_has_color(img, c) for c in ("C0", "C1", "C2"))
    assert not _has_color(img, "C3", min_pixels=5)


def test_non_main_rank_writes_nothing(tmp_path):
    logger = MetricLogger(
        tmp_path / "out", total_steps=3, is_main=False, tensorboard=True, wandb={"project": "p"}
    )
    logger.log(1, loss=1.0)
    logger.close()
    assert not (tmp_path / "out").exists()


def test_missing_tensorboard_and_wandb_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RecipeError, match="tensorboard=true but the `tensorboard` package is not installed"):
        MetricLogger(tmp_path, total_steps=3, tensorboard=True, progress=False)
    with pytest.raises(RecipeError, match="the `wandb` package is not installed: pip install wandb"):
        MetricLogger(tmp_path, total_steps=3, wandb={"project": "demo"}, progress=False)
    with pytest.raises(RecipeError, match="wandb.api_key must not be in the config"):
        MetricLogger(tmp_path, total_steps=3, wandb={"project": "demo", "api_key": "abc"}, progress=False)


def test_wandb_run_gets_the_section_the_output_dir_and_a_redacted_config(tmp_path, monkeypatch):
    """What wandb.init receives (a stand-in module: wandb is not a dependency) and the metrics it is sent."""
    calls = {}

    class Run:
        def log(self, values, step):
            calls.setdefault("log", []).append((step, values))

        def finish(self):
            calls["finished"] = True

    fake = types.SimpleNamespace(init=lambda **kw: calls.update(init=kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = MetricLogger(tmp_path, total_steps=2, wandb={"project": "demo"}, progress=False,
                          run_config={"model": {"hf_token": "hf_x"}, "lr": 1})
    logger.log(1, loss=2.5)
    logger.close()
    assert calls["init"] == {"project": "demo", "dir": str(tmp_path), "resume": "allow",
                             "config": {"model": {"hf_token": "<redacted>"}, "lr": 1}}
    assert calls["log"][0][0] == 1 and calls["log"][0][1]["loss"] == 2.5 and calls["finished"]


def test_redact_hides_secrets():
    cfg = {"model": {"path": "m", "hf_token": "hf_x"}, "wandb": {"api_key": "k", "project": "p"}, "lr": 1}
    assert redact(cfg) == {
        "model": {"path": "m", "hf_token": "<redacted>"},
        "wandb": {"api_key": "<redacted>", "project": "p"},
        "lr": 1,
    }


def test_check_finite(tmp_path):
    check_finite(torch.tensor(1.5), 3)
    check_finite(0.0, 3)
    with pytest.raises(
        NonFiniteLossError, match=r"loss became nan at step 37; the last good checkpoint is .*step_000030"
    ) as e:
        check_finite(torch.tensor(float("nan")), 37, last_checkpoint=tmp_path / "step_000030")
    assert isinstance(e.value, RecipeError) and "lower the learning rate" in str(e.value)
    with pytest.raises(NonFiniteLossError, match="loss became inf at step 2; no checkpoint was saved yet"):
        check_finite(float("inf"), 2)


def test_tokens_per_s_counts_rows_that_train_and_their_padding_but_not_empty_rows(monkeypatch):
    """A step of one packed data micro-batch (2 rows of 8, the second ending in padding) and one on-policy pass in
    the loader's shape with one empty row: 3 rows x 8 positions x 2 ranks in 2 s = 24 tokens/s."""
    from llm_recipe.components import training

    now = iter([10.0, 12.0])
    monkeypatch.setattr(training.time, "perf_counter", lambda: next(now))
    data = {"tokens": torch.ones(2, 8, dtype=torch.long), "labels": torch.tensor([[1] * 8, [1] * 5 + [-100] * 3])}
    shaped = {"tokens": torch.ones(2, 8, dtype=torch.long), "labels": torch.tensor([[-100] * 4 + [1] * 4, [-100] * 8])}
    clock = training.Throughput()
    clock.begin()
    assert clock.rate([data, shaped], types.SimpleNamespace(world_size=2)) == 24.0
