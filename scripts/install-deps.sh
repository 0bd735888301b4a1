#!/usr/bin/env bash
# Installs the Debian 12 packages Piper needs to build and test (idempotent; run as root).
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config
  libboost-graph-dev      # global training DAG (Boost.Graph)
  nlohmann-json3-dev      # directive programs, plans, model specs
  libcli11-dev            # the piper command line
  libfmt-dev              # formatting of reports and errors
  libgtest-dev libgmock-dev  # unit and integration tests (CTest)
  libbenchmark-dev        # tests/bench
  libsimgrid-dev          # sim: flow-level network simulation engine
  libeigen3-dev           # gpu_runtime host backend kernels, sim math
  libopenmpi-dev openmpi-bin  # gpu_runtime host backend: one MPI rank per device
  qt6-base-dev libgl-dev  # gui: piper-studio (Qt 6 Widgets)
  qt6-svg-dev             # gui: export the timeline view as SVG (QSvgGenerator)
  libprotobuf-dev protobuf-compiler  # chakra: Chakra execution traces (protoc compiles et_def.proto)
  pybind11-dev python3-dev  # python: the `piper` Python module (tests and gen-docs.py use python3's stdlib)
  python3-pandas          # python: to_dataframe() (optional at run time), so the docs' DataFrame examples run in CI
  jq bc time              # experiments/: the study scripts read JSON reports, time themselves, measure peak RSS
  clang libclang-rt-14-dev  # tests/fuzz: libFuzzer harnesses (clang 14 and its fuzzer/sanitizer runtimes)
  clang-format clang-tidy   # house style: scripts/check-format.sh (.clang-format) and scripts/tidy.sh (.clang-tidy)
)

if [ "$(id -u)" -ne 0 ]; then
  echo "install-deps.sh: must run as root (it calls apt-get)" >&2
  exit 1
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
