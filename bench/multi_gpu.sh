#!/usr/bin/env bash
# KD scaling on 1 and 2 GPUs (issue 10's table): Llama-3.2-1B LoRA student (rank 64 on q,v,o + MLP, as in issue 9) <- Llama-3.1-8B teacher, shipped
# transfer passages packed to 1024 tokens, batch 4 per GPU, STEPS steps; eager and compile=true; on 2 GPUs the
# teacher replicated (one full copy per GPU) and sharded (FSDP2). Prints one table: tokens/s over all GPUs
# (median of the steps after the first 5, from metrics.jsonl), speedup over 1 GPU, and peak GiB per GPU.
#
#   bash bench/multi_gpu.sh STUDENT_HF_DIR TEACHER_HF_DIR [OUT_DIR]
#   STEPS=30 NPROCS="1 2 4" bash bench/multi_gpu.sh models/rand-1b models/rand-8b /tmp/mgpu_bench
#
# Needs `recipe` importable (run from the repository root) and the GPUs visible to this shell.
set -euo pipefail
student=${1:?student HF folder (random-weight Llama-3.2-1B)}
teacher=${2:?teacher HF folder (random-weight Llama-3.1-8B)}
out=${3:-/tmp/recipe_multi_gpu_bench}
steps=${STEPS:-30}
nprocs=${NPROCS:-"1 2"}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

run() {  # name nproc compile placement
    local name=$1 n=$2 compile=$3 placement=$4 launch=()
    ((n > 1)) && launch=(--nproc-per-node "$n" --standalone)
    echo "== $name" >&2
    rm -rf "${out:?}/$name"
    if ! $py -m llm_recipe.cli.main run "${launch[@]}" kd --config kd/llama3_1_8b_to_llama3_2_1b \
        teacher.checkpoint_dir="$teacher" student.checkpoint_dir="$student" output_dir="$out/$name" \
        "lora={rank: 64, alpha: 128.0, targets: [q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}" \
        dataset.source=transfer:passages dataset.format=text dataset.packed=true dataset.max_seq_len=1024 \
        dataset.use_chat_template=false batch_size=4 gradient_accumulation_steps=1 max_steps="$steps" \
        save_every_n_steps=null keep_last_n=1 compile="$compile" teacher.placement="$placement" \
        >"$out/$name.log" 2>&1; then
        echo "   failed: see $out/$name.log" >&2
        tail -5 "$out/$name.log" >&2
    fi
}

for n in $nprocs; do
    for compile in false true; do
        if ((n == 1)); then
            run "n1_compile-${compile}" 1 "$compile" auto
        else
            for placement in replicate shard; do
                run "n${n}_compile-${compile}_${placement}" "$n" "$compile" "$placement"
            done
        fi
    done
done

$py - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
for d in sorted(p for p in out.iterdir() if p.is_dir()):
    m = d / "metrics.jsonl"
    lines = [json.loads(x) for x in m.read_text().splitlines() if x.strip()] if m.is_file() else []
    done = (d / "model").is_dir()
    tps = statistics.median(r["tokens_per_s"] for r in lines[5:]) if len(lines) > 5 else float("nan")
    peak = max((r["peak_memory_gib"] for r in lines), default=float("nan"))
    rows.append((d.name, tps, peak, "ok" if done else "FAILED (no model/)"))
base = {n.split("_")[1]: t for n, t, _, _ in rows if n.startswith("n1_")}  # compile-false / compile-true
print("| run | tokens/s (all GPUs) | x 1 GPU | peak GiB per GPU | result |")
print("| --- | ---: | ---: | ---: | --- |")
for name, tps, peak, result in rows:
    ref = base.get(name.split("_")[1])
    speed = f"{tps / ref:.2f}x" if ref else "-"
    print(f"| {name} | {tps:,.0f} | {speed} | {peak:.1f} | {result} |")
EOF
