#!/usr/bin/env bash
# Builds and runs the benchmarks, then prints the ratios docs/performance.md reports.
# Extra arguments go to the benchmark binary.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
source "$root/scripts/setup.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
out="$build/bench_sync_chunking.json"
"$build/bench/bench_sync_chunking" --benchmark_repetitions=10 \
  --benchmark_enable_random_interleaving=true --benchmark_min_time=0.1 \
  --benchmark_out="$out" --benchmark_out_format=json "$@" >/dev/null
"$NEML2_DISPATCH_VENV/bin/python" "$root/tools/bench_ratios.py" "$out"
