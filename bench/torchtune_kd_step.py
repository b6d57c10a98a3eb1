"""torchtune 0.6.1's KD training step, timed: the reference side of bench/kd_throughput.py.

Run it in its own process with torchao 0.15 first on PYTHONPATH (`torchtune.training` does not import with the
torchao 0.18 we pin). The step is the one in torchtune's `recipes/knowledge_distillation_single_device.py`
(`_loss_step` + `train`): student and teacher logits in `num_output_chunks` chunks, `CEWithChunkedOutputLoss` +
`ForwardKLWithChunkedOutputLoss`, `(1 - kd_ratio) * CE + kd_ratio * KD`, backward, `scale_grads`, fused AdamW;
`--compile` applies `training.compile_model` to the student and `training.compile_loss` to both losses, as that
recipe does. Inputs are full rows of random token ids with plain causal attention (no packing mask), torchtune's
fastest case. Prints one JSON line: tokens/s (median over the timed steps) and peak memory.

`--sft`: no teacher, CE alone: the step of torchtune's `lora_finetune_single_device.py` / `full_finetune_single_device.py`
(the reference for our shipped lora and full configs); `--lora-rank`, `--lora-alpha`, `--lora-attn` set the adapters
(`output_proj` is torchtune's name for o_proj; the MLP always has them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

SHAPES = {
    # name: (builder kwargs for the student, for the teacher); Llama 3.2 1B student of Llama 3.1 8B.
    "llama": None,
    # SmolLM2-135M teacher (30 layers) and a 10-layer student of the same widths (CPU comparison).
    "smollm2": dict(vocab_size=49152, num_heads=9, num_kv_heads=3, embed_dim=576, intermediate_dim=1536,
                    max_seq_len=2048, norm_eps=1e-5, rope_base=100000),
}


def build(shapes: str, student: str, device: torch.device, dtype: torch.dtype, lora_attn: list[str], rank: int,
          alpha: float, teacher_too: bool = True):
    from torchtune import training
    from torchtune.models.llama3 import _component_builders as llama3
    from torchtune.models.llama3_1 import llama3_1_8b
    from torchtune.models.llama3_2 import llama3_2_1b, lora_llama3_2_1b
    from torchtune.modules import TiedLinear

    with training.set_default_dtype(dtype), device:
        if shapes == "llama":
            teacher = llama3_1_8b() if teacher_too else None
            if student == "lora":
                model = lora_llama3_2_1b(lora_attn_modules=lora_attn, apply_lora_to_mlp=True,
                                         apply_lora_to_output=False, lora_rank=rank, lora_alpha=alpha, lora_dropout=0.0)
            else:
                model = llama3_2_1b()
        else:
            kw = SHAPES["smollm2"]
            teacher = llama3.llama3(num_layers=30, **kw) if teacher_too else None
            model = llama3.llama3(num_layers=10, **kw)
            for m in (teacher, model):  # SmolLM2 ties its output projection to the embedding
                if m is not None:
                    del m.output
                    m.output = TiedLinear(m.tok_embeddings)
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    if student == "lora":
        from torchtune.modules.peft import get_adapter_params, set_trainable_params

        set_trainable_params(model, get_adapter_params(model))
    return model, teacher


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", choices=list(SHAPES), default="llama")
    p.add_argument("--student", choices=["lora", "full"], default="lora")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile-teacher", action="store_true",
                   help="also compile the teacher's layers (one line a torchtune user can add)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--kd-ratio", type=float, default=0.5)
    p.add_argument("--sft", action="store_true", help="no teacher: CE alone (torchtune's lora/full fine-tune step)")
    p.add_argument("--lora-rank", type=int, default=64)
    p.add_argument("--lora-alpha", type=float, default=128.0)
    p.add_argument("--lora-attn", default="q_proj,v_proj,output_proj", help="attention projections with adapters")
    a = p.parse_args()

    from torchtune import training
    from torchtune.modules.loss import CEWithChunkedOutputLoss, ForwardKLWithChunkedOutputLoss

    torch.manual_seed(0)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model, teacher = build(a.shapes, a.student, device, dtype, a.lora_attn.split(","), a.lora_rank, a.lora_alpha,
                           teacher_too=not a.sft)
    ce_fn, kd_fn = CEWithChunkedOutputLoss(a.chunks), ForwardKLWithChunkedOutputLoss(a.chunks)
    if a.compile:
        training.compile_model(model)
        ce_fn, kd_fn = training.compile_loss(ce_fn), training.compile_loss(kd_fn)
    if a.compile_teacher:
        training.compile_model(teacher)
    model.set_num_output_chunks(a.chunks)
    if teacher is not None:
        teacher.set_num_output_chunks(a.chunks)
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, fused=device.type == "cuda")
    vocab = 49152  # the SmolLM2 tokenizer's ids, as in our run
    ignore = torch.full((a.batch_size, 1), ce_fn.ignore_index, device=device)

    def step() -> None:
        tokens = torch.randint(0, vocab, (a.batch_size, a.seq_len), device=device)
        labels = tokens.clone()
        num_tokens = (labels != ce_fn.ignore_index).sum()
        logits = model(tokens)
        labels = torch.hstack((labels[..., 1:], ignore))
        if teacher is None:  # the fine-tune recipes' _loss_step
            loss = ce_fn(logits, labels)
            del logits
        else:
            with torch.no_grad():
                teacher_logits = teacher(tokens)
            kd_loss = kd_fn(logits, teacher_logits, labels)
            class_loss = ce_fn(logits, labels)
            del logits, teacher_logits
            loss = (1 - a.kd_ratio) * class_loss + a.kd_ratio * kd_loss
        loss.backward()
        training.scale_grads(model, 1 / num_tokens)  # as the recipe does (its losses are already means)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # its one log-line sync per step (running_class_loss.item())

    times = []
    first_step_s = None
    for i in range(a.warmup + a.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i == 0:  # timed from launch, as our rows' setup log does (our package only needs tqdm for this)
            from llm_recipe.components.setup_log import process_start_time

            first_step_s = time.time() - process_start_time()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    tokens = a.batch_size * a.seq_len
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    print(json.dumps({"side": "torchtune", "student": a.student, "sft": a.sft, "compile": a.compile,
                      "compile_teacher": a.compile_teacher, "tokens_per_s": tokens / statistics.median(times),
                      "peak_gib": peak, "steps": len(times), "first_step_s": first_step_s}))



if __name__ == "__main__":
    main()
