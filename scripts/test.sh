#!/usr/bin/env bash
# Sets up, builds every target (library, CLI, tests, benchmarks) and runs the test suite through CTest
# (README command 2; .ci/run runs exactly this). Exits with CTest's status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "$(id -u)" -eq 0 ]; then
  bash scripts/install-deps.sh
else
  echo "test: not root, skipping scripts/install-deps.sh (run it as root if the build misses packages)"
fi

cmake --preset default
cmake --build --preset default -j"$(nproc)"
ctest --preset default --output-on-failure -j2
