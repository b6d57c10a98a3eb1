#!/usr/bin/env bash
# A CPU-sized QAT vs PTQ comparison on the embedded SmolLM2-135M-Instruct (docs/kd_study.md, "QAT at CPU scale").
# Same data, steps and lr for both fine-tunes; 8da4w (int8 dynamic activations, int4 weights, group 32).
# Usage: bash bench/qat_cpu.sh [OUT=outputs/qat_cpu] [STEPS=60] [LIMIT=500]
set -euo pipefail
OUT=${1:-outputs/qat_cpu}; STEPS=${2:-60}; LIMIT=${3:-500}
R=".venv/bin/recipe"
COMMON="max_steps=$STEPS batch_size=4 dataset.max_seq_len=128 device=cpu compile=false save_every_n_steps=null overwrite=true"
$R run full --config full/smollm2_study output_dir=$OUT/plain $COMMON
$R run qat --config qat/smollm2_study output_dir=$OUT/qat $COMMON qat.fake_quant_after_n_steps=10 qat.convert=true
$R run quantize --config quantize/smollm2_8da4w model.checkpoint_dir=$OUT/plain/model output_dir=$OUT/ptq \
  'formats=[hf]' perplexity.limit=200
for m in plain/model ptq/hf qat/quantized; do
  $R run eval --config eval/smollm2 model.checkpoint_dir=$OUT/$m 'tasks=[recipe_lambada_openai]' limit=$LIMIT \
    output_dir=$OUT/eval/${m%%/*}
done
