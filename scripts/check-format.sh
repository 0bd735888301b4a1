#!/usr/bin/env bash
# The house format (.clang-format, clang-format 14): lists every tracked C++/CUDA file that differs
# from it and exits 1; with --fix, rewrites them in place. scripts/test.sh runs the check first.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v clang-format >/dev/null || { echo "check-format: clang-format not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
mapfile -t files < <(git ls-files -- '*.cpp' '*.hpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = --fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  printf 'check-format: %s differs from .clang-format\n' "${bad[@]}" >&2
  echo "check-format: ${#bad[@]} of ${#files[@]} files; fix with: bash scripts/check-format.sh --fix" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files follow .clang-format"
