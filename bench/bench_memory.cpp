// Peak memory of one call over 2^20 rows of elasticity: the most bytes torch's CPU
// allocator held during the call (the inputs, the outputs and whatever the call allocates;
// nothing else of the benchmark is live), against the bytes of the inputs plus the
// outputs. DispatchedModel with SyncChunking and GreedyPriorityCapacity, by forward() and
// by forward_into() (outputs the caller allocated once), and NEML2's own runtime (the
// neml2 wheel's libneml2.so, SimpleScheduler) on the same artifact in the same process.
// Names are NAME/BATCH/CHUNK (0: the whole batch); counters peak_bytes, io_bytes and
// ratio_to_io = peak_bytes / io_bytes (the largest over the iterations).

#include <algorithm>
#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

#include "counting_allocator.hpp"

namespace {

const auto stub = std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "elasticity_forward" /
                  "elasticity_aoti.i";

test::CountingAllocator counting;
// Installed before main(), so before any tensor.
[[maybe_unused]] const bool counting_installed =
    (c10::SetCPUAllocator(&counting, /*priority=*/100), true);

// Runs `call` once unmeasured, then once per iteration from a fresh peak. `baseline`: the
// bytes live before the inputs (and the caller's outputs) were made.
template <class Call>
void measure(benchmark::State& state, std::int64_t baseline, Call&& call) {
  call();
  std::int64_t peak = 0;
  for (auto _ : state) {
    counting.reset();
    call();
    peak = std::max(peak, counting.peak.load() - baseline);
  }
  const auto io = 2 * state.range(0) * 6 * static_cast<std::int64_t>(sizeof(double));
  state.counters["peak_bytes"] = static_cast<double>(peak);
  state.counters["io_bytes"] = static_cast<double>(io);
  state.counters["ratio_to_io"] = static_cast<double>(peak) / static_cast<double>(io);
}

neml2::TensorMap inputs(std::int64_t batch) {
  return {{"strain", 1e-3 * at::rand({batch, 6}, at::kDouble)}};
}

neml2::SyncChunking sync_chunking(const benchmark::State& state) {
  return {.device = "cpu", .batch_size = state.range(1)};
}

neml2::GreedyPriorityCapacity greedy(const benchmark::State& state) {
  return {.devices = {"cpu"}, .batch_sizes = {state.range(1) ? state.range(1) : state.range(0)}};
}

template <class Policy>
void forward(benchmark::State& state, Policy policy) {
  const auto model = neml2::load_model(stub, "elasticity", std::move(policy));
  const auto baseline = counting.live.load();
  const auto x = inputs(state.range(0));
  measure(state, baseline, [&] { benchmark::DoNotOptimize(model.forward(x)); });
}

template <class Policy>
void forward_into(benchmark::State& state, Policy policy) {
  const auto model = neml2::load_model(stub, "elasticity", std::move(policy));
  const auto baseline = counting.live.load();
  const auto x = inputs(state.range(0));
  const neml2::TensorMap out = {{"stress", at::empty({state.range(0), 6}, at::kDouble)}};
  measure(state, baseline, [&] { model.forward_into(x, out); });
}

void sync_forward(benchmark::State& state) {
  forward(state, sync_chunking(state));
}
void greedy_forward(benchmark::State& state) {
  forward(state, greedy(state));
}
void sync_forward_into(benchmark::State& state) {
  forward_into(state, sync_chunking(state));
}
void greedy_forward_into(benchmark::State& state) {
  forward_into(state, greedy(state));
}

void neml2_runtime(benchmark::State& state) {
  auto model = neml2::aoti::load_model(
      stub, "elasticity",
      std::make_shared<neml2::aoti::SimpleScheduler>(
          neml2::aoti::SimpleScheduler::Config{"cpu", static_cast<std::size_t>(state.range(1))}));
  const auto baseline = counting.live.load();
  const auto x = inputs(state.range(0));
  measure(state, baseline, [&] { benchmark::DoNotOptimize(model.forward(x)); });
}

void cases(benchmark::internal::Benchmark* b) {
  for (std::int64_t chunk : {1 << 14, 1 << 16, 0})
    b->Args({1 << 20, chunk});
  b->Iterations(3)->UseRealTime();
}

} // namespace

BENCHMARK(sync_forward)->Apply(cases);
BENCHMARK(greedy_forward)->Apply(cases);
BENCHMARK(sync_forward_into)->Apply(cases);
BENCHMARK(greedy_forward_into)->Apply(cases);
BENCHMARK(neml2_runtime)->Apply(cases);

BENCHMARK_MAIN();
