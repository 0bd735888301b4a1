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
cmake --build build-gpu -j"$(nproc)" --target test_cuda_kernels test_cuda_backend bench_cuda_step bench_cuda_attention piper > "$out/build.log" 2>&1 \
  || { echo "build failed (see $out/build.log)"; tail -20 "$out/build.log"; exit 1; }

status=0
echo "== (1) kernels vs host reference (fp32 1e-5, bf16 3e-2) =="
# The fast attention path runs in its own process: a fault there (a sticky CUDA error) must not hide
# the other kernels' results.
build-gpu/bin/test_cuda_kernels --gtest_brief=1 --gtest_filter='-*Attention*' 2>&1 | tee "$out/test_cuda_kernels.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "kernels: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi
echo "== (1a) causal attention: cuDNN, flash and reference kernels vs a double-precision host attention (bf16 3e-2) =="
build-gpu/bin/test_cuda_kernels --gtest_brief=1 --gtest_filter='*Attention*' 2>&1 | tee "$out/test_cuda_flash.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "attention: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi

echo "== (1b) causal attention: cuDNN and flash paths vs reference kernels; vs the measured cuDNN at all 24 kernels.json shapes (target >= 0.70) =="
kjson=../shared/measurements/h200/kernels.json; [ -f "$kjson" ] || kjson=sim/data/kernels-h200-sxm.json
PIPER_KERNELS_JSON=$kjson timeout 240 build-gpu/bin/bench_cuda_attention 2>&1 | tee "$out/bench_cuda_attention.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "attention benchmark: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi

echo "== (2) CUDA backend on virtual devices vs host reference, incl. HSDP, per-microbatch ZeRO, GPT-style models (fp32: loss 1e-5 rel, params 1e-4; bf16: loss 5e-3 rel) =="
build-gpu/bin/test_cuda_backend --gtest_brief=1 --gtest_filter='-*FlashAttention*' 2>&1 | tee "$out/test_cuda_backend.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "backend: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi
# The hd-64 bf16 model end to end on each fast attention path (PIPER_ATTENTION is read once a process).
for path in cudnn flash; do
  PIPER_ATTENTION=$path build-gpu/bin/test_cuda_backend --gtest_brief=1 --gtest_filter='*FlashAttention*' 2>&1 | tee "$out/test_cuda_backend_$path.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 77 ]; then echo "backend ($path attention): skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then status=1; fi
done

echo "== (2b) piper run --backend cuda --virtual-devices (CLI smoke, DualPipeV PP2 x DP2 x EP2, trace) =="
timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --dp 2 --ep 2 --microbatches 4 --schedule dualpipev --steps 3 --seed 7 \
  --report "$out/run-cuda.json" --trace "$out/trace-cuda.json" 2>&1 | tee "$out/run-cuda.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== (2a) bf16 training with the default attention path (cuDNN where it runs) vs PIPER_ATTENTION=reference (head_dim 64, L = 100) =="
hd64="--model tests/data/runtime-small-hd64.json --pp 2 --dp 2 --microbatches 4 --schedule 1f1b --steps 3 --seed 7 --precision bf16"
timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices $hd64 --report "$out/run-flash.json" > "$out/run-flash.log" 2>&1 \
  && PIPER_ATTENTION=reference timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices $hd64 --report "$out/run-refattn.json" \
       >> "$out/run-flash.log" 2>&1 \
  || { echo "attention path runs failed (see $out/run-flash.log)"; tail -3 "$out/run-flash.log"; status=1; }
# bf16 bound of the backend tests (5e-3 relative): the two paths round differently, not more than that.
python3 - "$out/run-flash.json" "$out/run-refattn.json" <<'PY' || status=1
import json, sys
a, b = (json.load(open(p))["losses"] for p in sys.argv[1:3])
worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(f"losses fast {', '.join(f'{x:.5f}' for x in a)} vs reference {', '.join(f'{x:.5f}' for x in b)}: worst relative {worst:.2e} (bound 5e-3)")
sys.exit(0 if worst <= 5e-3 else 1)
PY

