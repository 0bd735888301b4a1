#!/usr/bin/env bash
# The curated clang-tidy set (.clang-tidy: bug-prone patterns, needless copies, functions over 100
# lines; warnings are errors) over the sources named, or by default over the contract floor (core/),
# which scripts/test.sh checks; --all checks every C++ source of the default build (outside core/ it
# still has findings to fix). Needs build/compile_commands.json (cmake --preset default).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v clang-tidy >/dev/null || { echo "tidy: clang-tidy not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
[ -f build/compile_commands.json ] || { echo "tidy: build/compile_commands.json missing: run cmake --preset default first" >&2; exit 1; }
if [ "${1:-}" = --all ]; then
  # Every C++ source the default build compiles (the CUDA sources are left to nvcc).
  mapfile -t files < <(python3 -c 'import json; print("\n".join(sorted({e["file"] for e in json.load(open("build/compile_commands.json")) if e["file"].endswith(".cpp") and "/build/" not in e["file"]})))')
elif [ $# -gt 0 ]; then
  files=("$@")
else
  mapfile -t files < <(git ls-files 'core/src/*.cpp' 'core/src/passes/*.cpp')
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p build --quiet >"$log" 2>&1 || status=$?
grep -E '(warning|error): ' "$log" | sort -u || true
if [ $status -ne 0 ]; then
  echo "tidy: findings in ${#files[@]} files checked (see above)" >&2
  exit 1
fi
echo "tidy: ${#files[@]} files clean"
