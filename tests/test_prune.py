"""Depth pruning by measured importance (llm_recipe.components.models.prune and `student.prune` in the kd recipe): the scores
are what they claim to be, a layer that does nothing is the first to go, and the KD recipe keeps the best N."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import recipes_common as rc
import torch
from safetensors.torch import load_file, save_file

from llm_recipe.components.data.dataset import build_dataset
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.models import load_model
from llm_recipe.components.models.prune import (
    PruneSettings,
    StudentSettings,
    calibration_batches,
    keep_by_importance,
    score_layers,
)
from llm_recipe.components.models.tokenizer import Tokenizer

DATASET = {"source": "transfer:passages", "max_seq_len": 64, "packed": True, "limit": 20}


@pytest.fixture(scope="module")
def idle_layer_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model with layer 2 made a no-op (its attention and MLP write zeros into the residual stream)."""
    import shutil

    out = tmp_path_factory.mktemp("idle") / "model"
    shutil.copytree(tiny_model_dir, out)
    w = load_file(str(out / "model.safetensors"))
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        w[f"model.layers.2.{name}.weight"].zero_()
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _batches(model_dir: Path, tokens: int = 256):
    tok = Tokenizer.from_dir(model_dir)
    return calibration_batches(build_dataset(tok, **DATASET), tokens, 2, tok.pad_id, "cpu")


def _mean_loss(model, batches) -> float:
    from llm_recipe.components.losses import chunked_cross_entropy
    from llm_recipe.components.training import hidden_states

    total, n = 0.0, 0
    with torch.no_grad():
        for b in batches:
            s, m = chunked_cross_entropy(hidden_states(model, b), model.output, b["labels"], num_chunks=1)
            total, n = total + float(s), n + int(m)
    return total / n


def test_scores_match_direct_measurements(tiny_model_dir):
    batches = _batches(tiny_model_dir, 128)
    model, args = load_model(tiny_model_dir)
    scores = score_layers(model, batches)
    n = args.num_layers
    assert [r["layer"] for r in scores["layers"]] == list(range(n))
    assert scores["base_loss"] == pytest.approx(_mean_loss(model, batches), rel=1e-5)
    # loss drop of layer i = loss of the model built without layer i minus the full model's loss.
    for i in range(n):
        without, _ = load_model(tiny_model_dir, keep_layers=[j for j in range(n) if j != i])
        expected = _mean_loss(without, batches) - scores["base_loss"]
        assert scores["layers"][i]["loss_drop"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    # block influence of layer i = mean over target tokens of 1 - cos(input of layer i, input of layer i+1).
    model.output_hidden_states = list(range(n))
    with torch.no_grad():
        for i in range(n - 1):
            num, den = 0.0, 0
            for b in batches:
                hs = model(b["tokens"], mask=b["mask"], input_pos=b["input_pos"])
                cos = torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1)
                keep = b["labels"] != -100
                num, den = num + float((1 - cos)[keep].sum()), den + int(keep.sum())
            assert scores["layers"][i]["block_influence"] == pytest.approx(num / den, rel=1e-4)


def test_a_layer_that_does_nothing_is_pruned_first(idle_layer_model):
    model, _ = load_model(idle_layer_model)
    scores = score_layers(model, _batches(idle_layer_model, 128))
    idle = scores["layers"][2]
    assert idle["block_influence"] == pytest.approx(0.0, abs=1e-6)
    assert idle["loss_drop"] == pytest.approx(0.0, abs=1e-5)
    for method in ("block_influence", "loss_drop"):
        assert keep_by_importance(scores, 3, method) == [0, 1, 3]
    assert len(model.layers) == 4  # the model is left whole


def test_keep_by_importance_orders_and_checks():
    scores = {"layers": [{"layer": i, "block_influence": b, "loss_drop": d}
                         for i, (b, d) in enumerate([(0.9, 5.0), (0.1, 0.2), (0.3, 0.1), (0.2, 3.0)])]}
    assert keep_by_importance(scores, 2, "loss_drop") == [0, 3]
    assert keep_by_importance(scores, 2, "block_influence") == [0, 2]
    assert keep_by_importance(scores, 4, "loss_drop") == [0, 1, 2, 3]
    with pytest.raises(RecipeError, match="keep must be between 1 and 4"):
        keep_by_importance(scores, 5, "loss_drop")
    with pytest.raises(RecipeError, match="unknown 'cosine'"):
        keep_by_importance(scores, 2, "cosine")
    with pytest.raises(RecipeError, match="not every and prune"):
        StudentSettings(every=2, prune=PruneSettings(keep=2)).check()


