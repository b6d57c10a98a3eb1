"""Knowledge distillation: a frozen teacher guides a student (full, LoRA, or layer-pruned from the teacher).

loss = (1 - kd_ratio) * CE(student, labels) + kd_ratio * KD(teacher || student), both computed chunk by chunk
from final hidden states, so full [batch, seq, vocab] logits of the two models are never alive at once.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from components.config import run_recipe_script
from components.errors import RecipeError
from components.losses import build_kd_loss, kd_and_ce, same_tokenizer, shared_vocab
from components.models import keep_every, load_model, read_model_args
from components.quantization.teacher import quantize_teacher
from components.runtime import prepare_teacher, setup_runtime
from components.training import (
    LORA_SCHEMA,
    OPT_FLOAT,
    OPT_INT,
    TRAIN_SCHEMA,
    find_resume_checkpoint,
    freeze_all_but_adapters,
    hidden_states,
    load_tokenizer,
    lora_settings,
    resume_weights,
    setup_training,
    train,
    write_final_model,
)

SCHEMA = {
    **TRAIN_SCHEMA,
    "teacher": {"checkpoint_dir": str, "placement": str, "quantize": (str, type(None))},
    "student": {"checkpoint_dir": (str, type(None)), "keep_layers": (list, type(None)), "every": OPT_INT},
    "lora": LORA_SCHEMA,  # null: the whole student trains
    "kd": {"loss": str, "kd_ratio": float, "temperature": float, "beta": OPT_FLOAT, "alpha": OPT_FLOAT,
           "ratio": OPT_FLOAT},
}


def student_layers(cfg: DictConfig, teacher_layers: int) -> list[int] | None:
    """Which teacher layers initialise the student: `keep_layers: [...]`, or `every: k`, or all (None)."""
    s = cfg.get("student") or {}
    if s.get("keep_layers") is not None and s.get("every") is not None:
        raise RecipeError("student: set keep_layers or every, not both")
    if s.get("keep_layers") is not None:
        return [int(i) for i in s.keep_layers]
    if s.get("every") is not None:
        return keep_every(teacher_layers, int(s.every))
    return None


def main(cfg: DictConfig) -> None:
    rt = setup_runtime(cfg.get("device", "auto"), cfg.get("dtype", "bf16"), cfg.get("seed", 0))
    teacher_dir = cfg.teacher.checkpoint_dir
    student_dir = (cfg.get("student") or {}).get("checkpoint_dir") or teacher_dir
    tokenizer = load_tokenizer(student_dir)
    k = cfg.kd
    kd_loss = build_kd_loss(k.get("loss", "forward_kl"), k.get("temperature", 1.0),
                            **{o: k[o] for o in ("beta", "alpha", "ratio") if k.get(o) is not None})
    kd_ratio = float(k.get("kd_ratio", 0.5))
    lora = lora_settings(cfg.get("lora"))
    max_len = cfg.dataset.max_seq_len

    # Teacher: frozen, under inference mode; replicated or sharded under torchrun (teacher.placement); optionally
    # quantized (fp8 / int8) and compiled.
    teacher, targs = load_model(teacher_dir, dtype=rt.dtype, max_seq_len=max_len)
    prepare_teacher(rt, teacher, cfg.teacher.get("placement", "auto"), cfg.get("compile", False))
    quantize_teacher(teacher, cfg.teacher.get("quantize"), rt.device)

    # Student: resumes from its checkpoint when full; LoRA keeps its base and restores adapters from state.
    resume_from = find_resume_checkpoint(cfg)
    keep = None
    if resume_weights(resume_from) is not None and lora is None:
        student, sargs = load_model(resume_from, dtype=rt.dtype, max_seq_len=max_len)
    else:
        keep = student_layers(cfg, read_model_args(student_dir).num_layers)
        student, sargs = load_model(student_dir, dtype=rt.dtype, lora=lora, keep_layers=keep, max_seq_len=max_len)
        if keep is not None and rt.is_main:
            print(f"student: {len(keep)} of {targs.num_layers} teacher layers kept: {keep}", flush=True)
    if lora is not None:
        freeze_all_but_adapters(student)
    vocab, note = shared_vocab(sargs.vocab_size, targs.vocab_size, tokenizer.vocab_size,
                               same_tokenizer(student_dir, teacher_dir))
    if note and rt.is_main:
        print(note, flush=True)
    vocab = None if vocab == sargs.vocab_size == targs.vocab_size else vocab
    rt.prepare_model(student, activation_checkpointing=cfg.get("activation_checkpointing", False),
                     compile=cfg.get("compile", False))

    loader, steps, optimizer, scheduler, start = setup_training(cfg, rt, student, tokenizer, resume_from,
                                                                 adapters=lora is not None)

    # The loss: CE on labels and KD against the frozen teacher, from final hidden states, chunk by chunk (the
    # student's gradients are computed in the same pass: components/losses/fused.py).
    chunks = cfg.get("num_output_chunks", 8)

    def loss_fn(batch: dict) -> dict:
        with torch.inference_mode():
            t_hidden = hidden_states(teacher, batch)
        parts = kd_and_ce(hidden_states(student, batch), student.output, batch["labels"], t_hidden, teacher.output,
                          kd_loss, kd_ratio, num_chunks=chunks, vocab_size=vocab)
        return {"loss": parts["loss"], "ce": parts["ce"], "kd": parts["kd"]}

    train(cfg, rt, student, sargs, student_dir, loader, optimizer, scheduler, steps, loss_fn, start, resume_from,
          adapters=lora is not None)
    # A PEFT adapter names its base model; a layer-pruned student's base exists in no folder (its layer i is
    # teacher layer keep[i]), so the adapter would silently land on the wrong layers: only the merged model.
    adapter_lora = lora if keep is None else None
    final = write_final_model(cfg, rt, student, sargs, student_dir, lora=adapter_lora, base_model=str(student_dir))
    if rt.is_main:
        if lora is not None and adapter_lora is None:
            print("adapter: not written (the student is layer-pruned, so no base folder matches its adapters); "
                  "use the merged model")
        print(f"student: {final}\nmetrics: {cfg.output_dir}/metrics.jsonl\nloss plot: {cfg.output_dir}/loss.png")
    rt.teardown()


if __name__ == "__main__":
    run_recipe_script(SCHEMA, main)
