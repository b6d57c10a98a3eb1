"""Post-training quantization with torchao, and exports other tools load.

load float weights (a QAT output converts with the scheme it trained for) -> perplexity before -> quantize ->
perplexity after -> export: `hf` (torchao HF folder for transformers), `gguf` (llama.cpp), `pte` (ExecuTorch)
-> report sizes on disk and perplexities (stdout and output_dir/report.json).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.eval.perplexity import held_out_texts, perplexity
from llm_recipe.components.models import load_model
from llm_recipe.components.models.tokenizer import Tokenizer
from llm_recipe.components.quantization import (
    QAT_METADATA_FILE,
    SCHEMES,
    quantize_model,
    read_qat_metadata,
    size_on_disk,
)
from llm_recipe.components.quantization.export_gguf import QTYPES, export_gguf
from llm_recipe.components.quantization.export_hf import export_hf_torchao
from llm_recipe.components.schema import DEVICE, Choice, ListOf, ModelDir, OutputDir, Range

log = logging.getLogger("recipe.quantize")
FORMATS = ("hf", "gguf", "pte")

SCHEMA = {
    "model": {"checkpoint_dir": ModelDir()},
    "output_dir": OutputDir(),
    "scheme": Choice(*SCHEMES),
    "group_size": Range(int, ge=1),
    "include_output": bool,
    "formats": ListOf(Choice(*FORMATS), min_len=1, unique=True),
    "gguf_qtype": Choice(*QTYPES),
    "pte_max_seq_len": Range(int, ge=2),
    "perplexity": {"limit": Range(int, ge=1, optional=True), "max_seq_len": Range(int, ge=2)},
    "device": DEVICE,
}


def main(cfg: DictConfig) -> None:
    src = Path(cfg.model.checkpoint_dir)
    out = Path(cfg.output_dir)
    formats = list(cfg.get("formats", ["hf"]))
    scheme, group_size = cfg.get("scheme", "8da4w"), cfg.get("group_size", 32)
    include_output = cfg.get("include_output", False)
    if (src / QAT_METADATA_FILE).is_file():  # a QAT run converts with exactly what it trained for
        meta = read_qat_metadata(src)
        if (meta["scheme"], meta.get("group_size") or group_size) != (scheme, group_size):
            raise RecipeError(f"{src / QAT_METADATA_FILE}: trained for {meta['scheme']} group_size "
                              f"{meta.get('group_size')}, but the config asks for {scheme} group_size {group_size}; "
                              f"override scheme={meta['scheme']} group_size={meta.get('group_size')}")
        include_output = bool(meta.get("include_output", include_output))
    device = cfg.get("device", "cpu")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device

    tokenizer = Tokenizer.from_dir(src)
    model, args = load_model(src, dtype=torch.float32, device=device)
    ppl_cfg = cfg.get("perplexity") or {}
    texts = held_out_texts(ppl_cfg.get("limit", 200))
    ppl_len = ppl_cfg.get("max_seq_len", 256)
    report = {"source": str(src), "scheme": scheme, "group_size": group_size,
              "size_before_bytes": size_on_disk(src), "perplexity_before": perplexity(model, tokenizer, texts, ppl_len)}

    quantize_model(model, scheme, group_size, include_output)
    report["perplexity_after"] = perplexity(model, tokenizer, texts, ppl_len)
    exports = {}
    if "hf" in formats:
        exports["hf"] = export_hf_torchao(model, args, src, out / "hf", scheme, group_size, include_output)
    if "gguf" in formats:
        qtype = cfg.get("gguf_qtype", "Q4_0")
        exports["gguf"] = export_gguf(model, args, src, out / f"model-{qtype}.gguf", qtype=qtype)
    if "pte" in formats:
        from llm_recipe.components.quantization.export_pte import export_pte

        exports["pte"] = export_pte(model, out / "model.pte", max_seq_len=cfg.get("pte_max_seq_len", 256))
    report["exports"] = {k: {"path": str(v), "size_bytes": size_on_disk(v)} for k, v in exports.items()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    mb = 1024**2
    print(f"{scheme} (group {group_size}) of {src}")
    print(f"  perplexity (LAMBADA passages, {len(texts)} texts): {report['perplexity_before']:.2f} -> "
          f"{report['perplexity_after']:.2f}")
    print(f"  size on disk: {report['size_before_bytes'] / mb:.1f} MiB (source)")
    for k, v in report["exports"].items():
        print(f"  {k:5s} {v['size_bytes'] / mb:8.1f} MiB  {v['path']}")
    print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
