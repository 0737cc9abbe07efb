// forward() against forward_into() (results into tensors the caller owns and reuses), a
// streaming copy of the same bytes, and NEML2's own runtime, on the same artifact in one
// process; jacobian() against jacobian_into() on a three-leaf model (`rates`: 3 outputs,
// 8 inputs, batched scalar blocks). Names are NAME/BATCH/CHUNK (0: the whole batch);
// `minor_faults` counts page faults per call.

#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

namespace {

const auto stub = std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "elasticity_forward" /
                  "elasticity_aoti.i";

long minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Runs `call` per iteration; reports items/s and minor page faults per call.
template <class Call>
void measure(benchmark::State& state, Call&& call) {
  call(); // warm-up
  const auto faults = minor_faults();
  for (auto _ : state)
    call();
  state.counters["minor_faults"] = benchmark::Counter(static_cast<double>(minor_faults() - faults) /
                                                      static_cast<double>(state.iterations()));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

neml2::TensorMap inputs(std::int64_t batch) {
  return {{"strain", 1e-3 * at::rand({batch, 6}, at::kDouble)}};
}

neml2::SyncChunking policy(const benchmark::State& state) {
  return {.device = "cpu", .batch_size = state.range(1)};
}

// The bytes forward moves: read (B, 6) doubles, write (B, 6) doubles.
void copy(benchmark::State& state) {
  const auto in = inputs(state.range(0)).at("strain");
  auto out = at::empty_like(in);
  measure(state, [&] { out.copy_(in); });
}

void forward(benchmark::State& state) {
  const auto model = neml2::load_model(stub, "elasticity", policy(state));
  const auto x = inputs(state.range(0));
  measure(state, [&] { benchmark::DoNotOptimize(model.forward(x)); });
}

void forward_into(benchmark::State& state) {
  const auto model = neml2::load_model(stub, "elasticity", policy(state));
  const auto x = inputs(state.range(0));
  const neml2::TensorMap out = {{"stress", at::empty({state.range(0), 6}, at::kDouble)}};
  measure(state, [&] { model.forward_into(x, out); });
}

void neml2_runtime(benchmark::State& state) {
  auto model = neml2::aoti::load_model(
      stub, "elasticity",
      std::make_shared<neml2::aoti::SimpleScheduler>(
          neml2::aoti::SimpleScheduler::Config{"cpu", static_cast<std::size_t>(state.range(1))}));
  const auto x = inputs(state.range(0));
  measure(state, [&] { benchmark::DoNotOptimize(model.forward(x)); });
}

const auto rates_stub =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "rates" / "eq_aoti.i";

// The rates model's inputs: every value in [0, 1), the times apart by at least 1.
template <class Model>
neml2::TensorMap rates_inputs(const Model& model, std::int64_t batch) {
  neml2::TensorMap in;
  for (const auto& name : model.input_names())
    in[name] = at::rand({batch}, at::kDouble) + (name == "t" ? 1.0 : 0.0);
  return in;
}

void jacobian(benchmark::State& state) {
  const auto model = neml2::load_model(rates_stub, "eq", policy(state));
  const auto x = rates_inputs(model, state.range(0));
  measure(state, [&] { benchmark::DoNotOptimize(model.jacobian(x)); });
}

void jacobian_into(benchmark::State& state) {
  const auto model = neml2::load_model(rates_stub, "eq", policy(state));
  const auto x = rates_inputs(model, state.range(0));
  auto [values, J] = model.jacobian(x); // the shapes; then reused
  measure(state, [&] { model.jacobian_into(x, values, J); });
}

void cases(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1 << 14, 1 << 18, 1 << 20})
    for (std::int64_t chunk : {0, 1 << 14})
      b->Args({batch, chunk});
  b->Args({1 << 14, 1 << 12}); // a whole batch of 2^14 into the caller's in smaller pieces
  b->UseRealTime();
}

} // namespace

BENCHMARK(copy)->Apply(cases);
BENCHMARK(forward)->Apply(cases);
BENCHMARK(forward_into)->Apply(cases);
BENCHMARK(neml2_runtime)->Apply(cases);
BENCHMARK(jacobian)->Apply(cases);
BENCHMARK(jacobian_into)->Apply(cases);

BENCHMARK_MAIN();
