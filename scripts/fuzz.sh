#!/usr/bin/env bash
# Builds the libFuzzer harnesses (in the sanitize preset's tree, build-sanitize/, which also holds the
# ASan + UBSan test suite) and runs each for SECONDS seconds, then prints executions and findings
# (crashes, leaks, timeouts, out-of-memory) per harness.
# Usage: bash scripts/fuzz.sh SECONDS [HARNESS...]   (default: every harness; exit 1 on any finding)
# Corpora grow in build-sanitize/fuzz/corpus/<harness>/ across runs; each run's findings land in
# build-sanitize/fuzz/findings/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds=${1:?usage: scripts/fuzz.sh SECONDS [HARNESS...]}
shift
all=(fuzz_directives fuzz_model fuzz_cluster fuzz_calibration fuzz_sweep fuzz_pytorch_csv fuzz_plan)
if [ $# -gt 0 ]; then harnesses=("$@"); else harnesses=("${all[@]}"); fi

cmake --preset sanitize >/dev/null
cmake --build --preset sanitize -j"$(nproc)" --target "${harnesses[@]}"
bin=build-sanitize/bin
work=build-sanitize/fuzz
rm -f "$work/summary.txt"

# Seeds: the vendored fixtures, the examples and the test inputs, per input surface. Plans and
# extra programs come from the normal build's piper when it exists (scripts/test.sh builds it first).
seeds=$work/seeds
rm -rf "$seeds"
mkdir -p "$seeds"/{fuzz_directives,fuzz_model,fuzz_cluster,fuzz_calibration,fuzz_sweep,fuzz_pytorch_csv,fuzz_plan}
cp tests/fixtures/piper-directives/*.json "$seeds/fuzz_directives/"
for f in tests/data/bad/*.json; do
  case "$f" in *model*) cp "$f" "$seeds/fuzz_model/" ;; *) cp "$f" "$seeds/fuzz_directives/" ;; esac
done
cp examples/models/*.json tests/data/hf/*.json "$seeds/fuzz_model/"
cp examples/clusters/*.json "$seeds/fuzz_cluster/"
cp tests/fuzz/seeds/calibration/*.json "$seeds/fuzz_calibration/"
cp examples/sweeps/*.json "$seeds/fuzz_sweep/"
cp tests/fixtures/pytorch-schedules/*.csv "$seeds/fuzz_pytorch_csv/"
piper=build/bin/piper
if [ -x "$piper" ]; then
  "$piper" directives --pp 2 --dp 2 --ep 2 --zero 1 --schedule 1f1b --microbatches 2 >"$seeds/fuzz_directives/gen-1f1b.json"
  "$piper" directives --pp 2 --schedule zbh1 --microbatches 2 >"$seeds/fuzz_directives/gen-zbh1.json" 2>/dev/null || true
  "$piper" schedule export-csv 1f1b --ranks 2 --microbatches 3 -o "$seeds/fuzz_pytorch_csv/1f1b.csv"
  "$piper" compile --model examples/models/tiny-moe.json --pp 2 --microbatches 2 -o "$seeds/fuzz_plan/tiny-pp2.json" >/dev/null
  "$piper" compile --model examples/models/tiny-moe.json --dp 2 --ep 2 --zero 3 --microbatches 1 \
    -o "$seeds/fuzz_plan/tiny-dp2-zero3.json" >/dev/null
else
  echo "fuzz: $piper not built; fuzz_plan starts without seeds"
fi

# Findings are per run (fix them before the next): crash-*, leak-*, timeout-*, oom-* inputs and logs.
# FUZZ_SEED fixes libFuzzer's random seed (scripts/test.sh uses 1, so that a CI finding is found again
# by the same seed, given as many seconds); unset, every run explores differently. The table and each finding's first
# frames in Piper's code also go to $work/summary.txt, which scripts/test.sh repeats at its end.
rm -rf "$work/findings"
mkdir -p "$work/findings"
seed_flag=()
[ -n "${FUZZ_SEED:-}" ] && seed_flag=(-seed="$FUZZ_SEED")
export UBSAN_OPTIONS=print_stacktrace=1
# One harness per core at a time (each libFuzzer process is single-threaded); the table below is
# printed in the harnesses' order once all have finished.
run_harness() {
  local h=$1 corpus=$work/corpus/$1
  mkdir -p "$corpus"
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: one using 2 GB is a runaway.
  # -max_len: 64 KiB holds JSON nested far past the json-depth limit (256 levels: 514 bytes), which the
  # dictionary's runs of brackets reach.
  "$bin/$h" "$corpus" "$seeds/$h" -dict=tests/fuzz/piper.dict -max_total_time="$seconds" "${seed_flag[@]}" \
    -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$work/findings/$h-" </dev/null >"$work/findings/$h.log" 2>&1 || true
}
running=0
for h in "${harnesses[@]}"; do
  if [ "$running" -ge "$(nproc)" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_harness "$h" &
  running=$((running + 1))
done
wait
exec > >(tee "$work/summary.txt.tmp")
printf '\n%-20s %12s %8s %8s %8s %8s\n' harness executions crashes leaks timeouts ooms
total_execs=0
total_findings=0
for h in "${harnesses[@]}"; do
  log=$work/findings/$h.log
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  execs=${execs:-0}
  count() { ls "$work/findings" | grep -c "^$h-$1-" || true; }
  crashes=$(count crash); leaks=$(count leak); timeouts=$(count timeout); ooms=$(count oom)
  new=$((crashes + leaks + timeouts + ooms))
  printf '%-20s %12s %8s %8s %8s %8s\n' "$h" "$execs" "$crashes" "$leaks" "$timeouts" "$ooms"
  total_execs=$((total_execs + execs))
  total_findings=$((total_findings + new))
  if [ "$new" -gt 0 ]; then
    { grep -m3 -E 'ERROR|SUMMARY|uncaught|deadly|runtime error' "$log"; grep -m4 -E '^ +#[0-9]+ .* in piper::' "$log"
      ls "$work/findings" | grep "^$h-" | sed "s|^|input: $work/findings/|"; } | sed 's/^/    /' || true
    echo "    reproduce: $bin/$h INPUT"
  fi
done
printf '%-20s %12s   findings: %s (inputs and logs in %s/findings/)\n' total "$total_execs" "$total_findings" "$work"
mv "$work/summary.txt.tmp" "$work/summary.txt"
[ "$total_findings" -eq 0 ]
