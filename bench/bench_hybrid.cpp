// GreedyPriorityCapacity against what its devices do alone (SyncChunking on each, measured
// in the same run), against NEML2 3.1's StaticHybridScheduler (same artifact, same
// configuration, same process), and against the custom ThroughputBalancing example; on a
// GPU also capacity 1, 2 and 4 chunks. Names are NAME/BATCH/CHUNK (CPU chunk rows);
// tools/bench_hybrid.py turns a run into the ratios docs/performance.md reports.

#include <algorithm>
#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/StaticHybridScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

#include "../examples/throughput_balancing.hpp"

namespace {

const std::filesystem::path artifacts = NEML2_DISPATCH_BENCH_ARTIFACTS;
constexpr std::int64_t gpu_chunk = 1 << 18;

bool has_gpu() {
  return neml2::device_count(neml2::DeviceFamily::cuda) > 0 &&
         std::filesystem::is_directory(artifacts / "elasticity_gpu/elasticity/cuda");
}

// The CPU-only artifact, or the cpu+cuda one on a GPU machine.
std::filesystem::path stub() {
  return has_gpu() ? artifacts / "elasticity_gpu/elasticity_aoti.i"
                   : artifacts / "elasticity_forward/elasticity_aoti.i";
}

std::vector<neml2::Device> devices() {
  return has_gpu() ? std::vector<neml2::Device>{"cpu", "cuda:0"}
                   : std::vector<neml2::Device>{"cpu"};
}

std::vector<std::int64_t> chunks(std::int64_t cpu_chunk) {
  return has_gpu() ? std::vector<std::int64_t>{cpu_chunk, gpu_chunk}
                   : std::vector<std::int64_t>{cpu_chunk};
}

neml2::TensorMap inputs(std::int64_t batch) {
  return {{"strain", 1e-3 * at::rand({batch, 6}, at::kDouble)}};
}

// The last results against the CPU's, whole batch (scripts/gpu-check.sh fails on the error).
void check_against_cpu(benchmark::State& state, const neml2::TensorMap& x,
                       const at::Tensor& stress) {
  const auto cpu = neml2::load_model(stub(), "elasticity").forward(x).at("stress");
  const auto scale = std::max(cpu.abs().max().item<double>(), 1e-300);
  if ((stress.to(at::kCPU) - cpu).abs().max().item<double>() > 1e-10 * scale)
    state.SkipWithError("results differ from the CPU's");
}

template <class Model>
void measure(benchmark::State& state, const Model& model) {
  const auto x = inputs(state.range(0));
  (void)model.forward(x); // warm-up: lazy kernels, a policy's first measurements
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(x));
  state.SetItemsProcessed(state.iterations() * state.range(0));
  check_against_cpu(state, x, model.forward(x).at("stress"));
}

// The same calls into an output allocated once: no page faults, the engine alone.
template <class Model>
void measure_into(benchmark::State& state, const Model& model) {
  const auto x = inputs(state.range(0));
  const neml2::TensorMap out = {{"stress", at::empty({state.range(0), 6}, at::kDouble)}};
  model.forward_into(x, out);
  for (auto _ : state)
    model.forward_into(x, out);
  state.SetItemsProcessed(state.iterations() * state.range(0));
  check_against_cpu(state, x, out.at("stress"));
}

void sync_cpu_into(benchmark::State& state) {
  measure_into(
      state, neml2::load_model(stub(), "elasticity",
                               neml2::SyncChunking{.device = "cpu", .batch_size = state.range(1)}));
}

void greedy_into(benchmark::State& state) {
  measure_into(state,
               neml2::load_model(stub(), "elasticity",
                                 neml2::GreedyPriorityCapacity{
                                     .devices = devices(), .batch_sizes = chunks(state.range(1))}));
}

void sync_cpu(benchmark::State& state) {
  measure(state,
          neml2::load_model(stub(), "elasticity",
                            neml2::SyncChunking{.device = "cpu", .batch_size = state.range(1)}));
}

