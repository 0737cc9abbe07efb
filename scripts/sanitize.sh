#!/usr/bin/env bash
# The test suite under a sanitizer: scripts/sanitize.sh asan|tsan [ctest arguments...]
# Configures the CMake preset of that name into build-<preset>/ (g++, as the plain build;
# compiled models come from the same cache), builds the programs the selected tests run
# and nothing else, then runs them with the preset's sanitizer options and suppressions
# (tools/sanitizers/). Examples:
#   scripts/sanitize.sh asan                  # the whole suite
#   scripts/sanitize.sh tsan -L threads       # what CI runs under TSan
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
preset="${1:?usage: scripts/sanitize.sh asan|tsan [ctest arguments...]}"
shift
source "$root/scripts/setup.sh"
cd "$root"
cmake --preset "$preset" >/dev/null
# With ctest arguments, build only the programs the selected tests run, found by the
# suite's naming: test NAME runs test_NAME, example_NAME runs NAME, each with trailing
# _WORDs dropped until a target matches (mpi_rank_assign_2: test_mpi_rank_assign;
# example_mpi_batch_perzyna: mpi_batch); TOPIC:CASE (a suite run a case a process) and
# test_TOPIC_NOT_BUILT-... (its placeholder before the build) run test_TOPIC;
# cli_NAME runs the neml2-dispatch program. Other
# tests whose command is cmake, sh or python match none and build nothing. Without
# arguments, build everything.
build_only=all
if (($#)); then
  known="$(cmake --build --preset "$preset" --target help | sed -n 's/^\.\.\. \([^ ]*\).*/\1/p')"
  targets=()
  while read -r name; do
    case "$name" in
    cli_*) targets+=(neml2_dispatch_program) && continue ;; # the program's tests
    example_*) prefix="" base="${name#example_}" ;;
    *_NOT_BUILT-*) prefix="" base="${name%_NOT_BUILT-*}" ;; # doctest's, before discovery
    *:*) prefix="test_" base="${name%%:*}" ;;                 # one case of a topic
    *) prefix="test_" base="${name%_checked_inputs}" ;;
    esac
    while ! grep -qx "$prefix$base" <<<"$known" && [[ "$base" == *_* ]]; do base="${base%_*}"; done
    if grep -qx "$prefix$base" <<<"$known"; then targets+=("$prefix$base"); fi
  done < <(ctest --preset "$preset" -N "$@" | sed -n 's/^ *Test *#[0-9]*: //p')
  ((${#targets[@]})) || { echo "sanitize: no test selected by: $*" >&2; exit 2; }
  cmake --preset "$preset" -DNEML2_DISPATCH_BUILD_ONLY="$(printf '%s\n' "${targets[@]}" | sort -u | paste -sd';')" >/dev/null
  build_only=neml2_dispatch_build_only
fi
cmake --build --preset "$preset" -j "$(nproc)" --target "$build_only"
ctest --preset "$preset" "$@"
