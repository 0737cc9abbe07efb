#!/usr/bin/env bash
# The README's second command: install, build, and run the whole test suite with ctest,
# then the Python module as a user gets it (scripts/python-test.sh: its wheel built and
# installed into a scratch environment, its pytest suites and a C++ consumer against it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
ctest --test-dir "$build" --output-on-failure -j "$(nproc)" "$@"
NEML2_DISPATCH_BUILD="$build" "$root/scripts/python-test.sh"