echo "== (3) one bf16 training step of a dense 1.1B model on one GPU: MFU, executor overhead, GEMM peak =="
timeout 300 build-gpu/bin/bench_cuda_step 5 2>&1 | tee "$out/bench_cuda_step.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 77 ]; then echo "benchmark: skipped (no GPU)"; elif [ "$rc" -ne 0 ]; then
  status=1
  # Still measure the rest of the step when the attention path is what failed: the flash kernels
  # (which ran on the H200 before the cuDNN path existed), then the reference kernels.
  echo "benchmark failed (exit $rc): again with PIPER_ATTENTION=flash"
  PIPER_ATTENTION=flash timeout 300 build-gpu/bin/bench_cuda_step 3 2>&1 | tee "$out/bench_cuda_step_flash.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "again with PIPER_ATTENTION=reference"
    PIPER_ATTENTION=reference timeout 300 build-gpu/bin/bench_cuda_step 3 2>&1 | tee "$out/bench_cuda_step_reference.log"
  fi
fi

echo "== (3a) side by side: the same dense-1b step in PyTorch (eager and torch.compile), Piper's tok/s as a ratio of each =="
# scripts/measure/torch_dense1b.py is vendored from ../shared/measurements/h200/ (it travels with
# scripts/ in gpu-bundle.sh's .gpu/ and in any clone). Runs only where PyTorch with CUDA is present.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1; then
  timeout 600 python3 scripts/measure/torch_dense1b.py 2>&1 | tee "$out/torch_dense1b.log"
  if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "PyTorch benchmark failed (see $out/torch_dense1b.log)"; status=1
  else
    python3 scripts/measure/bench_ratio.py "$out/bench_cuda_step.log" "$out/torch_dense1b.log" 2>&1 | tee "$out/bench_ratio.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
else
  echo "side by side: skipped (no PyTorch with CUDA for python3)"
fi

echo "== (2c) SM partitioning: DualPipeV with communication on 24 SMs (sm_partition; green contexts on Hopper) =="
timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --dp 2 --ep 2 --microbatches 4 --schedule dualpipev --comm-sms 24 --steps 3 --seed 7 \
  --report "$out/run-cuda-sm24.json" 2>&1 | tee "$out/run-cuda-sm24.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# Same losses as the unpartitioned run above (the partition changes where kernels run, not what they compute).
python3 - "$out/run-cuda.json" "$out/run-cuda-sm24.json" <<'PY' || status=1
import json, sys
a, b = (json.load(open(p))["losses"] for p in sys.argv[1:3])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"sm_partition losses vs shared SMs: worst relative difference {worst:.2e} (bound 1e-5)")
sys.exit(0 if worst <= 1e-5 else 1)
PY
# 20 SMs is not a Hopper green-context partition: one line, exit 2.
build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --microbatches 2 --comm-sms 20 --steps 1 > "$out/run-cuda-sm20.log" 2>&1
echo "--comm-sms 20: exit $? ($(tail -1 "$out/run-cuda-sm20.log"))"

echo "== (2d) checkpoints: save after 2 steps, resume to 3 == 3 uninterrupted steps =="
timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --dp 2 --microbatches 4 --schedule 1f1b --steps 2 --seed 7 --save "$out/ckpt" --report "$out/ckpt-a.json" > "$out/ckpt.log" 2>&1 \
  && timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --dp 2 --microbatches 4 --schedule 1f1b --steps 3 --seed 7 --resume "$out/ckpt" --report "$out/ckpt-b.json" >> "$out/ckpt.log" 2>&1 \
  && timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices --model tests/data/runtime-tiny-moe.json \
  --pp 2 --dp 2 --microbatches 4 --schedule 1f1b --steps 3 --seed 7 --report "$out/ckpt-full.json" >> "$out/ckpt.log" 2>&1 \
  || { echo "checkpoint runs failed (see $out/ckpt.log)"; status=1; }
python3 - "$out/ckpt-b.json" "$out/ckpt-full.json" <<'PY' || status=1
import json, sys
resumed, full = (json.load(open(p))["losses"] for p in sys.argv[1:3])
diff = abs(resumed[-1] - full[-1]) / abs(full[-1])
print(f"resumed step 3 loss {resumed[-1]:.6f} vs uninterrupted {full[-1]:.6f}: relative {diff:.2e} (bound 1e-6)")
sys.exit(0 if diff <= 1e-6 else 1)
PY