def test_one_way_to_pick_the_student_layers_is_checked_at_load():
    # `recipe validate` reports it (KDConfig.check() at load), not the run after its setup
    from llm_recipe.cli.recipes import load_recipe
    from llm_recipe.components.config import load_recipe_config

    name, recipe = load_recipe("kd")
    with pytest.raises(RecipeError, match=r"^student: set one of keep_layers, every or prune, not every and prune "
                                          r"\(student.prune=null drops the importance scoring\)$"):
        load_recipe_config("kd/smollm2_demo", ["student.every=2"], recipe.CONFIG, recipe=name)


def test_kd_recipe_prunes_by_importance(tmp_path, idle_layer_model, capsys):
    out = tmp_path / "out"
    code = rc.run_in_process("kd", "kd/smollm2_demo", [
        *rc.KD_COMMON, f"teacher.checkpoint_dir={idle_layer_model}", "student.checkpoint_dir=null",
        f"output_dir={out}", "max_steps=1", "student.prune={method: loss_drop, keep: 3, calibration_tokens: 96}"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "student: 3 of 4 teacher layers kept: [0, 1, 3]" in printed
    assert "loss drop" in printed and "block influence" in printed  # the score table is printed
    assert "calibration_tokens=96, but the dataset has only" not in printed  # 8 rows of 48 tokens: enough
    saved = json.loads((out / "layer_importance.json").read_text())
    assert saved["kept"] == [0, 1, 3] and saved["method"] == "loss_drop" and len(saved["layers"]) == 4
    assert all(math.isfinite(r["loss_drop"]) for r in saved["layers"])
    assert (out / "layer_importance.txt").read_text().startswith("layer importance on")
    assert json.loads((out / "model" / "config.json").read_text())["num_hidden_layers"] == 3
    # asked for more calibration tokens than the data has: scored on what there is, and said
    code = rc.run_in_process("kd", "kd/smollm2_demo", [
        *rc.KD_COMMON, f"teacher.checkpoint_dir={idle_layer_model}", "student.checkpoint_dir=null",
        f"output_dir={tmp_path / 'few'}", "max_steps=1", "dataset.limit=1",
        "student.prune={method: loss_drop, keep: 3, calibration_tokens: 4096}"])
    assert code == 0
    assert re.search(r"note: student.prune.calibration_tokens=4096, but the dataset has only \d+ tokens: the layers "
                     r"are scored on those", capsys.readouterr().out)
    # Out-of-range settings fail before any work, naming the key.
    code = rc.run_in_process("kd", "kd/smollm2_demo", [
        *rc.KD_COMMON, f"teacher.checkpoint_dir={idle_layer_model}", f"output_dir={tmp_path / 'bad'}",
        "student.prune={method: loss_drop, keep: 9, calibration_tokens: 96}"])
    assert code == 1
    assert "key 'student.prune.keep': 9 layers to keep, but" in capsys.readouterr().err  # at load: validate says it too


def test_prune_keep_of_every_layer_skips_the_scoring_and_says_so(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """student.prune.keep equal to the model's layer count removes nothing: no model loads, no layer is scored
    (seconds on a CPU, minutes for an 8B teacher on a GPU), one line says why, and the student is the whole model
    (None: so LoRA still writes its PEFT adapter, whose base folder then matches)."""
    import llm_recipe.components.models.prune as prune

    monkeypatch.setattr(prune, "score_layers", lambda *a, **k: pytest.fail("layers were scored"))
    student = StudentSettings(prune=PruneSettings(keep=4, calibration_tokens=64))
    assert prune.student_layers(student, tiny_model_dir, DATASET, 2, out_dir=tmp_path) is None
    assert capsys.readouterr().out == (f"student.prune.keep=4 keeps all 4 layers of {tiny_model_dir}: nothing to "
                                       "remove, layer scoring skipped\n")
    assert not (tmp_path / "layer_importance.json").exists()
    assert prune.student_layers(student, tiny_model_dir, DATASET, 2) is None  # no out_dir (not rank 0): silent
    assert capsys.readouterr().out == ""
