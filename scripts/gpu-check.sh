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
cmake --build build-gpu -j"$(nproc)" --target test_cuda_kernels test_cuda_backend bench_cuda_step piper > "$out/build.log" 2>&1 \
  || { echo "build failed (see $out/build.log)"; tail -20 "$out/build.log"; exit 1; }

status=0
echo "== (1) kernels vs host reference (fp32 1e-5, bf16 3e-2) =="
build-gpu/bin/test_cuda_kernels --gtest_brief=1 2>&1 | tee "$out/test_cuda_kernels.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "kernels: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi

echo "== (2) CUDA backend on virtual devices vs host reference (fp32: loss 1e-5 rel, params 1e-4; bf16: loss 5e-3 rel) =="
build-gpu/bin/test_cuda_backend --gtest_brief=1 2>&1 | tee "$out/test_cuda_backend.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "backend: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi

echo "== (2b) piper run --backend cuda --virtual-devices (CLI smoke, DualPipeV PP2 x DP2 x EP2, trace) =="
timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --dp 2 --ep 2 --microbatches 4 --schedule dualpipev --steps 3 --seed 7 \
  --report "$out/run-cuda.json" --trace "$out/trace-cuda.json" 2>&1 | tee "$out/run-cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== (3) one bf16 training step of a dense 1.1B model on one GPU: MFU, executor overhead, GEMM peak =="
timeout 300 build-gpu/bin/bench_cuda_step 5 2>&1 | tee "$out/bench_cuda_step.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "benchmark: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi

# Not built yet (issue 9): `--calibrate` and calibrated simulator-vs-measured step times, SM
# partitioning (green contexts), a fused attention fast path (the benchmark uses the explicit-
# probabilities attention kernel), and multi-GPU NCCL runs (this machine has one GPU). This script
# says so rather than pretending they ran.
echo "== (4) calibration (predicted vs measured on 8 virtual devices): not built yet =="
echo "gpu-check: $(( $(date +%s) - start )) s, status $status"
exit $status
