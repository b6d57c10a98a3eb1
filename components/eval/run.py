"""`evaluate()`: lm-eval's `simple_evaluate` with our model wrapper and offline task pack, writing results.json."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checkpoint.atomic import atomic_write_bytes
from ..errors import RecipeError
from . import quiet
from .answers import AnswerLog, answers_path, discard_answers
from .stats import fill_closed_form_stderrs

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=2)
def task_manager(stock: bool = True) -> Any:
    """An lm-eval TaskManager that knows our offline pack (`recipe_*`) and, with `stock`, lm-eval's own tasks;
    built once per process. Indexing lm-eval's ~14,000 stock YAMLs takes 15-30 s on 2 cores, so a run of pack
    tasks alone indexes only the pack."""
    from lm_eval.tasks import TaskManager

    from . import TASKS_DIR

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=stock)


def offline_task_names() -> list[str]:
    """Names of the tasks in the offline pack (usable with no network)."""
    from . import TASKS_DIR

    return sorted(p.stem for p in TASKS_DIR.glob("recipe_*.yaml"))


def _as_lm(model_or_checkpoint: Any, batch_size: int, device: str | None, dtype: str,
           max_length: int | None) -> Any:
    from lm_eval.api.model import LM

    from .lm import RecipeLM

    if isinstance(model_or_checkpoint, LM):
        return model_or_checkpoint
    if isinstance(model_or_checkpoint, (str, os.PathLike)):
        return RecipeLM(checkpoint=str(model_or_checkpoint), batch_size=batch_size, device=device, dtype=dtype,
                        max_length=max_length)
    if isinstance(model_or_checkpoint, tuple) and len(model_or_checkpoint) == 2:
        model, tokenizer = model_or_checkpoint
        device = device or str(next(model.parameters()).device)
        return RecipeLM(model=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                        max_length=max_length)
    raise RecipeError(
        f"evaluate(): model must be a checkpoint folder, a (model, tokenizer) pair or an lm-eval LM, "
        f"got {type(model_or_checkpoint).__name__}"
    )


def _simple_evaluate(lm: Any, tasks: Sequence[str], tm: Any, num_fewshot: int | None, limit: int | float | None,
                     apply_chat_template: bool, log_samples: bool, bootstrap_iters: int, seed: int) -> dict | None:
    import lm_eval

    try:
        return lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, task_manager=tm,
            apply_chat_template=apply_chat_template, log_samples=log_samples, bootstrap_iters=bootstrap_iters,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    except OSError as e:  # a stock task's data neither cached nor reachable
        err = quiet.hub_error(e, tasks)
        if err is None:
            raise
        raise err from e


def evaluate(
    model_or_checkpoint: Any,
    tasks: Sequence[str],
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    apply_chat_template: bool = False,
    output_dir: str | Path | None = None,
    seed: int = 1234,
    device: str | None = None,
    dtype: str = "float32",
    max_length: int | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100000,
    record: dict | None = None,
    resume_key: dict | None = None,
) -> dict:
    """Run lm-eval on `tasks` (stock names or our `recipe_*` offline ones), print lm-eval's table and write
    `output_dir/results.json`. Returns lm-eval's results dict. `bootstrap_iters=0` skips lm-eval's standard
    errors (its perplexity SE bootstraps 100000 resamples; `llm_recipe.components.eval.stats` computes them from samples).
    `record`: keys added to results.json (the eval recipe's run identity, components/result_runs.py).
    `resume_key` (with `output_dir`): the evaluation's identity; its answers are kept in output_dir as they come, so
    the same evaluation interrupted and run again continues (components/eval/answers.py)."""
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    quiet.offline_if_hub_unreachable(tasks)  # before lm-eval imports datasets (no 30 s of retries offline)
    from lm_eval.utils import handle_non_serializable, make_table

    if not tasks:
        raise RecipeError("eval tasks: empty list; name at least one, e.g. recipe_hellaswag")
    tm = task_manager(stock=not set(tasks) <= set(offline_task_names()))
    unknown = [t for t in tasks if not tm.match_tasks([t])]
    if unknown:
        raise RecipeError(
            f"eval tasks: unknown task(s) {unknown}; offline tasks are {offline_task_names()} "
            "(any stock lm-eval task name also works when its dataset is in the HF cache)"
        )
    lm = _as_lm(model_or_checkpoint, batch_size, device, dtype, max_length)
    answers = None
    if output_dir is not None and resume_key is not None:
        answers = AnswerLog(answers_path(output_dir, resume_key, lm.rank))
        answers.attach(lm)
        if answers.answers and lm.rank == 0:
            print(f"eval: continuing an interrupted run of this evaluation: {len(answers.answers)} answers kept in "
                  f"{answers.path.parent} are reused", flush=True)
    try:
        # lm-eval's `git describe` outside a repository, its --metadata hint for our tasks (components/eval/quiet.py)
        with quiet.no_git_noise(), quiet.no_metadata_hint():
            results = _simple_evaluate(lm, tasks, tm, num_fewshot, limit, apply_chat_template, log_samples,
                                       bootstrap_iters, seed)
    finally:
        if answers is not None:
            answers.close()
    if results is None:  # non-zero ranks under torchrun
        return {}
    if bootstrap_iters == 0:  # lm-eval left its SEs "N/A": the closed forms where the samples allow
        fill_closed_form_stderrs(results)
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if output_dir is not None:
        out = Path(output_dir)
        text = json.dumps({**results, **(record or {})}, indent=2, default=handle_non_serializable, ensure_ascii=False)
        atomic_write_bytes(out / "results.json", text.encode("utf-8"))
        log.info("wrote %s", out / "results.json")
        if answers is not None:  # finished: nothing left to continue
            discard_answers(out)
    return results
