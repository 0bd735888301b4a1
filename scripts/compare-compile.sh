#!/usr/bin/env bash
# Checks that two piper binaries compile (and simulate) a set of configurations to the same bytes:
# used to prove that a compiler speed-up changed no output. Usage:
#   scripts/compare-compile.sh REFERENCE_PIPER NEW_PIPER [WORK_DIR]
# Program JSON is compared byte for byte after dropping the two fields that measure the run itself
# (stats.compile_seconds, stats.compiler_peak_rss_bytes); analytic reports likewise without their
# timing fields; a sweep CSV without its compile_time_s and simulate_time_s columns.
set -euo pipefail
ref=$(realpath "$1")
new=$(realpath "$2")
work=${3:-$(mktemp -d)}
mkdir -p "$work"
here=$(cd "$(dirname "$0")/.." && pwd)
fixtures="$here/tests/fixtures/piper-directives"

# One configuration per line: the flags of `piper compile` / `piper simulate`.
configs=(
  "--model qwen3-9b --pp 8 --dp 128 --ep 8 --zero 3 --schedule 1f1b --microbatches 40 --bucket-mb 100 --micro-batch-size 16"
  "--model qwen3-9b --pp 8 --dp 128 --ep 8 --zero 0 --schedule gpipe --microbatches 8 --bucket-mb 0 --micro-batch-size 1"
  "--model qwen3-9b --pp 8 --dp 128 --ep 8 --zero 1 --schedule zb-h1 --microbatches 24 --bucket-mb 100 --micro-batch-size 4"
  "--model qwen3-9b --pp 8 --dp 128 --ep 8 --zero 2 --schedule interleaved-1f1b --microbatches 32 --bucket-mb 0 --micro-batch-size 2"
  "--model qwen3-9b --pp 8 --dp 128 --ep 8 --zero 3 --schedule dualpipev --microbatches 16 --bucket-mb 100 --micro-batch-size 8"
  "--model qwen3-9b --pp 4 --dp 4 --ep 2 --zero 1 --schedule zb-v --microbatches 8"
  "--model qwen3-9b --pp 4 --dp 4 --ep 2 --zero 2 --schedule dualpipe --microbatches 8"
  "--model qwen3-9b --pp 4 --dp 2 --ep 2 --zero 0 --schedule looped-bfs --microbatches 8 --virtual 2"
  "--model qwen3-9b --pp 4 --dp 2 --ep 2 --zero 0 --schedule zb-h2 --microbatches 8"
  "--model llama3-70b --pp 8 --dp 4 --tp 8 --sequence-parallel --recompute selective --zero 1 --schedule 1f1b --microbatches 16"
  "--model llama3-8b --pp 2 --dp 2 --tp 2 --recompute full --zero 3 --schedule interleaved-1f1b --microbatches 8 --bucket-mb 25"
  "--model deepseek-v3 --pp 4 --dp 16 --ep 16 --zero 1 --schedule dualpipev --microbatches 8"
  "--model qwen3-9m --directives $fixtures/pp2_dp2_ep2_custom_order.json"
  "--model qwen3-9m --directives $fixtures/pp2_dp2_ep2_zero3.json --schedule 1f1b --microbatches 4"
  "--model qwen3-9m --directives $fixtures/pp4_dp2_ep2_v_placement.json --schedule zb-v --microbatches 8"
)

strip_program='import json,sys
p=json.load(open(sys.argv[1]))
for k in ("compile_seconds","compiler_peak_rss_bytes"): p.get("stats",{}).pop(k,None)
json.dump(p,open(sys.argv[2],"w"),sort_keys=True)'
strip_report='import json,sys
r=json.load(open(sys.argv[1]))
def drop(x):
  if isinstance(x,dict):
    return {k:drop(v) for k,v in x.items() if k not in ("compile_time_s","simulate_time_s","compile_seconds","simulate_seconds","compiler_peak_rss_bytes","wall_seconds")}
  if isinstance(x,list): return [drop(v) for v in x]
  return x
json.dump(drop(r),open(sys.argv[2],"w"),sort_keys=True)'

fail=0
i=0
for c in "${configs[@]}"; do
  i=$((i + 1))
  for tag in ref new; do
    bin=$ref; [ $tag = new ] && bin=$new
    # shellcheck disable=SC2086
    "$bin" compile $c -o "$work/$i.$tag.program.json" >/dev/null
    python3 -c "$strip_program" "$work/$i.$tag.program.json" "$work/$i.$tag.program.cmp"
    # shellcheck disable=SC2086
    "$bin" simulate $c --engine analytic --report "$work/$i.$tag.report.json" >/dev/null
    python3 -c "$strip_report" "$work/$i.$tag.report.json" "$work/$i.$tag.report.cmp"
  done
  for what in program report; do
    if cmp -s "$work/$i.ref.$what.cmp" "$work/$i.new.$what.cmp"; then
      echo "same      $what  $c"
    else
      echo "DIFFERENT $what  $c"
      fail=1
    fi
  done
done

# A small sweep (both engines' rows are deterministic apart from the two timing columns).
spec="$work/sweep.json"
cat >"$spec" <<JSON
{"model": "qwen3-9b", "cluster": "dgx-h200", "engine": "analytic", "pp": [4, 8], "dp": [16], "ep": 8,
 "zero": [0, 3], "schedule": ["1f1b", "dualpipev", "zb-h1"], "microbatches": [8, 16], "bucket_mb": [0, 100],
 "micro_batch_size": [1, 4]}
JSON
for tag in ref new; do
  bin=$ref; [ $tag = new ] && bin=$new
  rm -f "$work/sweep.$tag.csv"
  "$bin" sweep "$spec" -o "$work/sweep.$tag.csv" -j 2 >/dev/null
  # Rows land in completion order: sort them; drop compile_time_s and simulate_time_s, found by name in
  # the header (a fixed column range went stale when columns were added before them).
  drop=$(head -1 "$work/sweep.$tag.csv" | tr ',' '\n' | grep -n -x -e compile_time_s -e simulate_time_s | cut -d: -f1 | paste -sd,)
  [ -n "$drop" ] || { echo "sweep.$tag.csv: no compile_time_s / simulate_time_s column" >&2; exit 2; }
  cut -d, --complement -f"$drop" "$work/sweep.$tag.csv" | sort >"$work/sweep.$tag.cmp"
done
if cmp -s "$work/sweep.ref.cmp" "$work/sweep.new.cmp"; then
  echo "same      sweep  $(($(wc -l <"$work/sweep.new.cmp") - 1)) rows"
else
  echo "DIFFERENT sweep"
  fail=1
fi
exit $fail
