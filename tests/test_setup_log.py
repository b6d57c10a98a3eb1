"""The setup log's summary names the process's start-up once, and not where the process did other work first."""

from __future__ import annotations

import re

from llm_recipe.components import setup_log


def _summary(capsys) -> str:
    log = setup_log.SetupLog(is_main=True)
    with log.phase("weights"):
        pass
    log.first_step(0.5, compiled=False)
    return capsys.readouterr().out


def test_first_log_of_a_process_counts_its_start_up_and_only_it(monkeypatch, capsys):
    monkeypatch.setattr(setup_log, "_first_in_process", True)
    first = _summary(capsys)
    assert re.search(r"\): start-up \(Python, imports, config\) [0-9.]+ s, weights [0-9.]+ s, step 1 0.5 s\n", first)
    assert re.search(r"done [0-9.]+ s after launch \([0-9.]+ s after setup began\)", first)
    # a second recipe in the same process (its launch is long past): no start-up part, no time since the launch
    second = _summary(capsys)
    assert re.search(r"first optimizer step done [0-9.]+ s after setup began: weights [0-9.]+ s, step 1 0.5 s\n",
                     second), second
    assert "after launch" not in second


def test_demo_says_its_process_did_other_work_first(monkeypatch, capsys):
    monkeypatch.setattr(setup_log, "_first_in_process", True)
    setup_log.not_a_fresh_process()  # what `recipe demo` calls before its kd run
    assert "start-up" not in _summary(capsys)


def test_silent_off_rank_zero(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    log = setup_log.SetupLog()
    with log.phase("weights"):
        pass
    log.first_step(0.5, compiled=False)
    assert capsys.readouterr().out == ""


def test_the_first_step_says_what_of_it_was_sampling(capsys):
    """kd with on-policy micro-batches: the first step's time names its sampling's share (the compiled decode
    step's compile and CUDA graph recording fall in it) next to torch.compile's note."""
    log = setup_log.SetupLog(is_main=True)
    log.first_step(80.7, compiled=True, within={"on-policy sampling": 55.25})
    assert capsys.readouterr().out.endswith(
        "step 1 80.7 s (on-policy sampling 55.2 s of it; includes torch.compile of what runs in it)\n")
    log.first_step(3.0, compiled=False, within={"on-policy sampling": 0.0})  # a first step with none sampled
    assert capsys.readouterr().out.endswith("step 1 3.0 s\n")
