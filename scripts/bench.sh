#!/usr/bin/env bash
# Builds and runs the benchmarks, then prints the ratios docs/performance.md reports.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
source "$root/scripts/setup.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
run() { # benchmark, baseline, candidate
  local out="$build/$1.json"
  "$build/bench/$1" --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true \
    --benchmark_min_time=0.1 --benchmark_out="$out" --benchmark_out_format=json >/dev/null 2>&1
  "$NEML2_DISPATCH_VENV/bin/python" "$root/tools/bench_ratios.py" "$out" "$2" "$3"
  echo
}
run bench_sync_chunking loader_run dispatched
"$NEML2_DISPATCH_VENV/bin/python" "$root/tools/bench_ratios.py" "$build/bench_sync_chunking.json" \
  loader_run prepared
echo
if [ -x "$build/bench/bench_vs_neml2" ]; then
  run bench_vs_neml2 neml2_runtime dispatched
fi
if [ -x "$build/bench/bench_results_into" ]; then
  run bench_results_into copy forward_into
  run bench_results_into forward forward_into
  run bench_results_into neml2_runtime forward_into
fi
if [ -x "$build/bench/bench_hybrid" ]; then
  "$build/bench/bench_hybrid" --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true \
    --benchmark_min_time=0.1 --benchmark_out="$build/bench_hybrid.json" \
    --benchmark_out_format=json >/dev/null 2>&1
  "$NEML2_DISPATCH_VENV/bin/python" "$root/tools/bench_hybrid.py" "$build/bench_hybrid.json"
fi
