// Perzyna viscoplasticity with a matrix-free GMRES Newton step against NEML2's own C++
// runtime (neml2::aoti, from the neml2 wheel) on the same artifact, and against the same
// model compiled with a direct solve (DenseLU), in one process: all rows plastic, and 10 %
// plastic (the rest elastic: A = I, one GMRES step).
//
// Cases are NAME/BATCH/PLASTIC_PERCENT: `neml2_gmres` (NEML2's runtime, perzyna_gmres),
// `gmres` (ours, same artifact), `gmres_bjac` (ours, block-Jacobi preconditioned),
// `direct` (ours, perzyna_viscoplasticity).

#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

namespace {

std::filesystem::path stub(const char* artifact) {
  return std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / artifact / "model_aoti.i";
}

// One step of 0.1 from a stress-free state: the first `percent` of the rows strained far
// past yield (yield stress 5, E = 1e5), the others below it.
std::map<std::string, at::Tensor> inputs(std::int64_t batch, std::int64_t percent) {
  const auto opts = at::TensorOptions(at::kDouble);
  const auto direction = at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, opts);
  const auto plastic = (at::arange(batch, opts) < batch * percent / 100.0).to(at::kDouble);
  const auto size = (2e-5 + 1e-3 * plastic) * (1 + 0.1 * at::rand({batch}, opts));
  return {{"E", size.unsqueeze(1) * direction},
          {"E~1", at::zeros({batch, 6}, opts)},
          {"stress", at::zeros({batch, 6}, opts)},
          {"stress~1", at::zeros({batch, 6}, opts)},
          {"equivalent_plastic_strain", at::zeros({batch}, opts)},
          {"equivalent_plastic_strain~1", at::zeros({batch}, opts)},
          {"t", at::full({batch}, 0.1, opts)},
          {"t~1", at::zeros({batch}, opts)}};
}

// forward() on the case's inputs, after a few calls that are not measured (the first calls
// of a graph are slow: lazy initialization in the runtime). A call in which some rows fail
// to converge still counts; the counter `failed_calls` says how many did.
template <class Model>
void measure(benchmark::State& state, Model& model) {
  const auto x = inputs(state.range(0), state.range(1));
  std::int64_t failed = 0;
  const auto call = [&] {
    try {
      benchmark::DoNotOptimize(model.forward(x));
    } catch (const std::exception&) { // NEML2's and our ConvergenceError
      ++failed;
    }
  };
  for (int i = 0; i < 3; ++i)
    call();
  failed = 0;
  for (auto _ : state)
    call();
  state.counters["failed_calls"] = static_cast<double>(failed);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void neml2_gmres(benchmark::State& state) {
  auto model = neml2::aoti::load_model(stub("perzyna_gmres"), "model",
                                       std::make_shared<neml2::aoti::SimpleScheduler>(
                                           neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
  measure(state, model);
}

void ours(benchmark::State& state, const char* artifact) {
  auto model = neml2::load_model(stub(artifact), "model", neml2::SyncChunking{.device = "cpu"});
  measure(state, model);
}

void gmres(benchmark::State& state) {
  ours(state, "perzyna_gmres");
}
void gmres_bjac(benchmark::State& state) {
  ours(state, "perzyna_gmres_bjac");
}
void direct(benchmark::State& state) {
  ours(state, "perzyna_viscoplasticity");
}

void cases(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1, 64, 1 << 14})
    for (std::int64_t percent : {100, 10})
      b->Args({batch, percent});
}

} // namespace

BENCHMARK(neml2_gmres)->Apply(cases)->UseRealTime();
BENCHMARK(gmres)->Apply(cases)->UseRealTime();
BENCHMARK(gmres_bjac)->Apply(cases)->UseRealTime();
BENCHMARK(direct)->Apply(cases)->UseRealTime();
