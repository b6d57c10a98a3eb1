"""Knowledge distillation: a frozen teacher guides a student (full, LoRA, layer-pruned from the teacher, or KD-QAT).

loss = (1 - kd_ratio) * CE + kd_ratio * KD(teacher || student), computed chunk by chunk from final hidden states
(full [batch, seq, vocab] logits never exist). With `teacher.logits_dir` the teacher is its cached top-k or sample.
With `kd.on_policy`, a fraction of the micro-batches are the student's own samples scored by the teacher.
Setup checks what it can before any weights load (data files, the tokenized data, the student's layers); KD-QAT
(a `qat:` section) ends as `recipe run qat` does: output_dir/model (+ quantization.json), and with `qat.convert`
(the default) output_dir/quantized.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_recipe.cli.script import run_recipe_script
from llm_recipe.components.config import config_source
from llm_recipe.components.data.sources import check_config_data_files
from llm_recipe.components.errors import RecipeError
from llm_recipe.components.fsdp import accumulate
from llm_recipe.components.interrupt import StopRequest
from llm_recipe.components.kd_settings import KDSettings
from llm_recipe.components.losses import LiveTeacher, kd_and_ce
from llm_recipe.components.metrics import MetricLogger, check_finite
from llm_recipe.components.models import LoRASettings, load_model
from llm_recipe.components.models.args import check_context
from llm_recipe.components.models.prune import StudentSettings, check_student_layers, student_layers
from llm_recipe.components.on_policy import (
    HeldOut,
    OnPolicy,
    check_on_policy,
    load_prompt_set,
    twin_structure_for,
)
from llm_recipe.components.on_policy_prompts import on_policy_plan
from llm_recipe.components.on_policy_sampling import static_shapes
from llm_recipe.components.oom import Where
from llm_recipe.components.quantization import (
    KD_QAT_KEYS,
    QATSettings,
    check_qat_convert_config,
    finish_qat,
    prepare_qat_student,
)
from llm_recipe.components.quantization.fp8_base import check_fp8_base_config
from llm_recipe.components.quantization.teacher import check_teacher_quant_config
from llm_recipe.components.runs import discard_overwritten
from llm_recipe.components.runtime import setup_runtime
from llm_recipe.components.settings import section
from llm_recipe.components.setup_log import SetupLog
from llm_recipe.components.teacher import TeacherSettings, check_teacher_and_student, load_teacher, loss_vocab
from llm_recipe.components.train_config import TrainConfig
from llm_recipe.components.train_state import TrainState, resume_weights, start_or_resume_run
from llm_recipe.components.training import (
    LOSS_ROWS,
    Throughput,
    build_train_loader,
    clip_gradients,
    count_targets,
    freeze_all_but_adapters,
    hidden_states,
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
class KDConfig(TrainConfig):
    """The kd recipe's config: the training keys (components/train_config.py) and its model and loss sections."""

    teacher: TeacherSettings = section(TeacherSettings, "the frozen teacher, or its cached sample or top-k")
    student: StudentSettings = section(StudentSettings, "the student's weights and the teacher layers it keeps")
    lora: LoRASettings | None = section(LoRASettings, "LoRA adapters on the student (null: the whole student "
                                        "trains)", optional=True)
    qat: QATSettings | None = section(QATSettings, "KD-QAT: the student trains through fake quantizers and, as "
                                      "in `recipe run qat`, converts at the end (null: none)", optional=True,
                                      only=KD_QAT_KEYS)
    kd: KDSettings = section(KDSettings, "the divergence and the CE/KD blend; kd.on_policy")

    def check(self) -> None:
        """Checks across keys, at load: a teacher folder or cache and a student folder to start from, one way to
        pick the student's layers, and where the student's source folder is here, its indices against its
        config.json (no weights: `recipe validate` says what the run would), an fp8 LoRA base's device and dtype,
        an fp8 teacher's device, the loss's options fit its kind, and kd.on_policy fits the rest."""
        self.student.check()
        where = config_source(self).where
        if self.teacher.checkpoint_dir is None and self.teacher.logits_dir is None:
            raise RecipeError(f"{where('teacher.checkpoint_dir')}: key 'teacher.checkpoint_dir': null, and there is "
                              "no teacher.logits_dir: set it to the teacher's HF folder (or teacher.logits_dir to a "
                              "`recipe run kd_logits` cache)")
        if self.teacher.checkpoint_dir is None and self.student.checkpoint_dir is None:
            raise RecipeError(f"{where('student.checkpoint_dir')}: key 'student.checkpoint_dir': null, and so is "
                              "teacher.checkpoint_dir (a cache in teacher.logits_dir has no weights): set it to the "
                              "student's HF folder")
        source = self.student.checkpoint_dir or self.teacher.checkpoint_dir
        if source is not None and (Path(source) / "config.json").is_file():
            check_student_layers(self.student, source, where)
        check_fp8_base_config(self.lora, self.device, self.dtype)
        check_qat_convert_config(self.qat, self.device, self.dtype)
        check_teacher_quant_config(self.teacher.quantize, self.device, self.dtype)
        for folder in (self.student.checkpoint_dir, self.teacher.checkpoint_dir):
            check_context(self.dataset.max_seq_len, folder, where("dataset.max_seq_len"))
        self.kd.loss_fn()
        check_on_policy(self.kd.on_policy, self.teacher.logits_dir, self.dataset)

    def check_inputs(self, tokenizer_vocab: int | None = None) -> None:
        """What the run checks from the model folders' files before any weights load (the same tokens, heads that
        cover the tokenizer, a cache's teacher and tokenizer); `recipe validate` runs it where the folders are here.
        `tokenizer_vocab`: the student's tokenizer's, when the caller has loaded it."""
        student_dir = self.student.checkpoint_dir or self.teacher.checkpoint_dir
        if all((Path(d) / "config.json").is_file() for d in (student_dir, self.teacher.checkpoint_dir) if d):
            vocab = tokenizer_vocab if tokenizer_vocab is not None else load_tokenizer(student_dir).vocab_size
            check_teacher_and_student(self.teacher, student_dir, vocab, self.kd.loss_fn().kind)


