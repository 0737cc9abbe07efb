#!/usr/bin/env bash
# MPI ranks against one process on this machine's cores: the batch split over 1 and 2
# ranks (MPIRankAssign on the CPU, default threads: the cores shared among the ranks)
# against one process with as many threads as cores (SyncChunking; and with one thread,
# for reference), same chunks, same artifact. The runs alternate for several rounds; each
# prints its median time; the table gives the median over rounds and the throughput
# ratio against one process with all the cores' threads. Raw lines: build/bench_mpi.txt.
#   scripts/bench-mpi.sh [rounds=5]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/build.sh"
build="${NEML2_DISPATCH_BUILD:-$root/build}"
rounds="${1:-5}"
cores="$(nproc)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
bench="$build/bench/bench_mpi"
artifacts="$build/artifacts"
log="$build/bench_mpi.txt"
: >"$log"
# model stub, model name, batch, chunk, repeats per run
cases=("$artifacts/elasticity_forward/elasticity_aoti.i elasticity 262144 16384 40"
       "$artifacts/elasticity_forward/elasticity_aoti.i elasticity 1048576 16384 20"
       "$artifacts/perzyna/perzyna_aoti.i perzyna 262144 16384 20"
       "$artifacts/j2_radial_return/model_aoti.i model 65536 16384 10")
for round in $(seq "$rounds"); do
  for c in "${cases[@]}"; do
    read -r stub model batch chunk repeats <<<"$c"
    for threads in 1 "$cores"; do
      "$bench" "$stub" "$model" "$batch" "$chunk" "$repeats" --threads "$threads" |
        sed "s/^/$model /" >>"$log"
    done
    for ranks in 1 2; do
      mpiexec -n "$ranks" "$bench" "$stub" "$model" "$batch" "$chunk" "$repeats" </dev/null |
        sed "s/^/$model /" >>"$log"
    done
  done
done
python3 - "$log" "$cores" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) >= 8 and f[1] == "result":
        runs[(f[0], f[2], int(f[4]))].append(float(f[6]))
groups = sorted({(m, b) for m, _, b in runs}, key=lambda g: (g[0] != "elasticity", g[1]))
print(f"{'model':<11} {'batch':>8} {'run':<26} {'median ms':>10} {'rows/s':>11} {'vs process':>10}")
for model, batch in groups:
    keys = [k for k in runs if k[0] == model and k[2] == batch]
    base = next(k for k in keys if k[1] == f"process_{sys.argv[2]}_threads")
    t0 = statistics.median(runs[base])
    for k in sorted(keys, key=lambda k: (not k[1].startswith("process"), k[1])):
        t = statistics.median(runs[k])
        print(f"{model:<11} {k[2]:>8} {k[1]:<26} {t:>10.2f} {k[2] / t * 1e3:>11.3e} {t0 / t:>10.2f}")
PY
