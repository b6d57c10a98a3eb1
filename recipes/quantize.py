"""Post-training quantization with torchao, and exports other tools load.

load float weights (a QAT output converts with the scheme it trained for) -> perplexity before -> quantize ->
perplexity after -> export: `hf` (torchao HF folder for transformers), `gguf` (llama.cpp), `pte` (ExecuTorch)
-> report sizes on disk and perplexities (stdout and output_dir/report.json, written atomically).
What needs no weights (the QAT metadata, whether the scheme runs on this device) is checked before anything loads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.checkpoint.atomic import atomic_write_bytes
from llm_recipe.components.config import config_source
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.eval.perplexity import held_out_texts, perplexity
from llm_recipe.components.models import load_model
from llm_recipe.components.models.tokenizer import Tokenizer
from llm_recipe.components.quantization import (
    QAT_METADATA_FILE,
    SCHEMES,
    check_device,
    quantize_model,
    read_qat_metadata,
    size_on_disk,
)
from llm_recipe.components.quantization.export_gguf import (
    AUTO,
    QTYPES,
    check_gguf_tokenizer,
    export_gguf,
    qtype_for_scheme,
)
from llm_recipe.components.quantization.export_hf import export_hf_torchao
from llm_recipe.components.quantization.schemes import (
    BF16_ONLY,
    GROUPED_SCHEMES,
    check_group_size_config,
    cpu_only,
    scheme_info,
)
from llm_recipe.components.result_runs import RECORD_KEY, check_rerun, run_identity, writing_run
from llm_recipe.components.schema import DEVICE, Choice, ListOf, Range
from llm_recipe.components.settings import section, setting
from llm_recipe.components.setup_log import SetupLog
from llm_recipe.components.train_config import ModelSection, output_dir_key

log = logging.getLogger("recipe.quantize")
FORMATS = ("hf", "gguf", "pte")


@dataclass(frozen=True, kw_only=True)
class Perplexity:
    """The `perplexity:` section: the before/after perplexity on LAMBADA passages."""

    limit: int | None = setting(200, Range(int, ge=1, optional=True), "LAMBADA passages (null: all 5153)")
    max_seq_len: int = setting(256, Range(int, ge=2), "tokens per passage")


@dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """The quantize recipe's keys."""

    model: ModelSection = section(ModelSection, "a float HF folder, or a QAT output (its quantization.json decides "
                                  "the scheme)")
    output_dir: str = output_dir_key("hf/, model-<qtype>.gguf, model.pte, report.json go here")
    scheme: str = setting("8da4w", Choice(*SCHEMES), "the torchao quantization (components/quantization/schemes.py)")
    group_size: int = setting(32, Range(int, ge=1), "int4 group size along the input dim")
    include_output: bool = setting(False, bool, "also quantize the output projection (untied models only)")
    formats: tuple[str, ...] = setting(("hf",), ListOf(Choice(*FORMATS), min_len=1, unique=True),
                                       "hf (transformers) | gguf (llama.cpp) | pte (ExecuTorch)")
    gguf_qtype: str = setting(AUTO, Choice(AUTO, *QTYPES),
                              "the GGUF tensor type; auto follows scheme: 8da4w, int4_weight_only -> Q4_0 (token "
                              "embedding Q8_0); int8_weight_only -> Q8_0; float8_* -> Q8_0 (GGUF has no float8)")
    pte_max_seq_len: int = setting(256, Range(int, ge=2), "KV-cache length baked into the .pte")
    perplexity: Perplexity = section(Perplexity, "the before/after perplexity")
    device: str = setting("cpu", DEVICE, "cpu | cuda | auto (int4_weight_only and float8_dynamic need cuda)")
    overwrite: bool = setting(False, bool, "replace the exports of an earlier run of another source, weights or "
                              "scheme in output_dir (a rerun of the same one writes again without it)")


    def check(self) -> None:
        """At load (`recipe validate` says it too): a .pte needs the one scheme that lowers to XNNPACK."""
        where = config_source(self).where
        check_group_size_config(self.scheme, self.group_size, self.model.checkpoint_dir, "group_size", where)
        cpu, needs = cpu_only(self.device), scheme_info(self.scheme).needs  # at load, not once the run starts
        if cpu is not None and needs != "any":
            gpu = "a CUDA GPU" + (" with compute capability >= 8.9 (Ada/Hopper)" if needs == "cuda_sm89" else "")
            raise RecipeError(f"{where('scheme')}: key 'scheme': {self.scheme} needs {gpu}, but {cpu}; use 8da4w, "
                              "int8_weight_only or float8_weight_only on a CPU, or run with device: cuda")
        if "pte" in self.formats and self.scheme != "8da4w":
            raise RecipeError(f"{where('formats')}: key 'formats': pte needs scheme 8da4w (the only one that lowers "
                              f"to XNNPACK here), but scheme is {self.scheme}; drop pte or set scheme: 8da4w")


