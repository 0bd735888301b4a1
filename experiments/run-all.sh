#!/usr/bin/env bash
# Reruns every study under experiments/ (each writes its CSV/markdown tables and PNG plots into its
# own folder). `--quick` runs a small subset of each (CI); prints each study's time.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
studies=(bubbles pp-ep-moe pp-zero compile-scale heterogeneous megatron-22b piper-paper fidelity)  # fidelity reads bubbles and megatron-22b
total_start=$(date +%s.%N)
for s in "${studies[@]}"; do
  [ -x "$s/run.sh" ] || { echo "== $s: no run.sh (pending, see $s/README.md)"; continue; }
  start=$(date +%s.%N)
  echo "== $s"
  bash "$s/run.sh" "$@"
  printf "   (%.1f s)\n" "$(echo "$(date +%s.%N) - $start" | bc)"
done
printf "all studies: %.1f s\n" "$(echo "$(date +%s.%N) - $total_start" | bc)"
