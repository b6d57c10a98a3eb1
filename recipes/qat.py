"""Quantization-aware training: train with fake-quantized linears (torchao QATConfig), then convert.

setup (model, optional LoRA, fake quantizers) -> the loop below (fake quantization off for the first
`fake_quant_after_n_steps` optimizer steps, then on) -> output_dir/model (trained float weights in HF layout +
quantization.json, what convert needs) -> optionally convert and write output_dir/quantized (torchao HF folder).
"""

from __future__ import annotations

import json

from omegaconf import DictConfig

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.interrupt import StopRequest
from llm_recipe.components.metrics import MetricLogger, check_finite
from llm_recipe.components.models import load_model
from llm_recipe.components.oom import Where
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
from llm_recipe.components.train_state import TrainState, resume_weights, start_or_resume_run
from llm_recipe.components.training import (
    LORA_SCHEMA,
    TRAIN_SCHEMA,
    Throughput,
    build_train_loader,
    clip_gradients,
    count_targets,
    freeze_all_but_adapters,
    lm_loss_sum,
    load_tokenizer,
    lora_settings,
    micro_batch_tokens,
    optimizer_step,
    setup_optimizer,
    step_values,
    to_device,
    total_steps,
    windows,
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
        model, args = load_model(source or base_dir, dtype=rt.dtype, device=rt.build_device, lora=lora,
                                 max_seq_len=cfg.dataset.max_seq_len)
        if lora is not None:
            freeze_all_but_adapters(model)
        prepare_qat(model, scheme, group_size, include_output)
        if rt.device.type == "cuda":  # fused fake quantization (eager costs 4.2x a plain step)
            compile_fake_quantizers(model)
        rt.prepare_model(model, activation_checkpointing=cfg.get("activation_checkpointing", False),
                         compile=cfg.get("compile", False), micro_batch_tokens=micro_batch_tokens(cfg))

    with setup.phase("data and optimizer"):
        loader = build_train_loader(cfg, tokenizer, rt)
        steps = total_steps(cfg, loader)
        optimizer, scheduler = setup_optimizer(cfg, model, rt, steps)
        # what a checkpoint holds and resume restores: weights, optimizer, schedule, data position, RNG
        state = TrainState(cfg, rt, model, args, base_dir, optimizer, scheduler, loader, adapters=lora is not None)
        start = state.restore(resume_from) if resume_from is not None else 0

    # The loop: as in recipes/full.py (summed cross-entropy through the fake-quantized model, divided by the
    # window's target tokens on all ranks), with fake quantization switched on at optimizer step
    # `fake_quant_after_n_steps` (a local flag: every rank flips it at the same step, so it is safe under torchrun).
    accum, chunks = cfg.get("gradient_accumulation_steps", 1), cfg.get("num_output_chunks", 8)
    save_every, step, clock = cfg.get("save_every_n_steps"), start, Throughput()
    delay = q.get("fake_quant_after_n_steps")
    model.train()
    with (MetricLogger(cfg.output_dir, steps, rt.is_main, cfg.get("tensorboard", False), cfg.get("wandb"),
                       start_step=start) as logger,
          StopRequest.install(enabled=rt.world_size == 1) as stop,  # Ctrl-C: checkpoint after this step, exit
          Where(rt.device) as where):  # out of memory: the error names the step and micro-batch shape
        for window in windows(loader, accum):
            if step >= steps:
                break
            where.at(f"at step {step + 1}")
            set_fake_quant_enabled(model, fake_quant_enabled_at(step, delay))  # off for steps 1..delay
            clock.begin()
            n, loss_sum = count_targets(window, rt), 0.0
            for batch in window:
                where.shape = list(batch["tokens"].shape)
                loss = lm_loss_sum(model, to_device(batch, rt.device), chunks)
                (loss / n * rt.world_size).backward()
                loss_sum = loss_sum + loss.detach() / n
            values = step_values({"loss": loss_sum}, clip_gradients(model, cfg.get("max_grad_norm")), rt)
            check_finite(values["loss"], step + 1, state.last_checkpoint)  # NaN/inf: stop, name the checkpoint
            optimizer_step(optimizer, scheduler)
            step += 1
            if step == start + 1:  # say when the first step of this process ended, and what setup took
                setup.first_step(clock.elapsed(), compiled=bool(cfg.get("compile")))
            logger.log(step, loss=values["loss"], lr=scheduler.get_last_lr()[0], grad_norm=values["grad_norm"],
                       tokens_per_s=clock.rate(window, rt), peak_memory_gib=rt.peak_memory_gib())
            if save_every and step % save_every == 0 and step < steps:
                state.save(step)
            if stop.requested:
                raise stop.interrupted(step, state.save(step))
        state.save(step)  # the final checkpoint

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