echo "== (4) calibrated simulator vs measured step: 3 schedules on 8 virtual devices (target within 5 %) =="
# Each schedule runs twice: once to write the calibration (--calibrate, median per op class over the
# steps after the first), once more to measure; the simulator (analytic engine, one-GPU cluster spec
# with comm_sm_share 0: virtual devices share one GPU, the calibration already holds what that costs)
# predicts the second run's step from the first run's calibration.
cat > "$out/one-gpu.json" <<'JSON'
{"preset": "dgx-h200", "node": {"gpu": {"comm_sm_share": 0}}}
JSON
# The plan: PP2 x DP4 x EP2 = 8 devices, 8 microbatches of the tiny MoE model (its 4 layers allow
# DualPipeV's 4 regions at PP2); fp32 storage, as the equivalence tests.
for sched in 1f1b zb-h1 dualpipev; do
  flags="--model tests/data/runtime-tiny-moe.json --pp 2 --dp 4 --ep 2 --microbatches 8 --schedule $sched"
  timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices $flags --steps 6 --calibrate "$out/calib-$sched.json" > "$out/calib-$sched.log" 2>&1 \
    && timeout 120 build-gpu/bin/piper run --backend cuda --virtual-devices $flags --steps 6 --report "$out/measured-$sched.json" >> "$out/calib-$sched.log" 2>&1 \
    && build-gpu/bin/piper simulate $flags --cluster "$out/one-gpu.json" --engine analytic --calibration "$out/calib-$sched.json" \
         --report "$out/predicted-$sched.json" >> "$out/calib-$sched.log" 2>&1 \
    || { echo "$sched: failed (see $out/calib-$sched.log)"; status=1; continue; }
  python3 - "$sched" "$out/predicted-$sched.json" "$out/measured-$sched.json" <<'PY'
import json, sys
sched, pred, meas = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
p = pred["step_time_s"]
# The measured mean over steps 2..6: the first pays for allocation, as the calibration leaves it out.
steps = meas["step_times_s"][1:]
m = sum(steps) / len(steps)
print(f"{sched:10s} predicted {p*1e3:8.3f} ms  measured {m*1e3:8.3f} ms  error {100*(p-m)/m:+6.1f} %")
PY
done

echo "== (4b) a table calibrated on dense-1b at PP 1 predicts PP 2 and PP 4 on virtual devices sharing the GPU (target within 5 %) =="
# piper calibrate fits the H200 table to the PP 1 run's op times (one device: uncontended); the
# simulator predicts the PP 2 and PP 4 runs with the calibrated table and a cluster that puts all
# devices on the one GPU (devices_per_gpu 8). Written before a GPU ran it (issue 23): its first run
# is its test.
d1b="--model examples/models/dense-1b.json"
if timeout 300 build-gpu/bin/piper run --backend cuda --virtual-devices --precision bf16 $d1b --pp 1 --microbatches 2 --steps 4 \
      --calibrate "$out/d1b-cal.json" > "$out/d1b.log" 2>&1 \
   && build-gpu/bin/piper calibrate $d1b --pp 1 --microbatches 2 --cluster "$out/one-gpu.json" --calibration "$out/d1b-cal.json" \
      -o "$out/d1b-table.json" --cluster-output "$out/d1b-cluster.json" >> "$out/d1b.log" 2>&1; then
  python3 - "$out/d1b-cluster.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["node"]["devices_per_gpu"] = 8; json.dump(c, open(sys.argv[1], "w"))
PY
  for run in "1 2 1f1b" "2 4 1f1b" "2 4 zb-h1" "4 8 1f1b"; do
    read -r pp mb sched <<< "$run"
    flags="$d1b --pp $pp --microbatches $mb --schedule $sched"
    timeout 300 build-gpu/bin/piper run --backend cuda --virtual-devices --precision bf16 $flags --steps 4 --report "$out/d1b-meas-$pp-$sched.json" >> "$out/d1b.log" 2>&1 \
      && build-gpu/bin/piper simulate $flags --cluster "$out/d1b-cluster.json" --engine analytic --report "$out/d1b-pred-$pp-$sched.json" >> "$out/d1b.log" 2>&1 \
      || { echo "dense-1b PP $pp $sched: failed (see $out/d1b.log)"; status=1; continue; }
    python3 - "PP $pp $sched" "$out/d1b-pred-$pp-$sched.json" "$out/d1b-meas-$pp-$sched.json" <<'PY'
