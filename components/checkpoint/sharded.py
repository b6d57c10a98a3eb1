"""Sharded checkpoints for runs over many processes, written with torch.distributed.checkpoint (DCP).

With world_size > 1 each rank writes its own FSDP shards of the weights and optimizer moments: no rank gathers
the full model per save. Layout of `output_dir/checkpoints/step_000100/`:
- `sharded/`: the DCP folder (`.metadata` + one `__R_0.distcp` per rank): every model tensor (tune names,
  under `model.`) and every optimizer *tensor* (under `optimizer.`, flattened FQN keys);
- `config.json` + tokenizer files and `sharded.json` (world size, LoRA rank/alpha, weights left to the base):
  what `to_hf` needs to turn the checkpoint into a plain HF folder without the run's config;
- `recipe_state/` (rank 0: marks the checkpoint complete, as for one-process checkpoints): step, scheduler,
  data position, RNG, and the optimizer's non-tensor entries (lr, betas, ...);
- `manifest.json` (rank 0, last, once every rank's shards are written): checksums of every file above, verified
  by every rank before a resume (llm_recipe.components.checkpoint.manifest).

Non-tensor optimizer entries go to recipe_state (JSON) rather than DCP because DCP reads non-tensor items back
with `torch.load(weights_only=False)`. DCP's own `.metadata` is a pickle: resume or convert only checkpoints
you wrote. Frozen NF4 (QLoRA) base weights are not saved: resume rebuilds them from the base folder exactly as
the first run did, and `to_hf` reads them from `--base`.

Turn a sharded checkpoint into a HF folder (one process, CPU):
    python -m llm_recipe.components.checkpoint.sharded outputs/run/checkpoints/step_000100 outputs/run/step100_hf
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import RecipeError
from .atomic import atomic_directory
from .manifest import MANIFEST, verify_manifest, write_manifest
from .state import (
    STATE_DIR,
    check_keep_last_n,
    checkpoint_dir,
    load_recipe_state,
    prepare_checkpoints_folder,
    prune_checkpoints,
    write_recipe_state,
)

SHARDED_DIR = "sharded"
META_FILE = "sharded.json"
_FORMAT = 1
_OPTIM_META = "optimizer_meta"  # recipe_state key of the optimizer's non-tensor entries


def is_sharded_checkpoint(ckpt: str | Path) -> bool:
    """True when `ckpt` was written by `save_sharded_checkpoint` (its weights are DCP shards, not a HF folder)."""
    return (Path(ckpt) / META_FILE).is_file()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _is_nf4(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and hasattr(_local(t), "quantization_factor")


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This rank's model and (flattened) optimizer state dicts: DTensor shards under FSDP, no gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))


def _split(model_sd: dict, optim_sd: dict) -> tuple[dict[str, dict], list[str], dict]:
    """(tensors DCP saves, frozen NF4 keys left to the base folder, optimizer entries that are not tensors)."""
    from_base = sorted(k for k, v in model_sd.items() if _is_nf4(v))
    model_t = {k: v for k, v in model_sd.items() if k not in from_base}
    optim_t = {k: v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in optim_sd.items() if not isinstance(v, torch.Tensor)}
    return {"model": model_t, "optimizer": optim_t}, from_base, others


def save_sharded_checkpoint(output_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                            recipe_state: dict[str, Any], runtime: Any, write_meta: Callable[[Path], None],
                            lora: tuple[int, float] | None = None, keep_last_n: int | None = None) -> Path:
    """Write `output_dir/checkpoints/step_{step:06d}/` with every rank writing its shards; returns its path.

    Every rank calls it. `write_meta(dir)` (rank 0) writes config.json and tokenizer files; `lora` is the
    (rank, alpha) that `to_hf` merges with. Atomic like `save_checkpoint`: rank 0 renames the temp folder into
    place after all ranks' shards and the recipe state are written; then all but `keep_last_n` are pruned.
    """
    import torch.distributed.checkpoint as dcp

    check_keep_last_n(keep_last_n)
    target = checkpoint_dir(output_dir, step)
    tensors, from_base, others = _split(*_state_dicts(model, optimizer))
    if not runtime.is_main:
        tmp = Path(runtime.broadcast_object(None))
        dcp.save(tensors, checkpoint_id=tmp / SHARDED_DIR)
        runtime.barrier()  # rank 0 renames and prunes
        return target
    prepare_checkpoints_folder(target.parent)
    with atomic_directory(target) as tmp:
        runtime.broadcast_object(str(tmp))
        dcp.save(tensors, checkpoint_id=tmp / SHARDED_DIR)  # returns once every rank's shards are written
        write_meta(tmp)
        meta = {"format": _FORMAT, "world_size": runtime.world_size, "from_base": from_base,
                "lora": None if lora is None else {"rank": int(lora[0]), "alpha": float(lora[1])}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        write_recipe_state(tmp / STATE_DIR, {**recipe_state, "step": recipe_state.get("step", step),
                                              _OPTIM_META: others})
        write_manifest(tmp)  # last: dcp.save above returned after every rank's shards were written
    prune_checkpoints(output_dir, keep_last_n, target)
    runtime.barrier()
    return target


def load_sharded_checkpoint(ckpt: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                            state: dict[str, Any]) -> None:
    """Restore weights and optimizer state written by `save_sharded_checkpoint` into an already sharded model
    and its optimizer (every rank reads its own shards). `state` is the checkpoint's `load_recipe_state`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, optim_sd = _state_dicts(model, optimizer)  # also creates the optimizer's state tensors
    tensors, _, _ = _split(model_sd, optim_sd)
    missing = set(state.get(_OPTIM_META, {})) ^ {k for k, v in optim_sd.items() if not isinstance(v, torch.Tensor)}
    if missing:
        raise RecipeError(f"{ckpt}: the optimizer state does not match this run's optimizer (e.g. "
                          f"{sorted(missing)[:2]}): resume with the optimizer and model settings that wrote it")
    dcp.load(tensors, checkpoint_id=Path(ckpt) / SHARDED_DIR)  # in place, into this rank's shards
    optim_sd = {**optim_sd, **tensors["optimizer"], **state[_OPTIM_META]}
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=optim_sd,
                   options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False))