void sync_cuda(benchmark::State& state) {
  measure(state,
          neml2::load_model(stub(), "elasticity",
                            neml2::SyncChunking{.device = "cuda:0", .batch_size = gpu_chunk}));
}

void greedy(benchmark::State& state) {
  measure(state,
          neml2::load_model(stub(), "elasticity",
                            neml2::GreedyPriorityCapacity{.devices = devices(),
                                                          .batch_sizes = chunks(state.range(1))}));
}

// The same with room for a second chunk per device: the next chunk waits in the lane's
// queue instead of a thread hand-off after each completion.
void greedy_queued(benchmark::State& state) {
  auto batch_sizes = chunks(state.range(1));
  std::vector<std::int64_t> capacities;
  for (auto b : batch_sizes)
    capacities.push_back(2 * b);
  measure(state, neml2::load_model(stub(), "elasticity",
                                   neml2::GreedyPriorityCapacity{.devices = devices(),
                                                                 .batch_sizes = batch_sizes,
                                                                 .capacities = capacities}));
}

void balanced(benchmark::State& state) {
  measure(state,
          neml2::load_model(stub(), "elasticity", ThroughputBalancing{.devices = devices()}));
}

void neml2_hybrid(benchmark::State& state) {
  neml2::aoti::StaticHybridScheduler::Config config;
  for (const auto& d : devices())
    config.devices.push_back(d.str());
  for (auto c : chunks(state.range(1)))
    config.batch_sizes.push_back(static_cast<std::size_t>(c));
  auto model = neml2::aoti::load_model(
      stub(), "elasticity", std::make_shared<neml2::aoti::StaticHybridScheduler>(config));
  const auto x = inputs(state.range(0));
  (void)model.forward(x);
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(x));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// One GPU, capacity of range(2) chunks: copies of the next chunks overlap compute.
void greedy_cuda_capacity(benchmark::State& state) {
  measure(state, neml2::load_model(
                     stub(), "elasticity",
                     neml2::GreedyPriorityCapacity{.devices = {"cuda:0"},
                                                   .batch_sizes = {gpu_chunk},
                                                   .capacities = {state.range(2) * gpu_chunk}}));
}

// The engine's own cost per chunk: chunks of 16 rows (a graph call of about 0.5 us), so
// (greedy - sync_cpu) / chunks is queueing, waking and booking.
void tiny_chunks(benchmark::internal::Benchmark* b) {
  b->Args({1 << 12, 16})->UseRealTime();
}

void cases(benchmark::internal::Benchmark* b) {
  b->Args({1 << 20, 1 << 12})->Args({1 << 20, 1 << 14})->Args({1 << 20, 1 << 16})->UseRealTime();
}

} // namespace

int main(int argc, char** argv) {
  benchmark::RegisterBenchmark("sync_cpu", sync_cpu)->Apply(cases);
  benchmark::RegisterBenchmark("greedy", greedy)->Apply(cases);
  benchmark::RegisterBenchmark("greedy_queued", greedy_queued)->Apply(cases);
  benchmark::RegisterBenchmark("sync_cpu_into", sync_cpu_into)->Apply(cases);
  benchmark::RegisterBenchmark("greedy_into", greedy_into)->Apply(cases);
  benchmark::RegisterBenchmark("neml2_hybrid", neml2_hybrid)->Apply(cases);
  benchmark::RegisterBenchmark("sync_cpu", sync_cpu)->Apply(tiny_chunks);
  benchmark::RegisterBenchmark("greedy", greedy)->Apply(tiny_chunks);
  benchmark::RegisterBenchmark("balanced", balanced)->Args({1 << 20, 0})->UseRealTime();
  if (has_gpu()) {
    benchmark::RegisterBenchmark("sync_cuda", sync_cuda)->Args({1 << 20, 0})->UseRealTime();
    for (std::int64_t k : {1, 2, 4})
      benchmark::RegisterBenchmark("greedy_cuda_capacity", greedy_cuda_capacity)
          ->Args({1 << 22, 0, k})
          ->UseRealTime();
    benchmark::RegisterBenchmark("sync_cuda", sync_cuda)->Args({1 << 22, 0})->UseRealTime();
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
