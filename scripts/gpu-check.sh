#!/usr/bin/env bash
# GPU checks for the CUDA backend, meant for a machine with an NVIDIA GPU (the lent H200): builds the
# CUDA targets and runs every GPU test, writing logs under $OUT (default build/gpu-check). Prints what
# ran and what is not built yet; exits non-zero if a GPU test fails.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-build/gpu-check}"
mkdir -p "$out"
start=$(date +%s)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1 || true
echo "gpu: $(cat "$out/gpu.txt")"

cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPIPER_BUILD_BENCHMARKS=OFF > "$out/configure.log" 2>&1 \
  || { echo "configure failed (see $out/configure.log)"; exit 1; }
cmake --build build-gpu -j"$(nproc)" --target test_cuda_kernels > "$out/build.log" 2>&1 \
  || { echo "build failed (see $out/build.log)"; tail -20 "$out/build.log"; exit 1; }

status=0
echo "== (1) kernels vs host reference (fp32 1e-5, bf16 3e-2) =="
build-gpu/bin/test_cuda_kernels --gtest_brief=1 2>&1 | tee "$out/test_cuda_kernels.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "kernels: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi

# Not built yet (issue 9): the CUDA backend behind gpu_runtime's Backend interface (plan equivalence on
# virtual devices), the one-GPU training-step benchmark (MFU, executor overhead), and calibrated
# simulator-vs-measured step times. This script says so rather than pretending they ran.
echo "== (2) plan equivalence on virtual devices: not built yet =="
echo "== (3) training-step benchmark and calibration: not built yet =="
echo "gpu-check: $(( $(date +%s) - start )) s, status $status"
exit $status
