#!/usr/bin/env bash
# Replays `piper export-chakra` traces in ASTRA-sim's analytical (congestion-unaware) backend and
# compares ASTRA-sim's step time with `piper simulate --engine analytic` on the same plan.
#
#   scripts/astra-sim-replay.sh [PIPER]        (PIPER: the piper binary, default build/bin/piper)
#
# ASTRA-sim is found as $ASTRA_SIM (the binary AstraSim_Analytical_Congestion_Unaware) or on PATH;
# without it the script prints SKIP and exits 77 (CTest's skip code). Building it:
# docs/simulator.md, "Replaying in ASTRA-sim".
#
# Each plan is compiled, exported with --compute-times (the cost model's compute times on the compute
# nodes, so both simulators run the same compute) and replayed with its communicator-group file. The
# network is matched on both sides: one NVLink switch, Piper's per-direction bandwidth B and latency
# alpha given to ASTRA-sim as B (in its GiB/s) and alpha/2 per link (its switch path is two links).
# Compute is not slowed by communication on the Piper side (comm_sm_share 0): ASTRA-sim has no such
# effect. A plan fails when ASTRA-sim does not finish every NPU (a deadlock), or when its step differs
# from Piper's by more than $ASTRA_SIM_TOLERANCE percent (default 3: ASTRA-sim runs one communication
# at a time per NPU, which delays the ZeRO-3 plan's pipeline sends behind its all-gathers by about
# 2 %; the other plans agree within 0.5 %). Logs stay in $OUT (default a
# temporary folder, removed on success).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

piper="${1:-${PIPER:-build/bin/piper}}"
tolerance="${ASTRA_SIM_TOLERANCE:-3}"
astra="${ASTRA_SIM:-$(command -v AstraSim_Analytical_Congestion_Unaware || true)}"
if [ -z "$astra" ]; then
  echo "SKIP: ASTRA-sim's analytical backend was not found (set ASTRA_SIM to AstraSim_Analytical_Congestion_Unaware or put it on PATH)"
  exit 77
fi
[ -x "$astra" ] || { echo "astra-sim-replay: ASTRA_SIM=$astra is not an executable file" >&2; exit 2; }
[ -x "$piper" ] || { echo "astra-sim-replay: $piper is not an executable piper binary (give its path)" >&2; exit 2; }
command -v python3 > /dev/null || { echo "astra-sim-replay: python3 is needed to read the reports" >&2; exit 2; }

keep=1
if [ -z "${OUT:-}" ]; then OUT="$(mktemp -d "${TMPDIR:-/tmp}/piper-astra.XXXXXX")"; keep=0; fi
mkdir -p "$OUT"
# ASTRA-sim takes any --comm-group-configuration path containing "empty" as "no groups".
case "$OUT" in *empty*) echo "astra-sim-replay: the output folder $OUT contains 'empty', which ASTRA-sim reads as 'no groups'" >&2; exit 2 ;; esac

# The network both sides use: NVLink 370 GB/s per direction (what NCCL reaches on H200), 2 us latency.
bw_gb=370
latency_us=2
cat > "$OUT/cluster.json" << EOF
{"name": "astra-replay", "preset": "dgx-h200",
 "node": {"gpu": {"preset": "h200-sxm", "comm_sm_share": 0},
          "nvlink_bandwidth_gb_per_s": $bw_gb, "nvlink_efficiency": 1, "nvlink_latency_us": $latency_us}}
EOF
cat > "$OUT/system.json" << 'EOF'
{
  "scheduling-policy": "FIFO",
  "endpoint-delay": 0,
  "active-chunks-per-dimension": 1,
  "preferred-dataset-splits": 1,
  "all-reduce-implementation": ["ring"],
  "all-gather-implementation": ["ring"],
  "reduce-scatter-implementation": ["ring"],
  "all-to-all-implementation": ["direct"],
  "collective-optimization": "baseline",
  "local-mem-bw": 4800,
  "boost-mode": 0,
  "roofline-enabled": 0,
  "track-local-mem": 0
}
EOF
echo '{"memory-type": "NO_MEMORY_EXPANSION"}' > "$OUT/memory.json"
network() {  # $1: NPUs
  python3 - "$1" "$bw_gb" "$latency_us" << 'EOF'
import sys
npus, bw_gb, lat_us = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
# ASTRA-sim's GB/s is 2^30 bytes/s; a switch path is two links, each with this latency (ns).
print(f"topology: [ Switch ]\nnpus_count: [ {npus} ]\nbandwidth: [ {bw_gb * 1e9 / 2**30:.6f} ]\nlatency: [ {lat_us * 1e3 / 2:.3f} ]")
EOF
}