import json, sys
name, pred, meas = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
p, steps = pred["step_time_s"], meas["step_times_s"][1:]
m = sum(steps) / len(steps)
print(f"dense-1b {name:12s} predicted {p*1e3:8.3f} ms  measured {m*1e3:8.3f} ms  error {100*(p-m)/m:+6.1f} %")
PY
  done
else
  echo "dense-1b calibration run failed (see $out/d1b.log)"; status=1
fi

echo "== (5) dense-1b trains: 100 bf16 steps on real text with standard settings (the loss must fall) =="
# Byte-level tokens of a real text (piper run --data: each byte mod vocab): the GPL-3 text that
# Debian's base-files installs, else the texts of this tree (docs, or in a .gpu bundle its scripts).
# Standard settings: lr 3e-4 after 10 warmup steps, cosine decay to 3e-5, weight decay 0.1, betas
# 0.9/0.95, clipping at 1.0.
text=/usr/share/common-licenses/GPL-3
if [ ! -r "$text" ]; then
  text="$out/text.txt"
  cat docs/*.md README.md ARCHITECTURE.md scripts/*.sh scripts/*.py 2> /dev/null > "$text"
fi
if timeout 420 build-gpu/bin/piper run --backend cuda --virtual-devices --precision bf16 $d1b --pp 1 --microbatches 2 \
      --steps 100 --data "$text" --lr 3e-4 --warmup-steps 10 --lr-decay cosine --min-lr 3e-5 --weight-decay 0.1 \
      --clip-grad 1.0 --report "$out/train-100.json" > "$out/train-100.log" 2>&1; then
  python3 - "$out/train-100.json" "$out/train-100.csv" <<'PY' || status=1
import json, sys
r = json.load(open(sys.argv[1]))
losses, lrs, norms = r["losses"], r["lrs"], r.get("grad_norms", [])
with open(sys.argv[2], "w") as f:
    f.write("step,loss,lr,grad_norm\n")
    for i, loss in enumerate(losses):
        f.write(f"{i + 1},{loss},{lrs[i]},{norms[i] if i < len(norms) else ''}\n")
first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
print(f"loss: steps 1-10 mean {first:.3f}, steps 91-100 mean {last:.3f} (ln 32000 = 10.373); "
      f"{r['tokens_per_s']:.0f} tok/s; curve -> {sys.argv[2]}")
sys.exit(0 if last < first - 1.0 else 1)
PY
  build-gpu/bin/piper plot "$out/train-100.csv" --x step --y loss --line --title "dense-1b, 100 bf16 steps on real text" \
    -o "$out/train-100.png" > /dev/null 2>&1 && echo "plot -> $out/train-100.png" || echo "plot: not drawn (piper plot needs Qt here)"
else
  echo "100-step training run failed (see $out/train-100.log)"; tail -3 "$out/train-100.log"; status=1
fi

echo "== (6) kernel measurements the cost model lacks: TP-sharded GEMMs, few-head attention, launch floor, Megatron's non-flash attention core (kernels_extra.py) =="
# Data for the per-kernel cost model (docs/cost-model.md), not a check: written to $out/kernels-extra.json
# for a later session to vendor beside sim/data/kernels-h200-sxm.json. Needs PyTorch with CUDA.
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1; then
  timeout 300 python3 scripts/measure/kernels_extra.py "$out/kernels-extra.json" > "$out/kernels-extra.log" 2>&1 \
    && echo "kernels-extra -> $out/kernels-extra.json" || { echo "kernels_extra.py failed (see $out/kernels-extra.log)"; tail -3 "$out/kernels-extra.log"; }
else
  echo "kernel measurements: skipped (no PyTorch with CUDA for python3)"
fi

# Not checked here (issue 9): multi-GPU NCCL runs (this machine has one GPU).
echo "not checked here: multi-GPU NCCL runs (mpirun -np N, one GPU per rank)"
echo "gpu-check: $(( $(date +%s) - start )) s, status $status"
exit $status
