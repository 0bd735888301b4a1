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
  lld                     # the sanitize preset links with it: ~0.3 s a test program under ASan, ld.bfd 1.4 s
  clang-format clang-tidy   # house style: scripts/check-format.sh (.clang-format) and scripts/tidy.sh (.clang-tidy)
  python3-pip             # fetches the cudnn-frontend headers below (pip download only; nothing is pip-installed)
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
else
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# cuDNN's graph API through NVIDIA's header-only cudnn-frontend (Apache-2.0): the CUDA backend's
# attention (gpu_runtime/cuda/src/cudnn_attention.cpp). Not a Debian package; the CUDA toolkit here
# carries cuDNN itself but not these headers, so they come from PyPI's nvidia-cudnn-frontend wheel,
# pinned by version and SHA-256 (the cp311 manylinux wheel, whatever the local Python), unpacked to
# $fe_dir. Only where the CUDA toolkit is; without the headers the backend builds without cuDNN
# attention (CMake says so), so a failed download warns instead of failing the setup.
fe_version=1.32.0
fe_sha256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0
fe_dir=/usr/local/share/piper/cudnn-frontend-$fe_version
if [ -x /usr/local/cuda/bin/nvcc ] && [ ! -f "$fe_dir/include/cudnn_frontend.h" ]; then
  tmp=$(mktemp -d)
  if python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 \
       --platform manylinux_2_28_x86_64 -d "$tmp" "nvidia-cudnn-frontend==$fe_version" &&
     whl=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl) && echo "$fe_sha256  $whl" | sha256sum -c --quiet - &&
     python3 - "$whl" "$fe_dir.part" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
  then
    rm -rf "$fe_dir" && mv "$fe_dir.part" "$fe_dir" && echo "install-deps: cudnn-frontend $fe_version headers in $fe_dir"
  else
    rm -rf "$fe_dir.part"
    echo "install-deps: warning: could not fetch cudnn-frontend $fe_version; the CUDA backend builds without cuDNN attention" >&2
  fi
  rm -rf "$tmp"
fi
