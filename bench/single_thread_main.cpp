// The main() of the benchmarks against NEML2's runtime on implicit models (bench_implicit,
// bench_krylov): one intra-op thread for both runtimes. The graphs' own kernels are serial
// here, and on a shared two-core machine ATen's OpenMP barriers, not the work, would set
// the time otherwise.

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

int main(int argc, char** argv) {
  at::set_num_threads(1);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
