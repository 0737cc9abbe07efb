#!/usr/bin/env bash
# The test suite under a sanitizer: scripts/sanitize.sh asan|tsan [ctest arguments...]
# Configures and builds the CMake preset of that name into build-<preset>/ (g++, as the
# plain build; compiled models come from the same cache), then runs ctest with the
# preset's sanitizer options and suppressions (tools/sanitizers/). Examples:
#   scripts/sanitize.sh asan                 # the whole suite
#   scripts/sanitize.sh tsan -L 'cpu|stress' # what CI runs
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset="${1:?usage: scripts/sanitize.sh asan|tsan [ctest arguments...]}"
shift
source "$root/scripts/setup.sh"
cd "$root"
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)"
ctest --preset "$preset" "$@"
