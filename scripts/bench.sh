#!/usr/bin/env bash
# Builds and runs the benchmarks, then prints the ratios docs/performance.md reports.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
source "$root/scripts/setup.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
measure() { # benchmark: one run, its JSON in the build folder
  "$build/bench/$1" --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true \
    --benchmark_min_time=0.1 --benchmark_out="$build/$1.json" --benchmark_out_format=json \
    >/dev/null 2>&1
}
ratios() { # benchmark, baseline, candidate: from the JSON of its last run
  "$NEML2_DISPATCH_VENV/bin/python" "$root/tools/bench_ratios.py" "$build/$1.json" "$2" "$3"
  echo
}
run() { # benchmark, baseline, candidate
  measure "$1"
  ratios "$@"
}
run bench_sync_chunking loader_run dispatched
ratios bench_sync_chunking loader_run prepared
if [ -x "$build/bench/bench_vs_neml2" ]; then
  run bench_vs_neml2 neml2_runtime dispatched
fi
if [ -x "$build/bench/bench_results_into" ]; then
  run bench_results_into copy forward_into
  ratios bench_results_into forward forward_into
  ratios bench_results_into neml2_runtime forward_into
fi
if [ -x "$build/bench/bench_hybrid" ]; then
  measure bench_hybrid
  "$NEML2_DISPATCH_VENV/bin/python" "$root/tools/bench_hybrid.py" "$build/bench_hybrid.json"
fi