CONFIG = QuantizeConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys quantize`)


def main(cfg: QuantizeConfig) -> None:
    src = Path(cfg.model.checkpoint_dir)
    out = Path(cfg.output_dir)
    formats = list(cfg.formats)
    scheme, group_size, include_output = cfg.scheme, cfg.group_size, cfg.include_output
    if (src / QAT_METADATA_FILE).is_file():  # a QAT run converts with exactly what it trained for
        meta = read_qat_metadata(src)
        if (meta["scheme"], meta.get("group_size") or group_size) != (scheme, group_size):
            raise RecipeError(f"{src / QAT_METADATA_FILE}: trained for {meta['scheme']} group_size "
                              f"{meta.get('group_size')}, but the config asks for {scheme} group_size {group_size}; "
                              f"override scheme={meta['scheme']} group_size={meta.get('group_size')}")
        include_output = bool(meta.get("include_output", include_output))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    dtype = torch.bfloat16 if scheme in BF16_ONLY else torch.float32  # int4's kernel, float8's rows: bf16 only
    check_device(scheme, device, dtype)  # before the weights load: a GPU-only scheme on a CPU fails at once
    if "gguf" in formats:  # a tokenizer llama.cpp would read wrongly, before any weights load
        check_gguf_tokenizer(src)
    if "pte" in formats:  # and a .pte without ExecuTorch, not after minutes of perplexity and the other exports
        from llm_recipe.components.quantization.export_pte import require_executorch

        require_executorch()
    qtype = qtype_for_scheme(scheme) if cfg.gguf_qtype == AUTO else cfg.gguf_qtype
    # one quantization per folder: a rerun of it writes again (and keeps its other formats), another one is refused
    identity = run_identity(src, scheme=scheme, include_output=include_output,  # group_size: only where it is used
                            group_size=group_size if scheme in GROUPED_SCHEMES else None)
    earlier = check_rerun("quantize", out, "quantize", "report.json", identity, cfg.overwrite)
    with writing_run(out, "quantize", identity, cfg.overwrite):
        report = _quantize_and_export(cfg, src, out, formats, device, dtype, qtype, scheme=scheme,
                                      group_size=group_size, include_output=include_output)
        report[RECORD_KEY] = identity
        kept = _kept_exports(earlier, report["exports"], out)
        if kept:
            report["earlier_exports"] = kept
        atomic_write_bytes(out / "report.json", (json.dumps(report, indent=2) + "\n").encode())

    mb = 1024**2
    grouped = f" (group {group_size})" if scheme in GROUPED_SCHEMES else ""
    print(f"{scheme}{grouped} of {src}")
    print(f"  perplexity (LAMBADA passages, {report['perplexity_limit']} texts): {report['perplexity_before']:.2f} "
          f"-> {report['perplexity_after']:.2f}")
    print(f"  size on disk: {report['size_before_bytes'] / mb:.1f} MiB (source)")
    for k, v in report["exports"].items():
        print(f"  {k:5s} {v['size_bytes'] / mb:8.1f} MiB  {v['path']}")
    for v in kept.values():
        print(f"  {'kept':5s} {v['size_bytes'] / mb:8.1f} MiB  {v['path']} (an earlier run of this quantization)")
    print(f"report: {out / 'report.json'}")


def _quantize_and_export(cfg: QuantizeConfig, src: Path, out: Path, formats: list[str], device: str,
                         dtype: torch.dtype, qtype: str, *, scheme: str, group_size: int, include_output: bool) -> dict:
    """Load, measure, quantize, measure, export: the report without its run identity and earlier exports."""
    log = SetupLog(prefix="quantize")  # one line as each part starts and ends: a CPU run takes minutes
    with log.phase("weights"):
        tokenizer = Tokenizer.from_dir(src)
        model, args = load_model(src, dtype=dtype, device=device)
    texts = held_out_texts(cfg.perplexity.limit)
    ppl_len = cfg.perplexity.max_seq_len
    with log.phase(f"perplexity before, {len(texts)} LAMBADA texts"):
        report = {"source": str(src), "scheme": scheme, "group_size": group_size, "size_before_bytes": size_on_disk(src),
                  "perplexity_limit": len(texts), "perplexity_before": perplexity(model, tokenizer, texts, ppl_len)}
    with log.phase(f"{scheme} quantization"):
        quantize_model(model, scheme, group_size, include_output)
    with log.phase("perplexity after"):
        report["perplexity_after"] = perplexity(model, tokenizer, texts, ppl_len)
    exports: dict[str, dict] = {}
    if "hf" in formats:
        with log.phase("hf export"):
            path = export_hf_torchao(model, args, src, out / "hf", scheme, group_size, include_output)
        exports["hf"] = {"path": str(path), "size_bytes": size_on_disk(path)}
    if "gguf" in formats:
        report["gguf_qtype"] = qtype
        with log.phase(f"gguf export ({qtype})"):
            path = export_gguf(model, args, src, out / f"model-{qtype}.gguf", qtype=qtype)
        exports["gguf"] = {"path": str(path), "size_bytes": size_on_disk(path), "qtype": qtype}
    if "pte" in formats:
        from llm_recipe.components.quantization.export_pte import export_pte

        with log.phase("pte export (ExecuTorch's lowering: minutes on a CPU)"):
            path = export_pte(model, out / "model.pte", max_seq_len=cfg.pte_max_seq_len, log=log)
        exports["pte"] = {"path": str(path), "size_bytes": size_on_disk(path), "max_seq_len": cfg.pte_max_seq_len}
    report["exports"] = exports
    return report


def _kept_exports(earlier: dict | None, exports: dict[str, dict], out: Path) -> dict[str, dict]:
    """The exports an earlier run of the same quantization left in `out` that this run did not write again
    (another format, another GGUF type): name -> its entry, its path as this run names `out`. Exports sit at the
    top of `out`, so they are matched by name (a rerun from another working directory spells the paths otherwise)."""
    if earlier is None:
        return {}
    written = {Path(e["path"]).name for e in exports.values()}
    entries = [*(earlier.get("exports") or {}).items(), *(earlier.get("earlier_exports") or {}).items()]
    kept: dict[str, dict] = {}
    for name, entry in entries:
        file = Path(entry["path"]).name if isinstance(entry, dict) and entry.get("path") else None
        if file is None or file in written or not (out / file).exists():
            continue
        kept[f"{name.split(':')[0]}:{file}" if name in kept or name in exports else name] = {**entry,
                                                                                             "path": str(out / file)}
        written.add(file)
    return kept


if __name__ == "__main__":
    run_recipe_script(QuantizeConfig, main)
