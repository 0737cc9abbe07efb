#!/usr/bin/env bash
# The README's second command: install, build, and run the whole test suite with ctest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"
