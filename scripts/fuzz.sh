#!/usr/bin/env bash
# The libFuzzer targets (fuzz/): scripts/fuzz.sh [seconds per target, default 60]
# Builds the fuzz preset (clang, ASan + UBSan: the library and fuzz/ only) into
# build-fuzz/ and runs each target as a ctest test from the seeds in fuzz/corpus/, one
# target per core at a time (each is single-threaded): 4 targets of 60 s take 2 minutes
# on 2 cores.
# A crashing input is written to build-fuzz/fuzz/crash-*; replay it with
#   build-fuzz/fuzz/fuzz_metadata build-fuzz/fuzz/crash-...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
source "$root/scripts/setup.sh"
cd "$root"
cmake --preset fuzz -DNEML2_DISPATCH_FUZZ_SECONDS="$seconds" >/dev/null
cmake --build --preset fuzz --target fuzz_targets -j "$(nproc)"
ctest --preset fuzz -j "$(nproc)"
