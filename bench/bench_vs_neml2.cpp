// DispatchedModel<SyncChunking> against NEML2's own C++ runtime (neml2::aoti, from the
// neml2 wheel) with its SimpleScheduler, on the same compiled artifact, in one process.

#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

namespace {

const auto stub = std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "elasticity_forward" /
                  "elasticity_aoti.i";

std::map<std::string, at::Tensor> inputs(std::int64_t batch) {
  return {{"strain", 1e-3 * at::rand({batch, 6}, at::kDouble)}};
}

void neml2_runtime(benchmark::State& state) {
  auto model = neml2::aoti::load_model(
      stub, "elasticity",
      std::make_shared<neml2::aoti::SimpleScheduler>(
          neml2::aoti::SimpleScheduler::Config{"cpu", static_cast<std::size_t>(state.range(1))}));
  const auto x = inputs(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(x));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void dispatched(benchmark::State& state) {
  const auto model = neml2::load_model(
      stub, "elasticity", neml2::SyncChunking{.device = "cpu", .batch_size = state.range(1)});
  const auto x = inputs(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(x));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void cases(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1, 1 << 10, 1 << 20})
    b->Args({batch, 0});
  b->Args({1 << 20, 1 << 14});
  b->Args({1 << 20, 1 << 12});
}

} // namespace

BENCHMARK(neml2_runtime)->Apply(cases)->UseRealTime();
BENCHMARK(dispatched)->Apply(cases)->UseRealTime();

BENCHMARK_MAIN();
