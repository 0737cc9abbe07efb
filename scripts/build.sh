#!/usr/bin/env bash
# Installs what is missing, then configures and builds into build/ (Release).
# Extra arguments go to the CMake configure step. NEML2_DISPATCH_TARGETS (space-separated)
# builds only those targets and what they need (scripts/demo.sh: the demo); default all.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/setup.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
  -DNEML2_DISPATCH_PYTHON="$NEML2_DISPATCH_VENV/bin/python" "$@" >/dev/null
targets=()
for t in ${NEML2_DISPATCH_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
