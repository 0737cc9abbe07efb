// The main() of the benchmarks against NEML2's runtime on implicit models (bench_implicit,
// bench_krylov): one intra-op thread for both runtimes. The graphs' own kernels are serial
// here, and on a shared two-core machine ATen's OpenMP barriers, not the work, would set
// the time otherwise. NEML2_DISPATCH_BENCH_THREADS=N gives both N threads instead.

#include <algorithm>
#include <cstdlib>

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

int main(int argc, char** argv) {
  const char* threads = std::getenv("NEML2_DISPATCH_BENCH_THREADS");
  at::set_num_threads(threads ? std::max(1, std::atoi(threads)) : 1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
