#!/usr/bin/env bash
# Sets up, builds, and runs Piper's main job on its built-in default scenario (README command 1).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Packages come from apt, which needs root; a non-root user is expected to have them already.
if [ "$(id -u)" -eq 0 ]; then
  bash scripts/install-deps.sh
else
  echo "run-default: not root, skipping scripts/install-deps.sh (run it as root if the build misses packages)"
fi

cmake --preset default
cmake --build --preset default -j"$(nproc)"

# The default scenario: Qwen3-MoE 1B (qwen3-1b) on one dgx-h200 node (8 GPUs): DualPipeV over PP 2
# (4 regions in a V, so rank 0 holds the LM head with few blocks) x DP 4, experts sharded over EP 2,
# ZeRO-1, 4 microbatches (65,536 tokens per step), simulated on the
# SimGrid engine. The report and a Chrome trace (open it in Perfetto) land in build/.
build/bin/piper simulate --model qwen3-1b --pp 2 --dp 4 --ep 2 --zero 1 --schedule dualpipev --microbatches 4 \
  --cluster dgx-h200 --report build/default-report.json --trace build/default-trace.json
