#!/usr/bin/env bash
# Bench-only (issue 19's attention lever): bench/attention_speed.py's cudnn_ragged rows under a newer cuDNN than the
# image's torch 2.11 ships (9.19). cuDNN's fast "unified" ragged kernel needs cuDNN >= 9.21; torch 2.14.1 pins
# nvidia-cudnn-cu13 9.24, but a torch wheel is too large to carry, so the image's torch runs on cuDNN 9.28 put in
# place of its own (the machine is discarded afterwards; no recipe does this). The cuDNN libraries (less
# libcudnn_adv: RNNs and the legacy attention API) travel in 9 parts of 50 MB, one call each:
#   here:   cd /tmp && pip download --no-deps nvidia-cudnn-cu13==9.28.1.4 && zip NAME.whl --copy 'nvidia/cudnn/lib/*'
#           -x '*libcudnn_adv*' --out cudnn.zip; split -b 50000000 -d -a 2 cudnn.zip cudnn.zip.; part N in
#           .carry/cudN/ (N = 1..9); .carry/cud9/ also holds cudnn.sha256 and nvidia-cudnn-frontend 1.32.0's wheel
#   device: `bash bench/cudnn_swap.sh part` carrying .carry/cudN, for N = 1..8 (back to back: the machine goes back
#           after 30 s idle), then `bash bench/cudnn_swap.sh run [VARIANTS]` carrying .carry/cud9
set -euo pipefail
P=/tmp/cudparts
mkdir -p $P
for d in .carry/cud*; do [[ -d $d ]] && cp "$d"/* $P/; done
case ${1:-part} in
part)
    ls $P | tr '\n' ' '; echo; du -sh $P
    ;;
run)
    cat $P/cudnn.zip.* >/tmp/cudnn.zip
    echo "$(cat $P/cudnn.sha256)  /tmp/cudnn.zip" | sha256sum -c -
    lib=$(python3 -c "import torch; torch.backends.cudnn.version(); print(next(l.split()[-1] for l in
        open('/proc/self/maps') if 'libcudnn.so' in l).rsplit('/', 1)[0])")
    echo "image cuDNN: $(python3 -c 'import torch; print(torch.backends.cudnn.version())') in $lib"
    python3 - "$lib" <<'PY'  # the image has no unzip
import os, sys, zipfile
with zipfile.ZipFile("/tmp/cudnn.zip") as z:
    for info in z.infolist():
        with z.open(info) as src, open(os.path.join(sys.argv[1], os.path.basename(info.filename)), "wb") as dst:
            dst.write(src.read())
PY
    echo "now: $(python3 -c 'import torch; print(torch.__version__, torch.backends.cudnn.version())')"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fe $P/nvidia_cudnn_frontend-*.whl
    cd bench
    for v in ${2:-8,1,UNIFIED 1,0,UNIFIED 8,1,AUTO}; do
        echo "== $v"
        PYTHONPATH=/tmp/fe python3 attention_speed.py --only "${ROWS:-flex,cudnn_ragged}" --cudnn "$v" 2>&1 \
            | grep -v "nanobind" || true
    done | tee /tmp/cudnn_swap.txt
    [[ -n ${OUT:-} ]] && cp /tmp/cudnn_swap.txt "$OUT/"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    ;;
esac
