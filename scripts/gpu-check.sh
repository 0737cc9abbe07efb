#!/usr/bin/env bash
# The GPU check, run on the device machine in one call (see the device tool's notes):
#   scripts/prepare-gpu-carry.sh          here, first
#   run: bash scripts/gpu-check.sh        carry: [".carry"], timeout leaving room for a rerun
# Installs neml2 from .carry/wheels beside the machine's torch, builds with the bundled
# headers, compiles the cpu+cuda artifacts (elasticity, with promoted parameters, J2), runs
# the `gpu` tests and the benchmarks (single device, hybrid, J2 against NEML2's runtime),
# checks the benchmarks' results against the CPU, prints one summary table and leaves the
# logs in $OUT (or build-gpu/). Fails unless every gpu test ran and passed and every
# benchmark's results match the CPU's.
# PYTHON picks the python (default python3); NEML2_DISPATCH_GPU_TESTS=OFF rehearses it all
# on a machine without a GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
out="${OUT:-$root/build-gpu}"
mkdir -p "$out"

# neml2 beside the machine's torch (numpy only where the machine lacks it).
site="$root/.carry/site"
if [ ! -d "$site" ]; then
  requirements=$(grep -v '^numpy' .carry/requirements.txt)
  "$python" -c 'import numpy' 2>/dev/null || requirements=$(cat .carry/requirements.txt)
  "$python" -m pip install -q --no-index --no-deps --find-links .carry/wheels --target "$site" \
    $requirements
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$python" -c 'import torch, neml2; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' \
  | tee "$out/versions.txt"

generator=(); command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DNEML2_DISPATCH_PYTHON="$(command -v "$python")" -DNEML2_DISPATCH_BUNDLED_DEPS="$root/.carry/deps" \
  -DNEML2_DISPATCH_GPU_TESTS="${NEML2_DISPATCH_GPU_TESTS:-ON}" > "$out/configure.log"
# Only what the GPU tests and benchmarks need (the CPU suite runs on the project's machine).
targets=(test_cuda bench_sync_chunking bench_hybrid bench_implicit)
[ "${NEML2_DISPATCH_GPU_TESTS:-ON}" = ON ] &&
  targets+=(artifact_elasticity_gpu artifact_elasticity_params_gpu artifact_j2_radial_return_gpu)
cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}" > "$out/build.log" 2>&1 \
  || { tail -50 "$out/build.log"; exit 1; }
# Every `gpu` test must run and pass: a skip (no device visible) fails the check.
require_gpu=(); [ "${NEML2_DISPATCH_GPU_TESTS:-ON}" = ON ] && require_gpu=(NEML2_DISPATCH_REQUIRE_GPU=1)
status=0
env "${require_gpu[@]}" ctest --test-dir build-gpu -V -L gpu > "$out/ctest.log" 2>&1 \
  || status=$?
cat "$out/ctest.log"
ran=$(sed -nE 's/.* tests failed out of ([0-9]+)/\1/p' "$out/ctest.log" | tail -n 1)
cases=$(sed -nE 's/.*\[doctest\] test cases: *//p' "$out/ctest.log" | tail -n 1)
if [ "$status" -ne 0 ] || [ "${ran:-0}" -eq 0 ] || grep -q "did not run" "$out/ctest.log"; then
  verdict="FAILED: not every gpu test ran and passed (ctest status $status, ${ran:-0} tests)"
  grep -q "no CUDA device is visible" "$out/ctest.log" && verdict="$verdict: no GPU is visible"
else
  verdict="passed: all ${ran} gpu tests ran (doctest cases: ${cases:-?})"
fi
[ "${NEML2_DISPATCH_GPU_TESTS:-ON}" = ON ] || verdict="rehearsal only (NEML2_DISPATCH_GPU_TESTS=OFF): $verdict"
build-gpu/bench/bench_sync_chunking --benchmark_repetitions=5 \
  --benchmark_enable_random_interleaving=true --benchmark_min_time=0.1 \
  --benchmark_out="$out/bench_sync_chunking.json" --benchmark_out_format=json > /dev/null 2>&1
for pair in "loader_run dispatched" "loader_run_cuda dispatched_cuda"; do
  "$python" tools/bench_ratios.py "$out/bench_sync_chunking.json" $pair | tee -a "$out/bench.txt"
done
if [ -x build-gpu/bench/bench_hybrid ]; then
  build-gpu/bench/bench_hybrid --benchmark_repetitions=5 --benchmark_enable_random_interleaving=true \
    --benchmark_min_time=0.1 --benchmark_out="$out/bench_hybrid.json" --benchmark_out_format=json \
    > /dev/null 2>&1
  "$python" tools/bench_hybrid.py "$out/bench_hybrid.json" | tee -a "$out/bench.txt"
fi
build-gpu/bench/bench_implicit --benchmark_filter=cuda --benchmark_repetitions=3 \
  --benchmark_enable_random_interleaving=true --benchmark_min_time=0.1 \
  --benchmark_out="$out/bench_implicit.json" --benchmark_out_format=json > /dev/null 2>&1 || true
if grep -q '"dispatched_cuda' "$out/bench_implicit.json" 2>/dev/null; then
  echo "J2 on cuda:0, NEML2's runtime (baseline) against DispatchedModel<SyncChunking>" \
    | tee -a "$out/bench.txt"
  "$python" tools/bench_ratios.py "$out/bench_implicit.json" neml2_runtime_cuda dispatched_cuda \
    | tee -a "$out/bench.txt"
fi
# Every benchmark checks its last results against the CPU's and reports an error if they
# differ; a benchmark program that wrote no results fails too (bench_implicit runs only its
# GPU cases: none without a GPU).
benches=(bench_sync_chunking bench_hybrid)
[ "${NEML2_DISPATCH_GPU_TESTS:-ON}" = ON ] && benches+=(bench_implicit)
results_verdict=$("$python" - "$out" "${benches[@]}" <<'PY'
import json, sys
from pathlib import Path
out, bad, checked = Path(sys.argv[1]), [], 0
for name in sys.argv[2:]:
    try:
        runs = json.load(open(out / f"{name}.json"))["benchmarks"]
    except (OSError, ValueError, KeyError):
        bad.append(f"{name} wrote no results")
        continue
    for r in runs:
        checked += 1
        if r.get("error_occurred"):
            bad.append(f"{r['name']}: {r.get('error_message', '')}")
print(f"FAILED: {'; '.join(sorted(set(bad)))}" if bad else f"passed: all {checked} entries match the CPU")
PY
)

echo
echo "=== gpu-check summary"
row() { printf '| %-22s | %s |\n' "$1" "$2"; }
row "what" "result"
row "----" "------"
row "gpu tests" "$verdict"
row "benchmark results" "$results_verdict"
if [ -f "$out/bench.txt" ]; then
  while IFS= read -r line; do row "figure" "$line"; done < "$out/bench.txt"
fi
case "$verdict $results_verdict" in *FAILED*) exit 1 ;; esac
