#!/usr/bin/env bash
# Sets up, builds every target (library, CLI, tests, benchmarks) and runs, in order: with SANITIZE=1
# the test suite under ASan + UBSan (preset "sanitize"; off by default: estimated at ~15 more minutes
# on 2 cores, see docs/reliability.md), a short fuzz run of every libFuzzer harness (preset "fuzz",
# FUZZ_SECONDS each, default 5; SKIP_FUZZ=1 leaves it out), and last the normal test suite through
# CTest (README command 2; .ci/run runs exactly this). Every stage runs even if an earlier one failed;
# the script prints one line per stage and exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "$(id -u)" -eq 0 ]; then
  bash scripts/install-deps.sh || exit 1
else
  echo "test: not root, skipping scripts/install-deps.sh (run it as root if the build misses packages)"
fi

jobs=$(nproc)
cmake --preset default || exit 1
cmake --build --preset default -j"$jobs" || exit 1

summary=()
failed=0
stage() {  # stage NAME COMMAND...: runs it, records its time and status
  local name=$1 start=$SECONDS
  shift
  echo "=== test: $name"
  "$@"
  local rc=$?
  summary+=("$(printf '%-28s %s (%d s)' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)")" $((SECONDS - start)))")
  [ $rc -eq 0 ] || failed=1
}

sanitize() {
  cmake --preset sanitize >/dev/null && cmake --build --preset sanitize -j"$jobs" &&
    ctest --preset sanitize --output-on-failure -j2 2>&1 | tail -n 25
}
fuzz() { bash scripts/fuzz.sh "${FUZZ_SECONDS:-5}"; }

[ "${SANITIZE:-0}" = 1 ] && stage "sanitizers (ASan+UBSan)" sanitize
[ "${SKIP_FUZZ:-0}" = 1 ] || stage "fuzz (${FUZZ_SECONDS:-5} s per harness)" fuzz
stage "test suite (CTest)" ctest --preset default --output-on-failure -j2

echo "=== test: summary"
printf '%s\n' "${summary[@]}"
exit $failed