# name | flags of `piper compile` (4 and 8 NPUs, 1F1B and DualPipeV, with and without EP, ZeRO-1/3)
cases=(
  "pp2-dp2-1f1b|--pp 2 --dp 2 --schedule 1f1b --microbatches 4"
  "pp2-dp2-ep2-1f1b|--pp 2 --dp 2 --ep 2 --schedule 1f1b --microbatches 4"
  "pp2-dp2-dualpipev|--pp 2 --dp 2 --schedule dualpipev --microbatches 4"
  "pp2-dp4-ep2-dualpipev|--pp 2 --dp 4 --ep 2 --schedule dualpipev --microbatches 4"
  "pp4-dp2-1f1b|--pp 4 --dp 2 --schedule 1f1b --microbatches 8"
  "pp4-dp2-ep2-dualpipev|--pp 4 --dp 2 --ep 2 --schedule dualpipev --microbatches 8"
  "pp2-dp4-zero3-1f1b|--pp 2 --dp 4 --zero 3 --schedule 1f1b --microbatches 4"
  "pp2-dp2-ep2-zero1-1f1b|--pp 2 --dp 2 --ep 2 --zero 1 --schedule 1f1b --microbatches 4"
)
model="${ASTRA_SIM_MODEL:-qwen3-1b}"

failed=0
printf '%-24s %5s %8s %14s %14s %9s\n' plan NPUs nodes "piper (ms)" "astra-sim (ms)" "diff (%)"
for c in "${cases[@]}"; do
  name="${c%%|*}"
  flags="${c#*|}"
  dir="$OUT/$name"
  mkdir -p "$dir"
  # shellcheck disable=SC2086 # flags are words
  if ! "$piper" compile --model "$model" $flags -o "$dir/plan.json" > "$dir/compile.log" 2>&1 ||
     ! "$piper" export-chakra "$dir/plan.json" -o "$dir" --compute-times --cluster "$OUT/cluster.json" > "$dir/export.log" 2>&1 ||
     ! "$piper" simulate --plan "$dir/plan.json" --engine analytic --cluster "$OUT/cluster.json" --report "$dir/report.json" > "$dir/simulate.log" 2>&1; then
    echo "$name: piper failed (logs in $dir)"; tail -3 "$dir"/*.log; failed=1; keep=1; continue
  fi
  npus=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["num_devices"])' "$dir/plan.json")
  nodes=$(sed -n 's/.*(\([0-9]*\) nodes).*/\1/p' "$dir/export.log")
  network "$npus" > "$dir/network.yml"
  # In a subshell whose messages ("Aborted") go to the log too.
  (timeout 600 "$astra" --workload-configuration="$dir/piper" --comm-group-configuration="$dir/piper.comm_groups.json" \
    --system-configuration="$OUT/system.json" --remote-memory-configuration="$OUT/memory.json" \
    --network-configuration="$dir/network.yml" --logging-folder="$dir/log" > "$dir/astra.log" 2>&1; exit $?) 2>> "$dir/astra.log"
  rc=$?
  result=$(python3 - "$dir/report.json" "$dir/astra.log" "$npus" "$tolerance" "$rc" << 'EOF'
import json, re, sys
report, log, npus, tol, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
piper_s = json.load(open(report))["step_time_s"]
# "sys[3] finished, 123456 cycles, exposed communication ..." once per NPU that ran to its end (ns).
done = {int(m.group(1)): int(m.group(2)) for m in re.finditer(r"sys\[(\d+)\] finished, (\d+) cycles", open(log, errors="replace").read())}
if len(done) != npus:
    print(f"FAIL {piper_s * 1e3:.3f} - - deadlock or crash: {len(done)} of {npus} NPUs finished (exit {rc})")
    sys.exit()
astra_s = max(done.values()) * 1e-9
diff = 100 * (astra_s - piper_s) / piper_s
# Every NPU finished and reported; a non-zero exit after that is ASTRA-sim's teardown (it can free a
# subgroup's collective implementation twice), not the replay: reported, not failed.
note = f"(ASTRA-sim exited {rc} in its teardown, after every NPU finished)" if rc != 0 else ""
print(f"{'ok' if abs(diff) <= tol else 'FAIL'} {piper_s * 1e3:.3f} {astra_s * 1e3:.3f} {diff:+.2f} {note}")
EOF
)
  read -r verdict p_ms a_ms diff rest <<< "$result"
  printf '%-24s %5s %8s %14s %14s %9s %s\n' "$name" "$npus" "$nodes" "$p_ms" "$a_ms" "$diff" "${rest:-}"
  if [ "$verdict" != ok ]; then failed=1; keep=1; echo "  logs: $dir"; tail -5 "$dir/astra.log"; fi
done

if [ "$failed" -ne 0 ]; then
  echo "astra-sim-replay: FAILED (tolerance ${tolerance} %; logs in $OUT)"
  exit 1
fi
echo "astra-sim-replay: all ${#cases[@]} plans replayed, steps within ${tolerance} % of piper simulate --engine analytic"
[ "$keep" -eq 0 ] && rm -rf "$OUT"
exit 0