# ------------------------------------------------------------------------------------------ conversion
def to_hf(ckpt: str | Path, out_dir: str | Path, base: str | Path | None = None) -> Path:
    """Write a plain HF folder (adapters merged) from a sharded checkpoint, in one process on CPU."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..models import hf_to_tune_names, load_hf_state_dict, read_model_args, save_model
    from ..models.loader import merge_lora_state_dict

    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise RecipeError(f"{ckpt}: no such checkpoint folder (checkpoints are output_dir/checkpoints/step_N)")
    if not is_sharded_checkpoint(ckpt):
        raise RecipeError(f"{ckpt}: not a sharded checkpoint (no {META_FILE}); "
                          "one-process checkpoints already are HF folders")
    meta = json.loads((ckpt / META_FILE).read_text())
    load_recipe_state(ckpt)  # a complete checkpoint, or a one-line error
    if (ckpt / MANIFEST).is_file():  # checkpoints written before manifests existed convert unverified
        verify_manifest(ckpt)
    args = read_model_args(ckpt)
    reader = dcp.FileSystemReader(ckpt / SHARDED_DIR)
    saved = reader.read_metadata().state_dict_metadata
    template = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in saved.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    loaded = {"model": template}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(loaded, storage_reader=reader, no_dist=True)
    sd = dict(loaded["model"])
    if meta["from_base"]:
        if base is None:
            raise RecipeError(f"{ckpt}: {len(meta['from_base'])} frozen NF4 base weights (QLoRA) were not saved; "
                              "pass --base MODEL_DIR (the run's model.checkpoint_dir)")
        base_sd = hf_to_tune_names(load_hf_state_dict(base), tied=args.tie_word_embeddings)
        lacking = [k for k in meta["from_base"] if k not in base_sd]
        if lacking:
            raise RecipeError(f"{base}: has no weight for {lacking[0]} (is it the run's base model?)")
        # what the run trained on and its model/ holds: the base rounded to NF4 (torchao's defaults, as torchtune's
        # LoRALinear quantizes it) and dequantized, in the run's dtype (that of the saved adapters)
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        dtype = next((v.dtype for k, v in sd.items() if k.endswith(".lora_a.weight")), next(iter(sd.values())).dtype)
        sd.update({k: to_nf4(base_sd[k].to(dtype)).get_original_weight() for k in meta["from_base"]})
    if meta["lora"] is not None:
        sd = merge_lora_state_dict(sd, meta["lora"]["rank"], meta["lora"]["alpha"])
    return save_model(None, args, out_dir, tokenizer_dir=ckpt, state_dict=sd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llm_recipe.components.checkpoint.sharded",
        description="Turn a sharded checkpoint (written by a run on several processes) into a HF folder.")
    parser.add_argument("checkpoint", help="output_dir/checkpoints/step_N of a multi-process run")
    parser.add_argument("out_dir", help="the HF folder to write (adapters merged)")
    parser.add_argument("--base", help="the run's base model folder (needed for QLoRA: NF4 bases are not saved)")
    ns = parser.parse_args(argv)
    try:
        out = to_hf(ns.checkpoint, ns.out_dir, ns.base)
    except RecipeError as e:
        print(f"recipe: error: {e}", file=sys.stderr)
        return 1
    print(f"model: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
