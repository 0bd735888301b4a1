#!/usr/bin/env bash
# The curated clang-tidy set (.clang-tidy: bug-prone patterns, needless copies, functions over 100
# lines; warnings are errors) over the sources named, or by default over the directories CI checks
# (CI_DIRS below; scripts/test.sh runs this default); --all checks every C++ source of the default
# build (the CUDA .cu sources are left to nvcc). Needs build/compile_commands.json (cmake --preset default).
# The default build is a unity build, so the database lists its unity translation units (each includes
# up to 8 of a target's sources; a finding names the source file and line) and the sources kept out of
# them: checking those parses each target's headers once per unity unit instead of once per source.
# A source named on the command line is checked alone, with the flags of the unity unit that includes it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v clang-tidy >/dev/null || { echo "tidy: clang-tidy not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
[ -f build/compile_commands.json ] || { echo "tidy: build/compile_commands.json missing: run cmake --preset default first" >&2; exit 1; }
# Clean, and checked by CI within its time (about 100 s on 2 cores): every C++ source of the default
# build under these directories. Outside them: gpu_runtime/, gui/ and python/ are clean too (fifteenth
# session), and would add about 50 s to the stage, which CI's time does not leave; bash
# scripts/tidy.sh --all checks them, and the test programs.
CI_DIRS=(core sim plot chakra search cli)
# The C++ translation units of the default build under the directories given (all of them when none):
# sources, and unity units (build/<dir>/CMakeFiles/<target>.dir/Unity/unity_N_cxx.cxx) by their directory.
sources() {
  python3 - "$@" <<'PY'
import json, os, sys
root = os.getcwd() + "/"
dirs = tuple(d.rstrip("/") + "/" for d in sys.argv[1:])
units = []
for f in sorted({e["file"] for e in json.load(open("build/compile_commands.json"))}):
    if not f.startswith(root):
        continue
    rel = f[len(root):]
    if rel.startswith("build/"):
        if "/Unity/unity_" not in rel or not rel.endswith("_cxx.cxx"):
            continue  # generated sources (data tables, moc) are not checked
        where = rel[len("build/"):]
    elif rel.endswith(".cpp"):
        where = rel
    else:
        continue
    if not dirs or where.startswith(dirs):
        units.append(rel)
print("\n".join(units))
PY
}
if [ "${1:-}" = --all ]; then
  mapfile -t files < <(sources)
elif [ $# -gt 0 ]; then
  files=("$@")
else
  mapfile -t files < <(sources "${CI_DIRS[@]}")
fi
# The database clang-tidy reads: each file's entry of build/compile_commands.json without the
# precompiled header (GCC's .gch, which clang cannot read; the sources include what they use). A
# source named alone is not in it (the unity units that include it are): it takes its unit's flags.
db=$(mktemp -d)
log=$(mktemp)
trap 'rm -f "$log"; rm -rf "$db"' EXIT
python3 - "$db" "${files[@]}" <<'PY'
import json, os, re, sys
entries = json.load(open("build/compile_commands.json"))
by_file = {e["file"]: e for e in entries}
units = [e for e in entries if "/Unity/unity_" in e["file"] and os.path.exists(e["file"])]
out = []
for f in map(os.path.abspath, sys.argv[2:]):
    home = by_file.get(f) or next((u for u in units if '#include "%s"' % f in open(u["file"]).read()), None)
    if home is None:
        continue  # not built by the default preset: clang infers its flags from a neighbour
    command = re.sub(r" -Winvalid-pch| -include \S*cmake_pch\.hxx", "", home["command"])
    out.append(dict(home, command=command.replace(home["file"], f), file=f))
json.dump(out, open(os.path.join(sys.argv[1], "compile_commands.json"), "w"))
PY
status=0
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 1 clang-tidy -p "$db" --quiet >"$log" 2>&1 || status=$?
grep -E '(warning|error): ' "$log" | sort -u || true
if [ $status -ne 0 ]; then
  echo "tidy: findings in ${#files[@]} translation units checked (see above)" >&2
  exit 1
fi
echo "tidy: ${#files[@]} translation units clean"
