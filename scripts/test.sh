#!/usr/bin/env bash
# Sets up, checks the house format (scripts/check-format.sh), builds the default preset (library, CLI,
# GUI, Python module, CUDA backend, benchmarks, and the test programs the sanitize stage does not build
# and run: see build_default below), runs the curated clang-tidy set over the directories it keeps clean (core/, sim/,
# plot/, chakra/, search/, cli/: scripts/tidy.sh's CI_DIRS) and then, in
# order: the test suite under ASan + UBSan (preset "sanitize", clang, build-sanitize/: its own build, which also holds the
# libFuzzer harnesses, then CTest; SKIP_SANITIZE=1 leaves both out, though the fuzz stage still
# builds the harnesses), a short fuzz run of every harness (FUZZ_SECONDS each, default 5; SKIP_FUZZ=1
# leaves it out), and last the rest of the test suite through CTest on the default build. README command 2; .ci/run runs
# exactly this. Costs on 2 cores are in docs/reliability.md.
# Every stage runs even if an earlier one failed (except that nothing runs without the normal build);
# the summary prints one line per stage with its time, and the script exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "$(id -u)" -eq 0 ]; then
  bash scripts/install-deps.sh || exit 1
else
  echo "test: not root, skipping scripts/install-deps.sh (run it as root if the build misses packages)"
fi

jobs=$(nproc)
summary=()
failed=0
stage() {  # stage NAME COMMAND...: runs it, records its time and status, returns its status
  local name=$1 start=$SECONDS
  shift
  echo "=== test: $name"
  "$@"
  local rc=$?
  summary+=("$(printf '%-34s %s (%d s)' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAILED ($rc)")" $((SECONDS - start)))")
  [ $rc -eq 0 ] || failed=1
  return $rc
}
print_summary() {
  echo "=== test: summary"
  printf '%s\n' "${summary[@]}"
  # The fuzz table (with each finding's input and first frames) again, where CI logs keep only the end.
  if printf '%s\n' "${summary[@]}" | grep -q '^fuzz.*FAILED' && [ -f build-sanitize/fuzz/summary.txt ]; then
    cat build-sanitize/fuzz/summary.txt
  fi
}

# The GoogleTest programs the sanitize stage builds and runs (clang, ASan + UBSan) are left out of this
# build and its CTest stage (PIPER_SKIP_SANITIZED_TESTS, tests/CMakeLists.txt): compiled and run twice
# they were a third of the script's time. With SKIP_SANITIZE=1 they are built and run here.
skip_sanitized=ON
[ "${SKIP_SANITIZE:-0}" != 1 ] || skip_sanitized=OFF
build_default() {
  cmake --preset default -DPIPER_SKIP_SANITIZED_TESTS=$skip_sanitized && cmake --build --preset default -j"$jobs"
}
build_sanitize() { cmake --preset sanitize >/dev/null && cmake --build --preset sanitize -j"$jobs"; }
# The environment (ASan, UBSan, LSan options and suppressions) comes with the test preset; the mpirun
# tests run without LeakSanitizer, and the MpiLeakCheck.* tests check a few of them for leaks with the
# slow unwinder (tests/CMakeLists.txt, docs/reliability.md).
# LeakSanitizer's tracer itself crashes now and then at process exit (not a leak; see
# tests/sanitizer/lsan_tracer_crashes.py): tests that failed only so run once more, alone.
# The sanitize test preset (CMakePresets.json) leaves out five tune property tests that evaluate every
# candidate of a large space or full-size models (92 s and 42 s under ASan for the first two, 5 s and 3 s
# without; the three step time bound tests 2-8 s each without, 24 s under ASan for the expert
# all-to-all one): the code they run is the tune code the
# other Tune tests run under ASan; the default CTest stage runs them in full. It leaves
# out fidelity_steptimes too: a Python test of the step-time script (not instrumented) whose three
# simulations took 58 s with the sanitized piper, and Experiments.QuickModeRunsEveryStudy (58 s under
# ASan, 15 s without; its piper runs are the paths the CLI tests run under ASan); the CTest stage runs both.
test_sanitize() {
  local junit=build-sanitize/Testing/sanitize-junit.xml
  ctest --preset sanitize --output-on-failure -j2 --output-junit "$PWD/$junit" && return 0
  local crashed
  crashed=$(python3 tests/sanitizer/lsan_tracer_crashes.py "$junit") && [ -n "$crashed" ] || return 1
  echo "test: LeakSanitizer's tracer crashed in: $(echo $crashed); running them once more"
  ctest --preset sanitize --output-on-failure --rerun-failed
}
# A fixed seed: every run tries the same inputs in the same order (as far as its time allows), so a
# CI finding is found again locally with FUZZ_SEED=1 and at least as many seconds.
fuzz() { FUZZ_SEED=${FUZZ_SEED:-1} bash scripts/fuzz.sh "${FUZZ_SECONDS:-5}"; }

stage "format (.clang-format)" bash scripts/check-format.sh
stage "build (preset default)" build_default || { print_summary; exit 1; }
stage "clang-tidy (core/ sim/ plot/ chakra/ search/ cli/)" bash scripts/tidy.sh
if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  stage "build (preset sanitize)" build_sanitize && stage "test suite under ASan+UBSan" test_sanitize
fi
[ "${SKIP_FUZZ:-0}" = 1 ] || stage "fuzz (${FUZZ_SECONDS:-5} s per harness)" fuzz
stage "test suite (CTest)" ctest --preset default --output-on-failure -j2

print_summary
exit $failed
