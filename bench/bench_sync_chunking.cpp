// DispatchedModel<SyncChunking> against the torch AOTI loader's own run() on the same
// compiled graph (linear elasticity, float64, cpu). tools/bench_ratios.py turns the
// output into the ratios docs/performance.md reports.

#include <algorithm>
#include <filesystem>

#include <ATen/ATen.h>
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

// A prepared call (names bound once, tensors in order, results in order, no maps).
void prepared(benchmark::State& state) {
  const auto model = neml2::load_model(
      root, "elasticity", neml2::SyncChunking{.device = "cpu", .batch_size = state.range(1)});
  const auto call = model.prepare();
  const std::vector<at::Tensor> inputs = {strain(state.range(0))};
  for (auto _ : state)
    benchmark::DoNotOptimize(call.forward(inputs));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void batches(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch = 1; batch <= (1 << 20); batch *= 4)
    b->Args({batch, 0});
}

// On a GPU (artifact elasticity_gpu, -DNEML2_DISPATCH_GPU_TESTS=ON): cpu inputs, cuda
// compute, cpu results, for both; the copies make each call synchronous.
const auto gpu_root =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "elasticity_gpu" / "elasticity";

void loader_run_cuda(benchmark::State& state) {
  torch::inductor::AOTIModelPackageLoader loader(
      (gpu_root / "cuda/float64/elasticity.pt2").string(), "model", false, 1, 0);
  const auto x = strain(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(loader.run({x.to(at::Device("cuda:0"))})[0].to(at::kCPU));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void dispatched_cuda(benchmark::State& state) {
  const auto model =
      neml2::load_model(gpu_root, "elasticity",
                        neml2::SyncChunking{.device = "cuda:0", .batch_size = state.range(1)});
  const neml2::TensorMap inputs = {{"strain", strain(state.range(0))}};
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(inputs));
  state.SetItemsProcessed(state.iterations() * state.range(0));
  // The last results against the CPU's (scripts/gpu-check.sh fails on the error).
  const auto cpu = neml2::load_model(root, "elasticity").forward(inputs).at("stress");
  const auto error = (model.forward(inputs).at("stress") - cpu).abs().max().item<double>();
  if (error > 1e-10 * std::max(cpu.abs().max().item<double>(), 1e-300))
    state.SkipWithError("results differ from the CPU's");
}

} // namespace

BENCHMARK(loader_run)->Apply(batches)->Args({2, 0})->UseRealTime();
BENCHMARK(dispatched)->Apply(batches)->Args({2, 0})->UseRealTime();
BENCHMARK(dispatched)->Args({1 << 20, 1 << 14})->UseRealTime();
BENCHMARK(prepared)->Args({1, 0})->Args({2, 0})->Args({64, 0})->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (at::hasCUDA() && std::filesystem::is_directory(gpu_root / "cuda")) {
    benchmark::RegisterBenchmark("loader_run_cuda", loader_run_cuda)->Apply(batches)->UseRealTime();
    benchmark::RegisterBenchmark("dispatched_cuda", dispatched_cuda)->Apply(batches)->UseRealTime();
    benchmark::RegisterBenchmark("dispatched_cuda", dispatched_cuda)
        ->Args({1 << 20, 1 << 16})
        ->UseRealTime();
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
