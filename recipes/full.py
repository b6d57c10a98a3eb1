"""Fine-tuning on next-token cross-entropy: every weight (full), or with a `lora:` section LoRA / DoRA / QLoRA
adapters on a frozen base (NF4-quantized for QLoRA); with a `qat:` section quantization-aware training (QAT).
`recipe run lora --config lora/...` and `recipe run qat --config qat/...` run this recipe.

setup (runtime, tokenizer, model, data, optimizer, resume) -> the loop below (accumulate micro-batches, backward,
clip, step, log, checkpoint) -> output_dir/model (a plain HF folder, adapters merged) and with LoRA
output_dir/adapter (PEFT format). QAT trains through torchao fake quantizers (off for the first
`qat.fake_quant_after_n_steps` steps), writes quantization.json beside the trained weights, then converts them
into output_dir/quantized (a torchao HF folder).
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.config import config_source
from llm_recipe.components.data.sources import check_config_data_files
from llm_recipe.components.fsdp import accumulate
from llm_recipe.components.interrupt import StopRequest
from llm_recipe.components.metrics import MetricLogger, check_finite
from llm_recipe.components.models import LoRASettings, load_model
from llm_recipe.components.models.args import check_context
from llm_recipe.components.oom import Where
from llm_recipe.components.quantization import (
    QATSettings,
    check_qat_convert_config,
    fake_quant_enabled_at,
    finish_qat,
    prepare_qat_training,
    set_fake_quant_enabled,
)
from llm_recipe.components.quantization.fp8_base import check_fp8_base_config
from llm_recipe.components.quantization.schemes import check_group_size_config
from llm_recipe.components.runs import discard_overwritten
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.settings import section
from llm_recipe.components.setup_log import SetupLog
from llm_recipe.components.train_config import ModelSection, TrainConfig
from llm_recipe.components.train_state import (
    TrainState,
    check_run_length,
    resume_weights,
    start_or_resume_run,
)
from llm_recipe.components.training import (
    Throughput,
    build_train_loader,
    clip_gradients,
    count_targets,
    freeze_all_but_adapters,
    lm_loss_sum,
    load_tokenizer,
    micro_batch_tokens,
    optimizer_step,
    setup_optimizer,
    step_values,
    to_device,
    total_steps,
    windows,
    write_final_model,
)


@dataclass(frozen=True, kw_only=True)
class FullConfig(TrainConfig):
    """The full / lora / qat recipe's config: the training keys (components/train_config.py), the model, and the
    sections that make it LoRA or QAT."""

    model: ModelSection = section(ModelSection, "the model that trains")
    lora: LoRASettings | None = section(LoRASettings, "LoRA / DoRA / QLoRA adapters on a frozen base (null: every "
                                        "weight trains)", optional=True)
    qat: QATSettings | None = section(QATSettings, "quantization-aware training (null: no fake quantization)",
                                      optional=True)

    def check(self) -> None:
        """Checks across keys, at load: an fp8 LoRA base's device and dtype; a QAT conversion's device."""
        check_fp8_base_config(self.lora, self.device, self.dtype)
        check_qat_convert_config(self.qat, self.device, self.dtype)
        where = config_source(self).where
        check_context(self.dataset.max_seq_len, self.model.checkpoint_dir, where("dataset.max_seq_len"))
        if self.qat is not None:
            check_group_size_config(self.qat.scheme, self.qat.group_size, self.model.checkpoint_dir,
                                    "qat.group_size", where)


CONFIG = FullConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys full`)


def main(cfg: FullConfig) -> None:
    # Local data files the config names must be there: one line now, not after the weights load.
    check_config_data_files(cfg, config_source(cfg).where)
    setup = SetupLog()  # says what setup is doing and how long each part takes, from launch on
    with setup.phase("device"):  # CUDA and, under torchrun, the process group
        rt = setup_runtime(cfg.device, cfg.dtype, cfg.seed)
    base_dir = cfg.model.checkpoint_dir
    lora, qat = cfg.lora, cfg.qat
    # Full fine-tuning resumes from the checkpoint's own weights (saved in the training dtype); LoRA keeps its
    # base from model.checkpoint_dir and restores only the adapters, with the rest of the state below.
    with setup.phase("tokenizer and run folder"):
        tokenizer = load_tokenizer(base_dir)
        resume_from = start_or_resume_run(cfg)
    with setup.phase("data"):  # before the weights: a bad row is one line in seconds, not after an 8B model loads
        loader = build_train_loader(cfg, tokenizer, rt)
        if resume_from is not None:  # `epochs`' step count is known now: a resume it would end before, refused here
            check_run_length(cfg, resume_from, total_steps(cfg, loader))
    base_quant = lora.quantize_base if lora is not None else None  # NF4 on a CPU: about a minute for SmolLM2
    with setup.phase(f"weights (quantizing the base to {base_quant})" if base_quant else "weights"):
        source = resume_weights(resume_from) if lora is None else None
        model, args = load_model(source or base_dir, dtype=rt.dtype, device=rt.build_device(source or base_dir), lora=lora,
                                 max_seq_len=cfg.dataset.max_seq_len)
        if lora is not None:
            freeze_all_but_adapters(model)
        qat_files = None  # QAT: fake-quantized linears (torchao QATConfig) and quantization.json for the end
        if qat is not None:  # on a GPU the quantizers compile on their own, or inside the layers with compile: true
            qat_files = prepare_qat_training(model, qat, rt.device, compiled_model=cfg.compile)
        rt.prepare_model(model, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                         micro_batch_tokens=micro_batch_tokens(cfg))

    with setup.phase("optimizer"):
        steps = total_steps(cfg, loader)
        if qat is not None and (qat.fake_quant_after_n_steps or 0) >= steps:  # a shortened run: plain training
            setup.say(f"fake quantization never turns on: qat.fake_quant_after_n_steps={qat.fake_quant_after_n_steps} "
                      f"and the run has {steps} steps, so it trains without it (its quantized model is post-training "
                      "quantization); lower qat.fake_quant_after_n_steps or train longer", "note")
        optimizer, scheduler = setup_optimizer(cfg, model, rt, steps)
        # what a checkpoint holds and resume restores: weights, optimizer, schedule, data position, RNG
        state = TrainState(cfg, rt, model, args, base_dir, optimizer, scheduler, loader, adapters=lora is not None)
        start = state.restore(resume_from, steps) if resume_from is not None else 0
        discard_overwritten(cfg.output_dir)  # setup passed: the outputs overwrite=true set aside go now

    # The loop. A step accumulates `gradient_accumulation_steps` micro-batches. Each one's cross-entropy, summed
    # over its target tokens (the output projection applied chunk by chunk), is divided by the target tokens of
    # the whole window on all ranks, times world_size (FSDP averages gradients over ranks): a step does not
    # depend on how tokens fall into micro-batches or ranks. QAT switches fake quantization on at optimizer step
    # `fake_quant_after_n_steps` (a local flag: every rank flips it at the same step, so it is safe under torchrun).
    accum, chunks = cfg.gradient_accumulation_steps, cfg.num_output_chunks
    save_every, step, clock = cfg.save_every_n_steps, start, Throughput()
    model.train()
    with (MetricLogger(cfg.output_dir, steps, rt.is_main, cfg.tensorboard, cfg.wandb, start_step=start) as logger,
          StopRequest.install(ranks=rt.world_size, main=rt.is_main) as stop,  # Ctrl-C: checkpoint, exit
          Where(rt.device) as where):  # out of memory: the error names the step and micro-batch shape
        for window in windows(loader, accum, steps - start):  # one window per optimizer step
            where.at(f"at step {step + 1}")
            if qat is not None:  # off for steps 1..fake_quant_after_n_steps
                set_fake_quant_enabled(model, fake_quant_enabled_at(step, qat.fake_quant_after_n_steps))
                if step == qat.fake_quant_after_n_steps and step > 0:  # said: the step's time and memory change here
                    setup.say(f"fake quantization on from step {step + 1} (the first {step} trained without it)", "qat")
            clock.begin()
            n, loss_sum = count_targets(window, rt), 0.0
            for i, batch in enumerate(window):
                where.shape = list(batch["tokens"].shape)
                accumulate(model, last=i == len(window) - 1)  # FSDP: gather and reduce once per step (fsdp.py)
                loss = lm_loss_sum(model, to_device(batch, rt.device), chunks)
                (loss / n * rt.world_size).backward()
                loss_sum = loss_sum + loss.detach() / n
            grad_norm = clip_gradients(model, cfg.max_grad_norm)
            values = step_values({"loss": loss_sum, "stop": stop.flag(rt.device)}, grad_norm, rt)
            check_finite(values["loss"], step + 1, state.last_checkpoint)  # NaN/inf: stop, name the checkpoint
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses (the schedule then moves on)
            optimizer_step(optimizer, scheduler)
            step += 1
            if step == start + 1:  # say when the first step of this process ended, and what setup took
                setup.first_step(clock.elapsed(), compiled=cfg.compile, step=step)
            logger.log(step, loss=values["loss"], lr=lr, grad_norm=values["grad_norm"],
                       tokens_per_s=clock.rate(window, rt), peak_memory_gib=rt.peak_memory_gib())
            if save_every and step % save_every == 0 and step < steps:
                state.save(step)
            if stop.agreed(values):
                raise stop.interrupted(step, state.save(step))
        state.save(step)  # the final checkpoint

    final = write_final_model(cfg.output_dir, rt, model, args, base_dir, lora=lora, base_model=str(base_dir),
                              extra_files=qat_files, checkpoint=state.final_checkpoint())  # model/ copies its files
    if rt.is_main:
        if qat is not None:
            print(f"model (QAT-trained weights + quantization.json): {final}")
        elif lora is None:
            print(f"model: {final}")
        else:
            print(f"model (merged): {final}\nadapter (PEFT): {cfg.output_dir}/adapter")
        if qat is not None:  # converted into output_dir/quantized, or the command that converts it later
            finish_qat(model, args, qat, final, base_dir, cfg.output_dir, rt)
        print(f"metrics: {cfg.output_dir}/metrics.jsonl\nloss plot: {cfg.output_dir}/loss.png")
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(FullConfig, main)
