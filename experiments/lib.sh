# Shared helpers for the experiment scripts (sourced): paths, quick mode, CSV -> markdown, plots.
# Every study writes into its own folder: results.csv (or several CSVs), results.md, and PNG plots.
set -euo pipefail
EXPERIMENTS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "$EXPERIMENTS_DIR/.." && pwd)"
PIPER="${PIPER:-$REPO_DIR/build/bin/piper}"
QUICK=0
for arg in "$@"; do [ "$arg" = "--quick" ] && QUICK=1; done
[ -x "$PIPER" ] || { echo "experiments: $PIPER not found; build it first (cmake --build build --target piper)" >&2; exit 2; }

# enter_study NAME: change into the folder the study writes to. Full mode writes into the study's
# own folder (the committed tables and plots); quick mode, or EXPERIMENTS_OUT, writes under
# ${EXPERIMENTS_OUT:-build/experiments-quick}/NAME, with the study's inputs/ linked in.
enter_study() {
  STUDY_SRC="$EXPERIMENTS_DIR/$1"
  local out="${EXPERIMENTS_OUT:-}"
  [ -z "$out" ] && [ "$QUICK" = 1 ] && out="$REPO_DIR/build/experiments-quick"
  if [ -n "$out" ]; then
    mkdir -p "$out/$1" && cd "$out/$1"
    if [ -d "$STUDY_SRC/inputs" ]; then ln -sfn "$STUDY_SRC/inputs" inputs; fi
  else
    cd "$STUDY_SRC"
  fi
}

# csv_to_md FILE: a CSV with a header row as a GitHub markdown table on stdout.
csv_to_md() {
  awk -F, 'NR==1 { printf "|"; for (i=1;i<=NF;i++) printf " %s |", $i; printf "\n|"; for (i=1;i<=NF;i++) printf "---|"; printf "\n"; next }
           { printf "|"; for (i=1;i<=NF;i++) printf " %s |", $i; printf "\n" }' "$1"
}

# has_plot: whether this piper build can draw (the offscreen Qt plotting library). `piper plot --help`
# succeeds in a build without Qt 6 Gui too (the subcommand exists and says it cannot draw), so draw one
# point into a scratch folder instead; the answer is kept for the rest of the study.
has_plot() {
  if [ -z "${PIPER_CAN_PLOT:-}" ]; then
    local scratch
    scratch=$(mktemp -d)
    printf 'x,y\n1,1\n' > "$scratch/p.csv"
    PIPER_CAN_PLOT=0
    "$PIPER" plot "$scratch/p.csv" --x x --y y -o "$scratch/p.png" >/dev/null 2>&1 && PIPER_CAN_PLOT=1
    rm -rf "$scratch"
  fi
  [ "$PIPER_CAN_PLOT" = 1 ]
}

# json_num FILE KEY: a top-level number of a piper report.
json_num() { jq -r ".$2" "$1"; }

# Qt (piper plot) wants a private runtime folder; give it one instead of a warning per plot.
if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
  export XDG_RUNTIME_DIR="/tmp/piper-experiments-runtime-$(id -u)"
  mkdir -p "$XDG_RUNTIME_DIR" && chmod 700 "$XDG_RUNTIME_DIR"
fi