CONFIG = KDConfig  # the keys this recipe reads: their types, defaults, ranges and docs (`recipe keys kd`)


def main(cfg: KDConfig) -> None:
    # Local data files the config names must be there: one line now, not after the weights load.
    check_config_data_files(cfg, config_source(cfg).where)
    on_policy, qat = cfg.kd.on_policy, cfg.qat
    setup = SetupLog()  # says what setup is doing and how long each part takes, from launch on
    with setup.phase("device"):  # CUDA and, under torchrun, the process group
        rt = setup_runtime(cfg.device, cfg.dtype, cfg.seed)
    teacher_dir = cfg.teacher.checkpoint_dir
    student_dir = cfg.student.checkpoint_dir or teacher_dir  # one of them is set (KDConfig.check)
    kd_loss, kd_ratio = cfg.kd.loss_fn(), cfg.kd.kd_ratio  # loss = (1 - kd_ratio) * CE + kd_ratio * KD
    lora, max_len = cfg.lora, cfg.dataset.max_seq_len
    with setup.phase("tokenizer and run folder"):
        tokenizer = load_tokenizer(student_dir)
        resume_from = start_or_resume_run(cfg)  # the checkpoint to resume (None: a new run)
        # same tokens (and a divergence a sampled cache can estimate)? before loading weights
        cfg.check_inputs(tokenizer.vocab_size)
    prompt_set = None
    if on_policy is not None and on_policy.prompts is not None:  # before any weights: a bad set fails in seconds
        with setup.phase("on-policy prompts"):
            prompt_set = load_prompt_set(on_policy, max_len, tokenizer)
    # With teacher.logits_dir the cache stands in for the teacher: verified and checked against this run (teacher,
    # tokenizer, dataset section, temperature) before the student's layers are scored.
    teacher = targs = cache = None
    if cfg.teacher.logits_dir is not None:
        with setup.phase("teacher cache check"):
            teacher, targs, cache = load_teacher(cfg.teacher, cfg.dataset.kwargs(), rt, student_dir,
                                                 kd_loss.temperature, max_len, cfg.compile)
    # The tokenized dataset and its loader, before any weights (a bad row, or kd.on_policy.held_out taking every row,
    # fails in seconds). From a cache, it must be the cache's data; its batches carry the cached teacher rows.
    # On-policy runs keep the last `kd.on_policy.held_out` rows out of training (HeldOut), to score at the end.
    held = HeldOut(on_policy, prompt_set)
    with setup.phase("data"):
        loader = build_train_loader(cfg, tokenizer, rt, wrap_dataset=cache.dataset if cache is not None else held)
    # The layers the student keeps: keep_layers / every, or importance scoring (student.prune) on the first rows
    # of the training data, unless a full student resumes its own weights.
    with setup.phase("student layers"):
        keep = student_layers(cfg.student, student_dir, cfg.dataset.kwargs(), cfg.batch_size, rt.device, rt.dtype,
                              cfg.output_dir if rt.is_main else None,
                              score=resume_weights(resume_from) is None or lora is not None,
                              where=config_source(cfg).where, data=loader.dataset)

    # Teacher: frozen (placed, quantized, compiled: components/teacher.py).
    if cache is None:  # setup says the weights' time and the quantization's (teacher.quantize) apart
        teacher, targs, cache = load_teacher(cfg.teacher, cfg.dataset.kwargs(), rt, student_dir, kd_loss.temperature,
                                             max_len, cfg.compile, phase=setup.phase)

    # Student: resumes from its checkpoint when full; LoRA keeps its base and restores adapters from state.
    with setup.phase("student weights"):
        if resume_weights(resume_from) is not None and lora is None:
            student, sargs = load_model(resume_from, dtype=rt.dtype, device=rt.build_device(resume_from), max_seq_len=max_len)
        else:
            student, sargs = load_model(student_dir, dtype=rt.dtype, device=rt.build_device(student_dir), lora=lora,
                                        keep_layers=keep, max_seq_len=max_len)
            if keep is not None and rt.is_main:
                print(f"student: {len(keep)} of {targs.num_layers} teacher layers kept: {keep}", flush=True)
        if lora is not None:
            freeze_all_but_adapters(student)
        qat_files = prepare_qat_student(student, qat, rt.device)  # KD-QAT (null: none)
        vocab = loss_vocab(rt, sargs.vocab_size, targs, tokenizer.vocab_size, student_dir, teacher_dir, cache)
        tokens = micro_batch_tokens(cfg)  # activation checkpointing `auto` sizes for the largest micro-batch
        if prompt_set is not None and not loader.drop_last:  # the prompt set's batch_size x prompts_per_row samples
            # in their own layouts (with the loader's one shape they train in it: OnPolicy)
            tokens = max(tokens, prompt_set.micro_batch_tokens(cfg.batch_size * on_policy.prompts_per_row,
                                                               on_policy.max_new_tokens))
        # several processes sample (kd.on_policy) with the compiled step on an unsharded twin of the student: its
        # structure is copied now, before compiling and sharding (components/sampling_twin.py)
        twin = twin_structure_for(on_policy, cfg.compile, rt, student)
        rt.prepare_model(student, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile,
                         micro_batch_tokens=tokens)

    accum, chunks = cfg.gradient_accumulation_steps, cfg.num_output_chunks
    with setup.phase("optimizer"):
        # loader.drop_last: its batches all have one shape (packed and compiled), which the samples' passes then take
        op = (OnPolicy(on_policy, cfg, rt, tokenizer, vocab, chunks, prompt_set, held, student=student,
                       train_tokens=tokens, twin=twin, loader_shape=loader.drop_last)
              if on_policy is not None else None)
        twin = None  # the twin is the plan's structure filled in: `op` holds it and frees it after the held-out score
        steps = total_steps(cfg, loader)
        optimizer, scheduler = setup_optimizer(cfg, student, rt, steps)
        # what a checkpoint holds and resume restores: weights, optimizer, schedule, data position, RNG
        state = TrainState(cfg, rt, student, sargs, student_dir, optimizer, scheduler, loader,
                           adapters=lora is not None)
        start = state.restore(resume_from, steps) if resume_from is not None else 0
        discard_overwritten(cfg.output_dir)  # setup passed: the outputs overwrite=true set aside go now
    if on_policy is not None and rt.is_main and (plan := on_policy_plan(cfg.seed, on_policy.fraction, accum, start,
                                                                          steps)):
        print(plan, flush=True)  # how many micro-batches sample; a warning when a small share puts none there

    # The loop. A step accumulates `gradient_accumulation_steps` micro-batches. Each one's losses (CE on labels,
    # KD against the frozen teacher) are computed from final hidden states chunk by chunk, with the student's
    # gradients in the same pass (components/losses/fused.py), summed over target tokens and divided by the
    # target tokens of the whole window on all ranks, times world_size (FSDP averages gradients over ranks).
    # On-policy micro-batches (kd.on_policy) are sampled first, with the weights of the step's start, from their rows'
    # prompts or from kd.on_policy.prompts; their loss is the on-policy divergence alone, on the sampled tokens
    # alone (their labels cover nothing else).
    save_every, step, clock = cfg.save_every_n_steps, start, Throughput()
    student.train()
    with (MetricLogger(cfg.output_dir, steps, rt.is_main, cfg.tensorboard, cfg.wandb, start_step=start) as logger,
          StopRequest.install(ranks=rt.world_size, main=rt.is_main) as stop,  # Ctrl-C: checkpoint, exit
          Where(rt.device) as where,  # out of memory: the error names the step and micro-batch shape
          static_shapes() if op is not None and op.loader_shape else nullcontext()):  # on-policy passes' own graphs
        for window in windows(loader, accum, steps - start):  # one window per optimizer step
            where.at(f"at step {step + 1}")
            clock.begin()
            if op is not None:  # the chosen micro-batches become prompt + the student's sampled completion
                window = op.sample_window(student, window, step)
            n, sums = count_targets(window, rt), {}
            for i, batch in enumerate(window):
                where.shape = list(batch["tokens"].shape)
                accumulate(student, last=i == len(window) - 1)  # FSDP: gather and reduce once per step (fsdp.py)
                batch = to_device(batch, rt.device)
                on = "prompt_lens" in batch  # an on-policy micro-batch (completion_batch)
                if cache is not None:  # the cached top-k and tail, or the cached sample (docs/losses.md)
                    target = cache.teacher(batch)
                else:
                    with torch.inference_mode():
                        target = LiveTeacher(hidden_states(teacher, batch), teacher.output)
                hidden = hidden_states(student, batch)
                parts = kd_and_ce(hidden, student.output, batch["labels"], target, op.kd_loss if on else kd_loss,
                                  1.0 if on else kd_ratio, num_chunks=chunks, vocab_size=vocab,
                                  rows_with_labels=batch.get(LOSS_ROWS))  # skips chunks of prompt tokens
                (parts["loss"] / n * rt.world_size).backward()
                if on:  # its loss term and the teacher-scored reverse KL of the samples, for the step's metrics
                    op.score(parts, n, hidden, student.output, batch["labels"], target)
                for k in ("loss",) if on else ("loss", "ce", "kd"):
                    sums[k] = sums.get(k, 0.0) + parts[k].detach() / n
            sums = {**sums, **(op.sums() if op is not None else {}), "stop": stop.flag(rt.device)}
            values = step_values(sums, clip_gradients(student, cfg.max_grad_norm), rt)
            check_finite(values["loss"], step + 1, state.last_checkpoint)  # NaN/inf: stop, name the checkpoint
            lr = scheduler.get_last_lr()[0]  # the rate this step's update uses (the schedule then moves on)
            optimizer_step(optimizer, scheduler)
            step += 1
            if step == start + 1:  # say when the first step of this process ended, and what setup took
                setup.first_step(clock.elapsed(), compiled=cfg.compile, step=step,  # with its sampling's time
                                 within={"on-policy sampling": op.step_seconds} if op is not None else None)
            logger.log(step, loss=values["loss"], ce_loss=values.get("ce"), kd_loss=values.get("kd"),
                       lr=lr, grad_norm=values["grad_norm"],
                       tokens_per_s=clock.rate(window, rt), peak_memory_gib=rt.peak_memory_gib(),
                       **(op.metrics(values, clock.elapsed()) if op is not None else {}))
            if save_every and step % save_every == 0 and step < steps:
                state.save(step)
            if stop.agreed(values):
                raise stop.interrupted(step, state.save(step))
        state.save(step)  # the final checkpoint
    if op is not None:  # the teacher-scored reverse KL of the student's samples of the held-out rows' prompts
        op.report_held_out(student, teacher, cfg.output_dir)

    # A PEFT adapter names its base model; a layer-pruned student's base exists in no folder (its layer i is
    # teacher layer keep[i]), so the adapter would silently land on the wrong layers: only the merged model.
    adapter_lora = lora if keep is None else None
    final = write_final_model(cfg.output_dir, rt, student, sargs, student_dir, lora=adapter_lora,
                              base_model=str(student_dir), extra_files=qat_files,
                              checkpoint=state.final_checkpoint())  # model/ copies the final checkpoint's files
    if rt.is_main:
        if lora is not None and adapter_lora is None:
            print("adapter: not written (the student is layer-pruned, so no base folder matches its adapters); "
                  "use the merged model")
        print(f"student{' (QAT-trained weights + quantization.json)' if qat is not None else ''}: {final}")
        if qat is not None:  # KD-QAT ends as `recipe run qat` does (the same qat.convert)
            finish_qat(student, sargs, qat, final, student_dir, cfg.output_dir, rt)
        print(f"metrics: {cfg.output_dir}/metrics.jsonl\nloss plot: {cfg.output_dir}/loss.png")
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(KDConfig, main)
