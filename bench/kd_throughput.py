"""KD step throughput, ours vs torchtune 0.6.1, measured side by side in one run (issue 9's table).

    python bench/kd_throughput.py build --out /tmp/kdb --tokenizer-dir DIR   # random-weight HF folders
    python bench/kd_throughput.py run --out /tmp/kdb [--rows a,b,...] [--steps 30] [--tt-path DIR]
    python bench/kd_throughput.py table --out /tmp/kdb

`build` writes random-weight HF folders of the Llama-3.2-1B (student) and Llama-3.1-8B (teacher) configs with
transformers (`_from_config` + `save_pretrained`) and copies a tokenizer in (`--tokenizer-dir`: the device scripts
pass `.carry/tok`, which bench/make_carry.py fills with the embedded SmolLM2 tokenizer, the one every recorded row
used: its ids are valid for a 128256 vocab; `make_carry.py --tok llama3` puts Meta's Llama 3 tokenizer there
instead). `run` runs each row in its own process, one after another: torchtune rows are
bench/torchtune_kd_step.py (torchtune's KD step; `--tt-path` goes first on its PYTHONPATH and must hold torchao
0.15); our rows are the real `recipe run kd` on those folders (shipped transfer passages packed to the sequence
length), read back from metrics.jsonl. `ours_lora_cache` first builds (or verifies) the teacher's top-32 cache with
`recipe run kd_logits` over the same data (its build time and bytes/token are in the row) and trains from it. tokens/s is the median over the steps after `--warmup`; peak is
`torch.cuda.max_memory_allocated`. `table` prints the rows with their ratio to torchtune's compiled and eager steps.
Rows run on CPU too (`--device cpu --shapes smollm2`, see docs/benchmarks.md).
The `shipped_*` rows (and every ours row with a live teacher) include the teacher's input embedding kept on the
host (components/models/host_embedding.py, automatic); `shipped_lora_fp8_base` is the row that measures its
memory against the 15.6 GiB before it (issue 19's 15 GiB target).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LORA = "{rank: 64, alpha: 128.0, targets: [q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# Qwen2.5-0.5B / 7B Instruct (their HF config.json files): the shipped kd/qwen2_5_7b_to_0_5b and lora/qwen2_5_7b
QWEN_0_5B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)

# name -> (side, student, options). Ours: extra `recipe run kd` overrides. torchtune: harness flags.
CHAT = ["dataset.source=transfer:chat", "dataset.format=chat", "dataset.use_chat_template=true"]
ROWS: dict[str, tuple[str, str, list[str]]] = {
    "tt_lora_eager": ("torchtune", "lora", []),
    "tt_lora_compile": ("torchtune", "lora", ["--compile"]),
    "tt_full_eager": ("torchtune", "full", []),
    # torchtune's strongest row: its recipe's compile plus the teacher's layers compiled (one line a user can add)
    "tt_lora_compile_teacher": ("torchtune", "lora", ["--compile", "--compile-teacher"]),
    "tt_full_compile_teacher": ("torchtune", "full", ["--compile", "--compile-teacher"]),
    "ours_lora_eager": ("ours", "lora", ["compile=false", "teacher.quantize=null"]),
    "ours_lora_compile": ("ours", "lora", ["compile=true", "teacher.quantize=null"]),
    "ours_lora_compile_fp8": ("ours", "lora", ["compile=true", "teacher.quantize=fp8"]),
    "ours_full_eager": ("ours", "full", ["compile=false", "teacher.quantize=null"]),
    "ours_full_compile": ("ours", "full", ["compile=true", "teacher.quantize=null"]),
    "ours_full_compile_fp8": ("ours", "full", ["compile=true", "teacher.quantize=fp8"]),
    # Offline teacher: the student trains from the teacher's top-32 cache (built first by `recipe run kd_logits`
    # with cache.mode=topk pinned, over the same packed transfer set, reused when complete); the teacher is never
    # loaded.
    "ours_lora_cache": ("ours", "lora", ["compile=true", "teacher.quantize=null", "CACHE"]),
    # What a user runs: the shipped kd/llama3_1_8b_to_llama3_2_1b with only paths changed (models, the local
    # transfer set instead of the Hub's Alpaca, output_dir), a run length, and for LoRA the LoRA section.
    "shipped_lora": ("shipped", "lora", []),
    "shipped_lora_bf16_teacher": ("shipped", "lora", ["teacher.quantize=null"]),
    # on-policy KD as bench/on_policy_speed.py runs it (for bench/profile_kd.py: where its step's time goes)
    "shipped_lora_onpolicy": ("shipped", "lora", ["kd.on_policy.fraction=0.5", "kd.on_policy.max_new_tokens=128"]),
    # ... and as bench/multi_gpu.py's kd_on_policy scaling row runs it (the shipped max_new_tokens): profiled on 1
    # and on N GPUs, where a rank's on-policy step loses its time (bench/device_multi_gpu.sh's PROFILE_ROW)
    "shipped_lora_onpolicy_half": ("shipped", "lora", ["kd.on_policy.fraction=0.5"]),
    # the frozen student base in fp8 under the LoRA section (lora.quantize_base=fp8): beside shipped_lora
    "shipped_lora_fp8_base": ("shipped", "lora", ["lora.quantize_base=fp8"]),
    "shipped_full": ("shipped", "full", []),
    # diagnoses: one shipped setting changed
    "shipped_lora_torchao_sr": ("shipped", "lora", ["optimizer={_component_: torchao.optim._AdamW, lr: 1.0e-4, "
                                                    "weight_decay: 0.0, bf16_stochastic_round: true}"]),
    "shipped_full_torchao_sr": ("shipped", "full", ["optimizer={_component_: torchao.optim._AdamW, lr: 1.0e-4, "
                                                    "weight_decay: 0.0, bf16_stochastic_round: true}"]),
    "shipped_lora_no_compile": ("shipped", "lora", ["compile=false"]),
    "shipped_lora_chunks32": ("shipped", "lora", ["num_output_chunks=32"]),  # smaller loss chunks: memory
    "shipped_lora_ac": ("shipped", "lora", ["activation_checkpointing=true"]),  # what checkpointing costs, saves
    "shipped_lora_dense_mask": ("shipped", "lora", ["DENSE_MASK"]),  # packed rows through SDPA's dense mask
    "shipped_lora_bf16_dense_mask": ("shipped", "lora", ["teacher.quantize=null", "DENSE_MASK"]),
    "shipped_full_dense_mask": ("shipped", "full", ["DENSE_MASK"]),
    # Diagnosis: Inductor's multi-kernel mode (TORCHINDUCTOR_MULTI_KERNEL=1) also generates a one-pass (persistent)
    # kernel for reductions over rows up to 16,384 wide and keeps the faster: the fp8 activation quantization of the
    # 14,336-wide down-projection input reads its row twice without it (call 17's profile: 170 us per call)
    "shipped_lora_mk": ("shipped", "lora", ["ENV:TORCHINDUCTOR_MULTI_KERNEL=1"]),
    "shipped_lora_fp8_base_mk": ("shipped", "lora", ["lora.quantize_base=fp8", "ENV:TORCHINDUCTOR_MULTI_KERNEL=1"]),
    "shipped_lora_bf16_teacher_mk": ("shipped", "lora", ["teacher.quantize=null", "ENV:TORCHINDUCTOR_MULTI_KERNEL=1"]),
    "shipped_full_mk": ("shipped", "full", ["ENV:TORCHINDUCTOR_MULTI_KERNEL=1"]),
    # Diagnosis: Inductor autotunes each matmul (its Triton templates against cuBLAS, per shape, at compile time),
    # then also with Hopper's persistent TMA matmul templates; what it would buy the two rows issue 19 still misses
    "x_bf16_gemm_autotune": ("shipped", "lora", ["teacher.quantize=null", "ENV:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1"]),
    "x_fp8_base_gemm_autotune": ("shipped", "lora", ["lora.quantize_base=fp8", "ENV:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1"]),
    "x_bf16_gemm_autotune_tma": ("shipped", "lora", ["teacher.quantize=null", "ENV:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1",
                                                     "ENV:ENABLE_PERSISTENT_TMA_MATMUL=1"]),
    "x_fp8_base_gemm_autotune_tma": ("shipped", "lora", ["lora.quantize_base=fp8", "ENV:TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1",
                                                         "ENV:ENABLE_PERSISTENT_TMA_MATMUL=1"]),
    # Diagnosis: the micro-batch's shape and the loss's chunks (never swept for the shipped rows; the same 32,768
    # tokens per optimizer step): 4 x 2048 x 4 micro-batches, 1 x 4096 x 8 (longer packed rows), 8 loss chunks of 512
    # rows; and the bf16 teacher with the fp8 student base (the lever issue 19 names for both rows)
    "x_bf16_b4": ("shipped", "lora", ["teacher.quantize=null", "batch_size=4", "gradient_accumulation_steps=4"]),
    "x_bf16_s4096": ("shipped", "lora", ["teacher.quantize=null", "batch_size=1", "dataset.max_seq_len=4096"]),
    "x_bf16_chunks8": ("shipped", "lora", ["teacher.quantize=null", "num_output_chunks=8"]),
    "x_bf16_fp8_base": ("shipped", "lora", ["teacher.quantize=null", "lora.quantize_base=fp8"]),
    "x_fp8_base_s4096": ("shipped", "lora", ["lora.quantize_base=fp8", "batch_size=1", "dataset.max_seq_len=4096"]),
    "x_fp8_base_chunks8": ("shipped", "lora", ["lora.quantize_base=fp8", "num_output_chunks=8"]),
    "x_bf16_b4_fp8_base": ("shipped", "lora", ["teacher.quantize=null", "batch_size=4", "gradient_accumulation_steps=4",
                                               "lora.quantize_base=fp8"]),
    "x_fp8_base_s4096_chunks8": ("shipped", "lora", ["lora.quantize_base=fp8", "batch_size=1", "dataset.max_seq_len=4096",
                                                     "num_output_chunks=8"]),
    # teacher.max_drift=0.01 on the random-weight teacher: what the setup-time drift check costs on an 8B teacher
    # (random weights drift 0.31 nats/token under fp8, so the bound keeps this teacher in bf16)
    "shipped_lora_drift_bound": ("shipped", "lora", ["teacher.max_drift=0.01"]),
    # the local chat set (reading-comprehension contexts with short answers: 96% of tokens are prompt, no label)
    # through the shipped chat template and train_on_input: false
    "shipped_lora_chat": ("shipped", "lora", CHAT),
    # Fine-tuning without a teacher: the shipped lora/llama3_2_3b (on the 1B folder: a path) and full/llama3_2_1b
    # configs as users run them, beside torchtune's lora / full single-device step (compiled as its recipes compile,
    # with the shipped LoRA settings: rank 8, alpha 16, every projection)
    "tt_sft_lora_compile": ("torchtune", "lora", ["--compile", "--sft", "--lora-rank", "8", "--lora-alpha", "16",
                                                  "--lora-attn", "q_proj,k_proj,v_proj,output_proj"]),
    "tt_sft_full_compile": ("torchtune", "full", ["--compile", "--sft"]),
    "shipped_sft_lora": ("shipped_sft", "lora", []),
    "shipped_sft_full": ("shipped_sft", "full", []),
}


def build(out: Path, tokenizer_dir: Path, family: str = "llama") -> None:
    """Random-weight HF folders in `out`: Llama-3.2-1B / 3.1-8B shapes (`student_1b`, `teacher_8b`), or with family
    "qwen" Qwen2.5-0.5B / 7B Instruct shapes (`qwen_0_5b`, `qwen_7b`: the shipped Qwen configs' models; q/k/v
    biases, heads of 151,936 and 152,064 rows), each with the tokenizer in `tokenizer_dir`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = dict(max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
                 eos_token_id=128009, vocab_size=128256)
    qwen = dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, bos_token_id=151643,
                eos_token_id=151645, hidden_act="silu")
    folders = {"llama": (("student_1b", LlamaConfig, LlamaForCausalLM, {**llama, **LLAMA_1B}),
                         ("teacher_8b", LlamaConfig, LlamaForCausalLM, {**llama, **LLAMA_8B})),
               "qwen": (("qwen_0_5b", Qwen2Config, Qwen2ForCausalLM, {**qwen, **QWEN_0_5B}),
                        ("qwen_7b", Qwen2Config, Qwen2ForCausalLM, {**qwen, **QWEN_7B}))}[family]
    for name, config_class, model_class, shape in folders:
        folder = out / name
        if (folder / "config.json").exists():
            continue
        cfg = config_class(**shape)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = model_class._from_config(cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
            if (tokenizer_dir / f).exists() and not (folder / f).exists():
                shutil.copy(tokenizer_dir / f, folder / f)
        print(f"built {folder}", flush=True)


def _data(a) -> list[str]:
    """The transfer set of every `ours` row, and of the cache build (whose manifest must match it)."""
    return ["dataset.source=transfer:passages", "dataset.format=text", "dataset.split=train", "dataset.name=null",
            "dataset.data_files=null", "dataset.column_map=null", "dataset.train_on_input=false",
            "dataset.packed=true", "dataset.use_chat_template=false", f"dataset.limit={a.data_limit or 'null'}",
            f"dataset.max_seq_len={a.seq_len}"]


def build_cache(a) -> tuple[Path, dict]:
    """`recipe run kd_logits` for the rows' teacher and data (top-32, T=1); a complete cache is only verified.
    cache.mode=topk is pinned: `ours_lora_cache` is the measured top-32 row, whatever kd_logits' default (sampled)."""
    cache = a.out / f"cache_{a.shapes}_{a.seq_len}"
    teacher = ([f"teacher.checkpoint_dir={a.out / 'teacher_8b'}", f"tokenizer_dir={a.out / 'student_1b'}"]
               if a.shapes == "llama" else [])
    config = "kd_logits/llama3_1_8b" if a.shapes == "llama" else "kd_logits/smollm2_demo"
    cmd = [sys.executable, "-m", "llm_recipe.cli.main", "run", "kd_logits", "--config", config, *teacher, *_data(a),
           f"output_dir={cache}", f"device={a.device}", f"dtype={a.dtype}", f"batch_size={a.batch_size}",
           f"compile={'true' if a.device.startswith('cuda') else 'false'}", "teacher.quantize=null",
           "cache.mode=topk", "cache.top_k=32"]
    t0 = time.time()
    with open(a.out / f"{cache.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    info = {"cache_rc": rc, "cache_build_s": round(time.time() - t0, 1), "cache_cmd": " ".join(cmd[1:])}
    if rc == 0:
        m = json.loads((cache / "manifest.json").read_text())
        info.update(cache_tokens=m["tokens"], cache_bytes_per_token=m["bytes_per_token"])
    return cache, info


def _ours_cmd(a, student: str, extra: list[str], out_dir: Path) -> list[str]:
    launch = ["--nproc-per-node", str(a.nproc), "--standalone"] if a.nproc > 1 else []
    if a.shapes == "llama":
        models = [f"teacher.checkpoint_dir={a.out / 'teacher_8b'}", f"student.checkpoint_dir={a.out / 'student_1b'}"]
        config = "kd/llama3_1_8b_to_llama3_2_1b"
    else:  # SmolLM2 teacher (embedded) and a 10-layer student pruned from it
        models = ["student.prune=null", "student.every=null", "student.keep_layers=[0,3,6,9,12,15,18,21,24,29]"]
        config = "kd/smollm2_demo"
    lora = [f"lora={LORA}"] if student == "lora" and a.shapes == "llama" else ["lora=null"]
    return [sys.executable, "-m", "llm_recipe.cli.main", "run", *launch, "kd", "--config", config, *models, *lora,
            f"output_dir={out_dir}", f"device={a.device}", f"dtype={a.dtype}", *_data(a), f"batch_size={a.batch_size}",
            "gradient_accumulation_steps=1", f"max_steps={a.steps + a.warmup}", "save_every_n_steps=null",
            "keep_last_n=1", "activation_checkpointing=false", "kd.loss=forward_kl", "kd.kd_ratio=0.5",
            "optimizer={_component_: torch.optim.AdamW, lr: 3.0e-4, weight_decay: 0.01}", "max_grad_norm=null",
            "lr_scheduler.warmup_steps=0", *extra]


def _shipped_cmd(a, student: str, extra: list[str], out_dir: Path) -> list[str]:
    """The shipped 8B -> 1B config as a user runs it: paths, a run length (`--steps + --warmup` optimizer steps of
    the shipped batch 2 x 2048 x 8 accumulation), the LoRA section for LoRA rows, nothing else."""
    paths = [f"teacher.checkpoint_dir={a.out / 'teacher_8b'}", f"student.checkpoint_dir={a.out / 'student_1b'}",
             "dataset.source=transfer:passages", "dataset.format=text", "dataset.use_chat_template=false",
             f"output_dir={out_dir}"]
    lora = [f"lora={LORA}"] if student == "lora" else []
    return [sys.executable, "-m", "llm_recipe.cli.main", "run", "kd", "--config", "kd/llama3_1_8b_to_llama3_2_1b",
            *paths, *lora, f"max_steps={a.steps + a.warmup}", *extra]


def _shipped_sft_cmd(a, student: str, extra: list[str], out_dir: Path) -> list[str]:
    """The shipped lora/llama3_2_3b (student "lora") or full/llama3_2_1b config as a user runs it on the 1B folder:
    paths and a run length (`--steps + --warmup` optimizer steps of the shipped batch), nothing else."""
    recipe, config = ("lora", "lora/llama3_2_3b") if student == "lora" else ("full", "full/llama3_2_1b")
    paths = [f"model.checkpoint_dir={a.out / 'student_1b'}", "dataset.source=transfer:passages", "dataset.format=text",
             "dataset.use_chat_template=false", f"output_dir={out_dir}"]
    return [sys.executable, "-m", "llm_recipe.cli.main", "run", recipe, "--config", config, *paths,
            f"max_steps={a.steps + a.warmup}", *extra]


def _tt_cmd(a, student: str, extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / "torchtune_kd_step.py"), "--shapes", a.shapes, "--student", student,
            "--device", a.device, "--dtype", a.dtype, "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
            "--steps", str(a.steps), "--warmup", str(a.warmup), *extra]


def run_row(a, name: str) -> dict:
    side, student, extra = ROWS[name]
    out_dir = a.out / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    row_env = [e[4:] for e in extra if e.startswith("ENV:")]  # a diagnosis row's environment
    env.update(e.split("=", 1) for e in row_env)
    extra = [e for e in extra if not e.startswith("ENV:")]
    cache_info: dict = {}
    if side == "torchtune":
        cmd = _tt_cmd(a, student, extra)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (a.tt_path, env.get("PYTHONPATH", "")) if p)
    else:
        if "CACHE" in extra:
            cache, cache_info = build_cache(a)
            if cache_info["cache_rc"] != 0:
                return {"name": name, "side": side, "student": student, "rc": cache_info["cache_rc"], **cache_info,
                        "error": (a.out / f"{cache.name}.log").read_text()[-1500:]}
            extra = [e for e in extra if e != "CACHE"] + [f"teacher.logits_dir={cache}"]
        dense = "DENSE_MASK" in extra  # the same command through bench/dense_mask_run.py
        extra = [e for e in extra if e != "DENSE_MASK"]
        cmd = {"shipped": _shipped_cmd, "shipped_sft": _shipped_sft_cmd}.get(side, _ours_cmd)(a, student, extra, out_dir)
        if dense:
            i = cmd.index("llm_recipe.cli.main")
            cmd[i - 1:i + 1] = [str(ROOT / "bench" / "dense_mask_run.py")]
    t0 = time.time()
    with open(out_dir / "log.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:  # a row past --timeout is a result (e.g. minutes of autotuning), and the
            rc = "timeout"                 # rows after it still run
    row = {"name": name, "side": side, "student": student, "rc": rc, "wall_s": round(time.time() - t0, 1),
           "cmd": " ".join(row_env + cmd[1:]), "device": a.device, **cache_info}
    for heavy in ("checkpoints", "model", "adapter"):  # a full student's checkpoints fill the disk in a few rows
        shutil.rmtree(out_dir / heavy, ignore_errors=True)
    if rc != 0:
        row["error"] = (out_dir / "log.txt").read_text()[-1500:]
        return row
    if side == "torchtune":
        res = json.loads([ln for ln in (out_dir / "log.txt").read_text().splitlines() if ln.startswith("{")][-1])
        row.update(tokens_per_s=res["tokens_per_s"], peak_gib=res["peak_gib"], first_step_s=res.get("first_step_s"))
    else:
        first = re.search(r"first optimizer step done ([0-9.]+) s after launch.*", (out_dir / "log.txt").read_text())
        row["first_step_s"] = float(first.group(1)) if first else None
        row["setup_log"] = first.group(0) if first else None  # the parts of the start-up, as the run printed them
        steps = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        timed = [s for s in steps if s.get("step", 0) > a.warmup]
        row.update(tokens_per_s=statistics.median(s["tokens_per_s"] for s in timed),
                   peak_gib=max(s.get("peak_memory_gib") or 0 for s in steps))
    return row


def table(out: Path) -> str:
    rows = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines() if ln.strip()]
    latest: dict[str, dict] = {}  # per row: the median over its successful repeats (`--repeat`), else the last try
    for name in dict.fromkeys(r["name"] for r in rows):
        ok = [r for r in rows if r["name"] == name and r.get("rc") == 0]
        if not ok:
            latest[name] = [r for r in rows if r["name"] == name][-1]
            continue
        latest[name] = {**ok[-1], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok),
                        "peak_gib": max(r.get("peak_gib") or 0 for r in ok), "repeats": len(ok)}
    ref = {k: latest[k]["tokens_per_s"] for k in ("tt_lora_compile", "tt_lora_eager", "tt_full_eager")
           if k in latest and latest[k].get("rc") == 0}
    ref.update({k: latest[k]["tokens_per_s"] for k in ("tt_lora_compile_teacher", "tt_full_compile_teacher",
                                                       "tt_sft_lora_compile", "tt_sft_full_compile")
                if k in latest and latest[k].get("rc") == 0})
    lines = ["| row | tokens/s | peak GiB | vs tt LoRA compiled | vs tt eager (same student) | vs tt teacher compiled "
             "(same student; SFT rows: vs tt's fine-tune step compiled) | first step s | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in latest.values():
        if r.get("rc") != 0:
            lines.append(f"| {r['name']} | failed (rc {r['rc']}) | | | | | | |")
            continue
        tps = r["tokens_per_s"]
        sft = r["side"] == "shipped_sft" or r["name"].startswith("tt_sft_")  # against torchtune's fine-tune step
        same = None if sft else ref.get(f"tt_{r['student']}_eager")
        vs_c = f"{tps / ref['tt_lora_compile']:.2f}x" if "tt_lora_compile" in ref and not sft else "-"
        vs_e = f"{tps / same:.2f}x" if same else "-"
        strong = ref.get(f"tt_sft_{r['student']}_compile" if sft else f"tt_{r['student']}_compile_teacher")
        vs_t = f"{tps / strong:.2f}x" if strong else "-"
        peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        first = f"{r['first_step_s']:.0f}" if r.get("first_step_s") else "-"
        lines.append(f"| {r['name']} | {tps:,.0f} | {peak} | {vs_c} | {vs_e} | {vs_t} | {first} | {r.get('wall_s', '-')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["build", "run", "table"])
    p.add_argument("--out", type=Path, default=Path("/tmp/kd_throughput"))
    p.add_argument("--tokenizer-dir", type=Path)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--tt-path", default="", help="PYTHONPATH entry with torchao 0.15 for the torchtune rows")
    p.add_argument("--shapes", choices=["llama", "smollm2"], default="llama")
    p.add_argument("--family", choices=["llama", "qwen"], default="llama", help="build: which random-weight folders")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--data-limit", type=int, default=None, help="first N transfer passages (CPU smoke runs)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1, help="run the row list this many times, interleaved")
    p.add_argument("--timeout", type=int, default=900)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.phase == "build":
        build(a.out, a.tokenizer_dir, a.family)
    elif a.phase == "run":
        for _ in range(a.repeat):
            for name in a.rows.split(","):
                row = run_row(a, name)
                with open(a.out / "results.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps({k: v for k, v in row.items() if k not in ("cmd", "error")}), flush=True)
                if "error" in row:
                    print(row["error"], flush=True)
        print(table(a.out))
    else:
        print(table(a.out))


if __name__ == "__main__":
    main()
