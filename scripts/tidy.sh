#!/usr/bin/env bash
# The curated clang-tidy set (.clang-tidy: bug-prone patterns, needless copies, functions over 100
# lines; warnings are errors) over the sources named, or by default over the directories CI checks
# (CI_DIRS below; scripts/test.sh runs this default); --all checks every C++ source of the default
# build (the CUDA .cu sources are left to nvcc). Needs build/compile_commands.json (cmake --preset default).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v clang-tidy >/dev/null || { echo "tidy: clang-tidy not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
[ -f build/compile_commands.json ] || { echo "tidy: build/compile_commands.json missing: run cmake --preset default first" >&2; exit 1; }
# Clean, and checked by CI within its time (about 200 s on 2 cores): every C++ source of the default
# build under these directories. Outside them: gpu_runtime/, cli/, gui/ and python/ are clean too except
# gpu_runtime/cuda/src/cuda_trainer.cpp (train_virtual), but they would take the stage well past its
# time (README, house style); bash scripts/tidy.sh --all checks them.
CI_DIRS=(core sim plot chakra search)
# The C++ sources of the default build under the directories given (all of them when none).
sources() {
  python3 - "$@" <<'PY'
import json, os, sys
root = os.getcwd() + "/"
dirs = tuple(d.rstrip("/") + "/" for d in sys.argv[1:])
files = {e["file"] for e in json.load(open("build/compile_commands.json"))}
rel = sorted(f[len(root):] for f in files if f.startswith(root) and f.endswith(".cpp") and not f.startswith(root + "build/"))
print("\n".join(f for f in rel if not dirs or f.startswith(dirs)))
PY
}
if [ "${1:-}" = --all ]; then
  mapfile -t files < <(sources)
elif [ $# -gt 0 ]; then
  files=("$@")
else
  mapfile -t files < <(sources "${CI_DIRS[@]}")
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
