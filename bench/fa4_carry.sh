#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, CuTe DSL) and its wheels for the device's Python 3.12, split into three carry
# parts under the 64 MiB a device call takes: .carry/fa4a (the small wheels and the first part of the 92 MB
# nvidia-cutlass-dsl-libs-cu13 wheel), .carry/fa4b and .carry/fa4c (its other parts). Used by
# `bash bench/device_kd.sh attention` (three calls, one part each), a diagnosis of attention kernels: not a dependency.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
get() { python3 -m pip download -q --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
            --only-binary=:all: -d "$tmp" "$@"; }
get --pre flash-attn-4==4.0.0b36
get nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 \
    nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 \
    einops==0.8.2 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==7.36.2
rm -rf .carry/fa4a .carry/fa4b .carry/fa4c && mkdir -p .carry/fa4a .carry/fa4b .carry/fa4c
big=$(ls "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl)
basename "$big" >.carry/fa4a/cu13.name
sha256sum "$big" | cut -d' ' -f1 >.carry/fa4a/cu13.sha256
split -b 31000000 -d "$big" "$tmp/cu13.part."
mv "$tmp/cu13.part.00" .carry/fa4a/ && mv "$tmp/cu13.part.01" .carry/fa4b/ && mv "$tmp/cu13.part.02" .carry/fa4c/
rm "$big" && mv "$tmp"/*.whl .carry/fa4a/ && rmdir "$tmp" 2>/dev/null || true
du -sh .carry/fa4a .carry/fa4b .carry/fa4c
