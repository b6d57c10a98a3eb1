"""Quantization-aware training: train with fake-quantized linears (torchao QATConfig), then convert.

setup (model, optional LoRA, fake quantizers) -> loop (fake quantization off for the first
`fake_quant_after_n_steps` optimizer steps, then on) -> output_dir/model (trained float weights in HF layout +
quantization.json, what convert needs) -> optionally convert and write output_dir/quantized (torchao HF folder).
"""

from __future__ import annotations

import json

from omegaconf import DictConfig

from llm_recipe.components.config import run_recipe_script
from llm_recipe.components.models import load_model
from llm_recipe.components.quantization import (
    QAT_SCHEMES,
    compile_fake_quantizers,
    convert_qat,
    fake_quant_enabled_at,
    load_for_convert,
    prepare_qat,
    qat_metadata,
    set_fake_quant_enabled,
)
from llm_recipe.components.quantization.export_hf import export_hf_torchao
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.schema import Choice, ModelDir, Range
from llm_recipe.components.setup_log import SetupLog
from llm_recipe.components.training import (
    LORA_SCHEMA,
    TRAIN_SCHEMA,
    freeze_all_but_adapters,
    lm_loss_sum,
    load_tokenizer,
    lora_settings,
    micro_batch_tokens,
    resume_weights,
    setup_training,
    start_or_resume_run,
    train,
    write_final_model,
)

SCHEMA = {
    **TRAIN_SCHEMA,
    "model": {"checkpoint_dir": ModelDir()},
    "lora": LORA_SCHEMA,  # null: full QAT
    "qat": {"scheme": Choice(*QAT_SCHEMES), "group_size": Range(int, ge=1),
            "fake_quant_after_n_steps": Range(int, ge=0, optional=True), "include_output": bool, "convert": bool},
}


def main(cfg: DictConfig) -> None:
    rt = setup_runtime(cfg.get("device", "auto"), cfg.get("dtype", "bf16"), cfg.get("seed", 0))
    base_dir = cfg.model.checkpoint_dir
    tokenizer = load_tokenizer(base_dir)
    lora = lora_settings(cfg.get("lora"))
    q = cfg.qat
    scheme, group_size, include_output = q.get("scheme", "8da4w"), q.get("group_size", 32), q.get("include_output", False)

    # Full QAT resumes from the checkpoint's weights; QAT+LoRA keeps its base and restores adapters from state.
    resume_from = start_or_resume_run(cfg)
    setup = SetupLog(rt.is_main)  # says what setup is doing and how long each part takes
    with setup.phase("weights"):
        source = resume_weights(resume_from) if lora is None else None
        model, args = load_model(source or base_dir, dtype=rt.dtype, device=rt.build_device, lora=lora, max_seq_len=cfg.dataset.max_seq_len)
        if lora is not None:
            freeze_all_but_adapters(model)
        prepare_qat(model, scheme, group_size, include_output)
        if rt.device.type == "cuda":  # fused fake quantization (eager costs 4.2x a plain step)
            compile_fake_quantizers(model)
        rt.prepare_model(model, activation_checkpointing=cfg.get("activation_checkpointing", False),
                         compile=cfg.get("compile", False), micro_batch_tokens=micro_batch_tokens(cfg))

    with setup.phase("data and optimizer"):
        loader, steps, optimizer, scheduler, start = setup_training(cfg, rt, model, tokenizer, resume_from,
                                                                     adapters=lora is not None)

    # Fake quantization switches on at optimizer step `fake_quant_after_n_steps` (a local flag: every rank
    # flips it at the same step, so it is safe under torchrun).
    delay = q.get("fake_quant_after_n_steps")

    def before_step(step: int) -> None:
        set_fake_quant_enabled(model, fake_quant_enabled_at(step, delay))

    # The loss: plain next-token cross-entropy through the fake-quantized model.
    chunks = cfg.get("num_output_chunks", 8)

    def loss_fn(batch: dict) -> dict:
        return {"loss": lm_loss_sum(model, batch, chunks)}

    train(cfg, rt, model, args, base_dir, loader, optimizer, scheduler, steps, loss_fn, start, resume_from,
          adapters=lora is not None, before_step=before_step, setup_log=setup)
    meta = json.dumps(qat_metadata(scheme, group_size, include_output), indent=2) + "\n"
    final = write_final_model(cfg, rt, model, args, base_dir, lora=lora, base_model=str(base_dir),
                              extra_files={"quantization.json": meta})
    if rt.is_main:
        print(f"model (QAT-trained weights + quantization.json): {final}")
        if q.get("convert", True):
            if rt.world_size > 1:  # the live model holds FSDP shards: convert the merged weights just saved
                model, args = load_for_convert(final, rt.device, rt.dtype)
            set_fake_quant_enabled(model, True)
            convert_qat(model, scheme, group_size)
            out = export_hf_torchao(model, args, base_dir, f"{cfg.output_dir}/quantized", scheme, group_size,
                                    include_output)
            print(f"quantized ({scheme}): {out}")
        print(f"metrics: {cfg.output_dir}/metrics.jsonl\nloss plot: {cfg.output_dir}/loss.png")
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
