// DispatchedModel<SyncChunking> against the torch AOTI loader's own run() on the same
// compiled graph (linear elasticity, float64, cpu). tools/bench_ratios.py turns the
// output into the ratios docs/performance.md reports.

#include <filesystem>

#include <benchmark/benchmark.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <neml2/dispatch.hpp>

namespace {

const std::filesystem::path root =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "elasticity_forward" / "elasticity";

at::Tensor strain(std::int64_t batch) {
  return 1e-3 * at::rand({batch, 6}, at::kDouble);
}

// The baseline: the compiled graph called directly, no names, no checks.
void loader_run(benchmark::State& state) {
  torch::inductor::AOTIModelPackageLoader loader((root / "cpu/float64/elasticity.pt2").string());
  const std::vector<at::Tensor> inputs = {strain(state.range(0))};
  for (auto _ : state)
    benchmark::DoNotOptimize(loader.run(inputs));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// DispatchedModel<SyncChunking>: the whole batch (range 1 = 0) or chunks of range(1) rows.
void dispatched(benchmark::State& state) {
  const auto model = neml2::load_model(
      root, "elasticity", neml2::SyncChunking{.device = "cpu", .batch_size = state.range(1)});
  const neml2::TensorMap inputs = {{"strain", strain(state.range(0))}};
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(inputs));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void batches(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch = 1; batch <= (1 << 20); batch *= 4)
    b->Args({batch, 0});
}

} // namespace

BENCHMARK(loader_run)->Apply(batches)->UseRealTime();
BENCHMARK(dispatched)->Apply(batches)->UseRealTime();
BENCHMARK(dispatched)->Args({1 << 20, 1 << 14})->UseRealTime();

BENCHMARK_MAIN();
