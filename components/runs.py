"""One run per output folder: a training run never mixes with an earlier run in the same `output_dir`.

A training recipe (full, lora, kd, qat) starts with `start_run(cfg)`:
- `resume: false` (a new run) into a folder that already holds a run's trained outputs (complete checkpoints,
  `model/`, `adapter/`, `quantized/`, a `metrics.jsonl` with steps) is refused with one line that names the folder,
  what it holds and the two ways on: `resume=true` continues that run, `overwrite=true` deletes its outputs
  (`RUN_OUTPUTS`) before anything trains: set aside at the start, deleted when setup is done
  (`discard_overwritten`), put back if the run stops before (`put_back_overwritten`, called by the recipe runner),
  or, when it was killed (kill -9), by the next run in that folder (`recover_killed_overwrite`).
  Files of our own that hold no trained state (`run.json` of a run that stopped during setup, the lock, an empty
  `metrics.jsonl`) do not count; files we do not write are never touched.
- A new run writes `output_dir/run.json`: a fresh run id, the config (file and sha256 of the resolved
  values) and the start time. Every checkpoint's recipe state records that run id (`RUN_ID_KEY`).
- `resume: true` continues only a checkpoint whose run id is the one in `run.json` (a mismatch is one line naming
  both); the run keeps its id, and metrics.jsonl is cut back to the resumed step (MetricLogger), so it never holds
  steps of two runs or the same step twice. A checkpoint written before run ids existed resumes (and a folder
  without `run.json` adopts the checkpoint's id). `run.json` also keeps the resolved values the run started with:
  a resume with other values for keys that change what it computes is refused, naming them, unless
  `resume_with_changes: true` (components/resume_changes.py).

Under torchrun only rank 0 checks, deletes and writes; the other ranks read `run.json` when they resume.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from .checkpoint.atomic import atomic_write_bytes
from .checkpoint.state import STATE_DIR, list_checkpoints
from .data.identity import data_changes, data_identity
from .errors import RecipeError
from .launch import is_rank0
from .resume_changes import DATA_SHAPE_KEYS, SHAPE_KEYS, config_changes, describe_changes, resolved_values
from .set_aside import delete, discard, put_back, put_back_leftovers, set_aside, set_aside_folders

RUN_FILE = "run.json"
RUN_ID_KEY = "run_id"
DATA_KEY = "data_files"  # run.json: a fingerprint of each local data file the run reads (components/data/identity.py)
# What a training run writes into output_dir, all deleted by overwrite=true (the lock and files we do not
# write stay). The first five are trained state: a new run into a folder holding one of them is refused.
ON_POLICY_EVAL_FILE = "on_policy_eval.json"  # kd.on_policy's held-out score (components/on_policy.py)
RUN_OUTPUTS = ("checkpoints", "model", "adapter", "quantized", "metrics.jsonl", RUN_FILE, "loss.png", "tensorboard",
               "wandb",  # what wandb.init(dir=output_dir) writes
               "layer_importance.json", "layer_importance.txt", ON_POLICY_EVAL_FILE)

__all__ = ["ON_POLICY_EVAL_FILE", "RUN_FILE", "RUN_ID_KEY", "RUN_OUTPUTS", "check_new_run", "check_resume",
           "check_resume_config", "current_run_id", "discard_overwritten", "previous_run", "put_back_overwritten", "read_run", "recipe_of",
           "record_resume_changes", "recover_killed_overwrite", "start_run"]


def read_run(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """`output_dir/run.json` as a dict, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads((Path(output_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get(RUN_ID_KEY), str) else None


def current_run_id(output_dir: str | os.PathLike) -> str | None:
    """The run id in `output_dir/run.json` (recorded in every checkpoint of the run), or None."""
    run = read_run(output_dir)
    return run[RUN_ID_KEY] if run else None


def _metric_steps(path: Path) -> list[int]:
    steps = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps


def previous_run(output_dir: str | os.PathLike) -> list[str]:
    """What of an earlier run's trained outputs `output_dir` holds, in words (empty: nothing that a new run could
    mix with)."""
    out = Path(output_dir)
    found = []
    ckpts = list_checkpoints(out)
    if ckpts:
        found.append(f"{len(ckpts)} checkpoint{'s' if len(ckpts) > 1 else ''} up to checkpoints/{ckpts[-1][1].name}")
    found += [f"{name}/" for name in ("model", "adapter", "quantized") if (out / name).is_dir()]
    steps = _metric_steps(out / "metrics.jsonl")
    if steps:
        found.append(f"metrics.jsonl with steps {min(steps)}-{max(steps)}")
    if found:
        run = read_run(out)
        if run is not None:
            by = f" by `recipe run {_command(run)}`" if _command(run) else ""
            found.insert(0, f"run {run[RUN_ID_KEY]} started {run.get('started', '?')}{by}")
    return found


_SET_ASIDE = ".overwritten.del-"  # prefix of the hidden folder an overwritten run's outputs wait in
_set_aside_here: dict[Path, Path] = {}  # output_dir -> that folder, for the run this process started


def _run_outputs(out: Path) -> list[Path]:
    """What a training run wrote in `out`: its `RUN_OUTPUTS` and the leftovers of its killed atomic writes."""
    found = [out / name for name in RUN_OUTPUTS if (out / name).exists() or (out / name).is_symlink()]
    return found + [p for name in ("model", "adapter", "quantized", "metrics.jsonl", "loss.png", RUN_FILE)
                    for p in out.glob(f".{name}.*-*")]


def _set_aside_outputs(out: Path) -> None:
    """Move what a training run wrote in `out` into a hidden folder beside it (components/set_aside.py).
    `discard_overwritten` deletes them once the new run's setup passed; `put_back_overwritten` restores them when
    it failed first."""
    aside = set_aside(out, _run_outputs(out), _SET_ASIDE)
    if aside is not None:
        _set_aside_here[out.resolve()] = aside


def discard_overwritten(output_dir: str | os.PathLike) -> None:
    """Delete the outputs `overwrite=true` set aside (and any left by a killed earlier attempt): the recipes call
    it when setup is done, so a typo found during setup (a layer that does not exist, a missing dataset) never
    costs the earlier run. Rank 0 only."""
    if not is_rank0():
        return
    out = Path(output_dir)
    _set_aside_here.pop(out.resolve(), None)
    for aside in set_aside_folders(out, _SET_ASIDE):
        discard(aside)


def put_back_overwritten(output_dir: str | os.PathLike | None) -> bool:
    """After a run that stopped before `discard_overwritten`: what it wrote under the run's names goes, and the
    outputs it set aside come back as they were. True when there was something to put back."""
    if output_dir is None:
        return False
    out = Path(output_dir)
    aside = _set_aside_here.pop(out.resolve(), None)
    if aside is None or not aside.is_dir():
        return False
    put_back(out, aside, _run_outputs(out))  # the stopped run's own outputs go
    return True


def recover_killed_overwrite(output_dir: str | os.PathLike) -> None:
    """A run with overwrite=true killed during its setup (kill -9, out of host memory while the teacher loaded) never
    deleted nor put back the earlier run it was replacing: that run comes back, and what the killed one wrote goes,
    before anything else looks at the folder (a resume continues the earlier run; a new run without overwrite is
    refused as for any run). Rank 0 only, under the output folder's lock or before torchrun starts."""
    if not is_rank0():
        return
    out = Path(output_dir)
    if put_back_leftovers(out, _SET_ASIDE, lambda: _run_outputs(out)):
        print(f"note: {out}: a run with overwrite=true was stopped during its setup: the earlier run it was "
              "replacing is back", flush=True)


def _config_sha256(cfg: Any) -> str:
    from .config import config_values

    values = config_values(cfg)  # as written: a default that changes later does not make it another run
    for key in ("resume", "overwrite", "max_steps"):  # a resumed run may extend max_steps: the same run
        values.pop(key, None)
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _write_run(out: Path, cfg: Any, run_id: str | None = None) -> str:
    from .config import config_source

    run_id = run_id or uuid.uuid4().hex
    record = {RUN_ID_KEY: run_id, "recipe": recipe_of(cfg), "command": recipe_command(cfg),
              "config": config_source(cfg).display,
              "config_sha256": _config_sha256(cfg),
              "started": _now(), "values": resolved_values(cfg), DATA_KEY: data_identity(cfg)}
    _save_run(out, record)
    return run_id


def recipe_of(cfg: Any) -> str:
    """The recipe a typed config belongs to, from its class (KDConfig -> kd), as run.json records it."""
    name = type(cfg).__name__
    return (name[: -len("Config")] if name.endswith("Config") else name).lower()


def recipe_command(cfg: Any) -> str:
    """The `recipe run` name for this config, as messages say it: full.py's configs are `qat` or `lora` when they
    have that section (the CLI's aliases of full.py), whichever recipe name started them."""
    name = recipe_of(cfg)
    if name == "full":
        if getattr(cfg, "qat", None) is not None:
            return "qat"
        if getattr(cfg, "lora", None) is not None:
            return "lora"
    return name


def _command(run: dict[str, Any]) -> str | None:
    """run.json's `recipe run` name: "command", or (written before it) "recipe"."""
    name = run.get("command", run.get("recipe"))
    return name if isinstance(name, str) else None


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _save_run(out: Path, record: dict[str, Any]) -> None:
    atomic_write_bytes(out / RUN_FILE, (json.dumps(record, indent=2) + "\n").encode(), output=False)


def _checkpoint_run_id(ckpt: Path) -> str | None:
    """The run id a checkpoint's recipe state records (read from its JSON part only), or None."""
    try:
        state = json.loads((ckpt / STATE_DIR / "state.json").read_text())["state"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    value = state.get(RUN_ID_KEY) if isinstance(state, dict) else None
    return value if isinstance(value, str) else None


def check_resume_or_overwrite(cfg: Any) -> None:
    """RecipeError when both `resume` and `overwrite` are set: one continues the run in output_dir, the other
    deletes it; which one the user meant is theirs to say (resume used to win in silence)."""
    if cfg.resume and cfg.overwrite:
        raise RecipeError(f"resume=true and overwrite=true contradict each other: resume=true continues the run in "
                          f"{cfg.output_dir}, overwrite=true deletes its outputs and starts a new one; set only one")


def check_new_run(cfg: Any) -> None:
    """RecipeError when a new run (`resume: false`, no `overwrite: true`) would write into a folder holding an
    earlier run's trained outputs. Deletes nothing: `recipe run` calls it once before launching torchrun.
    `cfg`: a training recipe's typed config (components/train_config.py: TrainConfig)."""
    check_resume_or_overwrite(cfg)
    if cfg.resume:
        return
    if cfg.overwrite:
        _check_inputs_survive(cfg)
        return
    held = previous_run(cfg.output_dir)
    if held:
        # another command's run resumes only with that command (check_resume_config): do not offer resume=true here
        other = _other_command(read_run(cfg.output_dir) or {}, cfg)
        resume = f"`recipe run {other} ... resume=true` continues it" if other else "resume=true continues it"
        raise RecipeError(f"{cfg.output_dir} already holds a run ({', '.join(held)}): {resume}; "
                          "overwrite=true deletes its outputs and starts a new run; or choose another output_dir")


def _check_inputs_survive(cfg: Any) -> None:
    """overwrite=true deletes the earlier run's outputs: a model folder the new run reads from among them (training
    from the earlier run's `model/`) was moved aside before it loaded, and the run failed on a folder that was there
    a moment before ("no config.json"). Refused before anything moves, naming the key."""
    from dataclasses import asdict

    from .config import config_source, recipe_schema
    from .schema import ModelDir, walk_specs

    out = Path(cfg.output_dir)
    outputs = [p.resolve() for p in _run_outputs(out)]
    for key, _, value in walk_specs(asdict(cfg), recipe_schema(type(cfg)), (ModelDir,)):
        if value and any(Path(value).resolve().is_relative_to(o) for o in outputs):
            raise RecipeError(f"{config_source(cfg).where(key)}: key '{key}': {value} is among the outputs of the "
                              f"earlier run in {out}, which overwrite=true deletes: copy it elsewhere first and "
                              "read it from there, or choose another output_dir")


def start_run(cfg: Any) -> None:
    """Apply the output-folder rule before anything loads (see the module docstring); rank 0 writes run.json."""
    if cfg.resume or not is_rank0():
        return
    check_new_run(cfg)
    out = Path(cfg.output_dir)
    if cfg.overwrite:
        _set_aside_outputs(out)
    else:  # check_new_run found nothing trained: what a run stopped in setup left goes (run.json quietly)
        left = _run_outputs(out)
        named = sorted(p.name for p in left if p.name not in (RUN_FILE, "metrics.jsonl", "loss.png"))
        if named:
            print(f"note: deleted what a run stopped before its first step left in {out}: {', '.join(named)}",
                  flush=True)
        delete(left)
    _write_run(out, cfg)


def check_resume(cfg: Any, ckpt: Path) -> None:
    """RecipeError unless `ckpt` belongs to the run `output_dir/run.json` names. A folder without run.json adopts
    the checkpoint's run (rank 0 writes it); a checkpoint without a run id (written before run ids) resumes."""
    out = Path(cfg.output_dir)
    ckpt_id = _checkpoint_run_id(ckpt)
    run_id = current_run_id(out)
    if ckpt_id is not None and run_id is not None and ckpt_id != run_id:
        raise RecipeError(f"{ckpt} belongs to run {ckpt_id}, but {out / RUN_FILE} names run {run_id}: resume=true "
                          "only continues the run of its output_dir; move that checkpoint away, or start a new run "
                          "with overwrite=true")
    if run_id is None and is_rank0():
        _write_run(out, cfg, ckpt_id)  # adopt the checkpoint's run (a new id for a checkpoint without one)
    run = read_run(out)
    if run is not None:
        check_resume_config(cfg, run, ckpt.name)


def _other_command(run: dict[str, Any], cfg: Any) -> str | None:
    """The `recipe run` name of `run` (run.json) when another command than `cfg`'s started it, else None. full /
    lora / qat share full.py, so their runs differ by command (a lora run resumed by `recipe run full` was refused
    only as a list of changed lora.* keys)."""
    recipe, command = run.get("recipe"), run.get("command")
    if isinstance(recipe, str) and recipe != recipe_of(cfg) or isinstance(command, str) and command != recipe_command(cfg):
        return _command(run)
    return None


def check_resume_config(cfg: Any, run: dict[str, Any], at: str | None) -> None:
    """The resumed config against the values `run` (run.json) started with (llm_recipe.components.resume_changes):
    changes to keys that change what the run computes are a RecipeError naming each key and both values unless
    `resume_with_changes` accepts them. With `at` (the checkpoint resumed from), rank 0 prints what changed
    (`record_resume_changes` writes it to run.json once the checkpoint has loaded); without, only the check
    (`recipe run` before it launches torchrun). Another recipe's run, and changes of `SHAPE_KEYS`, are refused."""
    out = Path(cfg.output_dir)
    if _other_command(run, cfg):
        raise RecipeError(f"resume=true, but {out} holds a run of `recipe run {_command(run)}` ({out / RUN_FILE}): a "
                          f"run resumes only with the recipe that started it; start a new {recipe_command(cfg)} run "
                          "in another output_dir")
    recorded = run.get("values")
    if not isinstance(recorded, dict):  # run.json of a run started before per-key records: nothing to compare
        return
    changed, free = config_changes(recorded, cfg)
    data = _data_changes(run, cfg)
    shaped = {k: v for k, v in changed.items() if k in SHAPE_KEYS}
    if shaped:
        raise RecipeError(f"resume=true, but {describe_changes(shaped)} differ from the run in {out} "
                          f"({out / RUN_FILE}): its checkpoint's adapters or optimizer state would not fit, even "
                          "with resume_with_changes=true; put them back, or start a new run (overwrite=true or "
                          "another output_dir)")
    rows = {k: v for k, v in changed.items() if k in DATA_SHAPE_KEYS}
    if rows:
        raise RecipeError(f"resume=true, but {describe_changes(rows)} differ from the run in {out} "
                          f"({out / RUN_FILE}): kd.on_policy's held-out prompts come out of the dataset, so the "
                          "checkpoint's data position would not fit the rows trained on now, even with "
                          "resume_with_changes=true; put them back, or start a new run (overwrite=true or another "
                          "output_dir)")
    if changed and not getattr(cfg, "resume_with_changes", False):
        raise RecipeError(f"resume=true, but these values differ from the ones the run in {out} last ran with "
                          f"({out / RUN_FILE}): {describe_changes(changed)}; a resumed run continues with its own "
                          "values: put them back, or add resume_with_changes=true to continue with the new ones "
                          "(or start a new run: overwrite=true or another output_dir)")
    if data and not getattr(cfg, "resume_with_changes", False):
        raise RecipeError(f"resume=true, but the data files changed since the run in {out} started ({out / RUN_FILE}): "
                          f"{', '.join(data[:3])}{f' and {len(data) - 3} more' if len(data) > 3 else ''}; the "
                          "checkpoint's data position counts rows of the data it trained on: put the files back, or "
                          "add resume_with_changes=true to continue on the new rows from that position (or start a "
                          "new run: overwrite=true or another output_dir)")
    if data and at is not None and is_rank0():
        print(f"resuming with changed data files: {', '.join(data)}", flush=True)
    if (changed or free) and at is not None and is_rank0():
        print(f"resuming with changed values: {describe_changes(dict(sorted({**changed, **free}.items())))}",
              flush=True)


def _data_changes(run: dict[str, Any], cfg: Any) -> list[str]:
    """The local data files that differ from those run.json recorded at the run's start (components/data/identity.py;
    nothing for a run.json written before data files were recorded)."""
    recorded = run.get(DATA_KEY)
    if not isinstance(recorded, dict) or not is_rank0():  # rank 0 checks (and `recipe run` before torchrun starts)
        return []
    return data_changes(recorded, data_identity(cfg))


def record_resume_changes(cfg: Any, at: str) -> None:
    """After a resumed run restored checkpoint `at`: rank 0 records in run.json the values it changed (accepted by
    `check_resume_config` at setup). Not before: a resume that fails to load leaves run.json as the run had it,
    so the unchanged command still resumes it."""
    out = Path(cfg.output_dir)
    run = read_run(out)
    recorded = run.get("values") if run is not None else None
    if not isinstance(recorded, dict) or not is_rank0():
        return
    changed, free = config_changes(recorded, cfg)
    data = _data_changes(run, cfg)
    if changed or free or data:
        both = dict(sorted({**changed, **free}.items()))
        run["values"] = resolved_values(cfg)
        entry = {"from": at, "at": _now(), "changes": {k: list(v) for k, v in both.items()}}
        if data:
            run[DATA_KEY] = data_identity(cfg)
            entry["data_files"] = data
        run.setdefault("resumed_with_changes", []).append(entry)
        _save_run(out, run)
