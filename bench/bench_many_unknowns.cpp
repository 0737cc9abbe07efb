// Many unknowns per material point against NEML2's own C++ runtime (neml2::aoti, from the
// neml2 wheel), same artifact, same process, one intra-op thread (single_thread_main.cpp):
//
// `<runtime>_grains/BATCH`: models/grains.i, 4 grains' hardening and slip in a block group
//   beside a plain p (9 unknowns), one step from rest under forces 1.5 to 3.
// `<runtime>_multigrain/BATCH`: NEML2's mixed-control polycrystal benchmark
//   (benchmark/mxpc/model.i in NEML2's repository, not shipped here; nbatch = 8 grains,
//   `structure = 'block dense'`, 92 unknowns a point), compiled with
//   `neml2-compile model.i --model model`; its stub in NEML2_DISPATCH_BENCH_MULTIGRAIN.
//   One step (dt = 0.5) from an unstrained state with random orientations, the first
//   deformation-rate component prescribed at 1e-3 and the rest stress-free, as the
//   benchmark's driver does. Skipped when the variable is not set.
//
// `<runtime>_slip_systems/BATCH`: NEML2's crystal-plasticity regression test
//   tests/regression/solid_mechanics/crystal_plasticity/per_slip_hardening (12 slip systems'
//   dislocation densities a sub-batched unknown beside elastic strain and orientation, 21
//   unknowns a point, one dense group), compiled with `--example-batch-shape
//   "dislocation_density~1=(2;12)" --example-batch-shape "dislocation_density=(2;12)"`; its
//   stub in NEML2_DISPATCH_BENCH_SLIP_SYSTEMS. One step (slip_system_inputs below).
// `<runtime>_kwn/BATCH`: NEML2's Kampmann-Wagner example (doc/content/modules/kwn/ in its
//   repository: al_cu_ttp.i, 300 size bins, one dense system per point), its stub in
//   NEML2_DISPATCH_BENCH_KWN (`neml2-compile al_cu_ttp.i --model model_scaled
//   --example-batch-shape "number_density~1=(2;300)"`): a history (kwn_history below).
//
// runtime: `peer` (NEML2's runtime, SimpleScheduler) or `ours` (SyncChunking, defaults).
// Items are material points; for ours, `<graph>_rows` counts the rows each graph took in one
// call (Newton iterations and line-search trials of every row), and
// `relative_difference_from_peer` the largest difference of an output from NEML2's runtime's
// on the same inputs, over that output's largest value.

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

#include "graph/graph_calls.hpp" // the library's private hook: graph calls counted

namespace {

using Inputs = std::map<std::string, at::Tensor>;

const auto grains_stub =
    std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / "grains" / "model_aoti.i";

Inputs grains_inputs(std::int64_t batch) {
  const auto opts = at::TensorOptions(at::kDouble);
  return {{"f", at::linspace(1.5, 3.0, batch, opts)},
          {"t", at::ones({batch}, opts)},
          {"t~1", at::zeros({batch}, opts)},
          {"p", at::zeros({batch}, opts)},
          {"p~1", at::zeros({batch}, opts)},
          {"hardening", at::zeros({batch, 4}, opts)},
          {"hardening~1", at::zeros({batch, 4}, opts)},
          {"slip", at::zeros({batch, 4}, opts)},
          {"slip~1", at::zeros({batch, 4}, opts)}};
}

// Every input of the artifact zero.
Inputs zero_inputs(const std::filesystem::path& stub, std::int64_t batch) {
  const auto artifact = neml2::read_artifact(neml2::resolve_artifact_root(stub, "model"));
  Inputs x;
  for (const auto& input : artifact.inputs) {
    std::vector<std::int64_t> shape{batch};
    shape.insert(shape.end(), input.sub_batch_shape.begin(), input.sub_batch_shape.end());
    shape.insert(shape.end(), input.base_shape.begin(), input.base_shape.end());
    x[input.name] = at::zeros(shape, at::kDouble);
  }
  return x;
}

// The step's forces and the grains' orientations.
Inputs multigrain_inputs(const std::filesystem::path& stub, std::int64_t batch) {
  const auto opts = at::TensorOptions(at::kDouble);
  auto x = zero_inputs(stub, batch);
  const auto first = at::tensor({1.0, 0.0, 0.0, 0.0, 0.0, 0.0}, opts).expand({batch, 6});
  x.at("control") = first.clone();
  x.at("prescribed") = 1e-3 * first;
  x.at("t") = at::full({batch}, 0.5, opts);
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  auto& orientation = x.at("orientation~1");
  orientation = 0.3 * at::randn(orientation.sizes(), gen, opts);
  return x;
}

// One step (dt = 0.1) of NEML2's regression test from its initial state: the deformation
// rate and vorticity it prescribes, 10 dislocations on every system, orientations spread as
// its initial ones are.
Inputs slip_system_inputs(const std::filesystem::path& stub, std::int64_t batch) {
  const auto opts = at::TensorOptions(at::kDouble);
  auto x = zero_inputs(stub, batch);
  x.at("deformation_rate") =
      at::tensor({0.1, -0.05, -0.05, 0.0, 0.0, 0.0}, opts).expand({batch, 6});
  x.at("vorticity") = at::tensor({0.1, -0.05, -0.05}, opts).expand({batch, 3});
  x.at("dislocation_density~1").fill_(10.0);
  x.at("t").fill_(0.1);
  const auto r =
      at::stack({at::linspace(0.0, 0.75, batch, opts), at::linspace(0.0, -0.25, batch, opts),
                 at::linspace(-0.1, 0.1, batch, opts)},
                1);
  x.at("orientation~1") = r / ((r * r).sum(1, true) + 1.0).sqrt().add(1.0);
  return x;
}

template <class Model>
void measure(benchmark::State& state, Model& model, const Inputs& x) {
  for (int i = 0; i < 3; ++i) // the first calls of a graph initialize the runtime
    benchmark::DoNotOptimize(model.forward(x));
  for (auto _ : state)
    benchmark::DoNotOptimize(model.forward(x));
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void run(benchmark::State& state, bool peer, const std::filesystem::path& stub, const Inputs& x) {
  if (peer) {
    auto model = neml2::aoti::load_model(stub, "model",
                                         std::make_shared<neml2::aoti::SimpleScheduler>(
                                             neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
    measure(state, model, x);
  } else {
    auto model = neml2::load_model(stub, "model", neml2::SyncChunking{.device = "cpu"});
    // Rows each graph takes in one call, summed (a row's Newton iterations, line search).
    std::map<std::string, double> rows;
    neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
      for (const char* graph : {"_jacobian.pt2", "_residual.pt2", "_solve.pt2"})
        rows[graph] += file.ends_with(graph) ? static_cast<double>(n) : 0.0;
    });
    const auto ours = model.forward(x);
    neml2::detail::observe_graph_calls({});
    // The largest difference from NEML2's runtime on the same call, relative to the output.
    auto peer = neml2::aoti::load_model(stub, "model",
                                        std::make_shared<neml2::aoti::SimpleScheduler>(
                                            neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
    double differs = 0;
    for (const auto& [name, theirs] : peer.forward(x))
      differs = std::max(
          differs, ((ours.at(name) - theirs).abs().max() / theirs.abs().max().clamp_min(1e-300))
                       .item<double>());
    measure(state, model, x);
    state.counters["relative_difference_from_peer"] = differs;
    for (const auto& [graph, n] : rows)
      state.counters[std::string(graph).substr(1, std::string(graph).find('.') - 1) + "_rows"] = n;
  }
}

void grains(benchmark::State& state, bool peer) {
  run(state, peer, grains_stub, grains_inputs(state.range(0)));
}

// The stub an environment variable names; none: the case is skipped.
const char* stub_named(benchmark::State& state, const char* variable) {
  const char* stub = std::getenv(variable);
  if (!stub)
    state.SkipWithError((std::string(variable) + " (the compiled stub) is not set").c_str());
  return stub;
}

void multigrain(benchmark::State& state, bool peer) {
  if (const char* stub = stub_named(state, "NEML2_DISPATCH_BENCH_MULTIGRAIN"))
    run(state, peer, stub, multigrain_inputs(stub, state.range(0)));
}

void slip_systems(benchmark::State& state, bool peer) {
  if (const char* stub = stub_named(state, "NEML2_DISPATCH_BENCH_SLIP_SYSTEMS"))
    run(state, peer, stub, slip_system_inputs(stub, state.range(0)));
}

// KWN: BATCH points, temperatures 300 K to 360 K, over the first `kwn_steps` steps of the
// example's log-spaced history (1e-3 to 100 h in 500 steps), each step's bins the next
// step's `number_density~1`, from empty bins. Items are point-steps.
constexpr int kwn_steps = 100;

// Whole histories: `history_steps` steps from a case's inputs (its step 1). Each output
// with an old value is the next step's old value (and its guess, where it is an input);
// every other input with an old value moves by its first increment each step (x_n = x~1 +
// n (x - x~1)); the rest are held. Items are point-steps. `ours_chord`: one NewtonFactors
// over the history (the chord from step to step).
constexpr int history_steps = 20;

template <class Forward>
Inputs run_history(const Inputs& first, const Forward& forward) {
  Inputs state;
  for (int n = 1; n <= history_steps; ++n) {
    Inputs in;
    for (const auto& [name, value] : first) {
      const bool old = name.ends_with("~1");
      const auto base = old ? name.substr(0, name.size() - 2) : name;
      if (state.count(base))
        in[name] = state.at(base);
      else if (!first.count(base + "~1") || !first.count(base))
        in[name] = value;
      else {
        const auto& now = first.at(base);
        const auto& before = first.at(base + "~1");
        in[name] = before + (now - before) * (old ? n - 1 : n);
      }
    }
    auto out = forward(in);
    state.clear();
    for (auto& [name, value] : out)
      if (first.count(name + "~1"))
        state[name] = std::move(value);
  }
  return state;
}

enum class Runtime { peer, ours, ours_chord };

void history(benchmark::State& state, Runtime runtime, const std::filesystem::path& stub,
             const Inputs& first) {
  const auto measured = [&](const auto& one_history) {
    for (int i = 0; i < 2; ++i)
      benchmark::DoNotOptimize(one_history());
    for (auto _ : state)
      benchmark::DoNotOptimize(one_history());
    state.SetItemsProcessed(state.iterations() * state.range(0) * history_steps);
  };
  auto peer = neml2::aoti::load_model(stub, "model",
                                      std::make_shared<neml2::aoti::SimpleScheduler>(
                                          neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
  const auto peer_history = [&] {
    return run_history(first, [&](const Inputs& in) { return peer.forward(in); });
  };
  if (runtime == Runtime::peer) {
    measured(peer_history);
    return;
  }
  auto model = neml2::load_model(stub, "model", neml2::SyncChunking{.device = "cpu"});
  const bool chord = runtime == Runtime::ours_chord;
  const auto ours_history = [&] {
    neml2::NewtonFactors factors;
    return run_history(first, [&](const Inputs& in) {
      return chord ? model.forward(in, factors) : model.forward(in);
    });
  };
  // Graph calls' rows per point-step, and the last state against NEML2's runtime's.
  std::map<std::string, double> rows;
  neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
    for (const char* graph : {"_jacobian.pt2", "_residual.pt2", "_solve.pt2"})
      rows[graph] += file.ends_with(graph) ? static_cast<double>(n) : 0.0;
  });
  const auto ours = ours_history();
  neml2::detail::observe_graph_calls({});
  double differs = 0;
  for (const auto& [name, theirs] : peer_history())
    differs = std::max(differs,
                       ((ours.at(name) - theirs).abs().max() / theirs.abs().max().clamp_min(1e-300))
                           .item<double>());
  measured(ours_history);
  state.counters["relative_difference_from_peer"] = differs;
  for (const auto& [graph, n] : rows)
    state.counters[std::string(graph).substr(1, std::string(graph).find('.') - 1) +
                   "_rows_per_point_step"] =
        n / static_cast<double>(state.range(0) * history_steps);
}

void grains_history(benchmark::State& state, Runtime runtime) {
  auto x = grains_inputs(state.range(0)); // the force held (it has no old value)
  x.at("t") = x.at("t") * 0.1;            // steps of 0.1
  history(state, runtime, grains_stub, x);
}

void multigrain_history(benchmark::State& state, Runtime runtime) {
  if (const char* stub = stub_named(state, "NEML2_DISPATCH_BENCH_MULTIGRAIN"))
    history(state, runtime, stub, multigrain_inputs(stub, state.range(0)));
}

void slip_systems_history(benchmark::State& state, Runtime runtime) {
  if (const char* stub = stub_named(state, "NEML2_DISPATCH_BENCH_SLIP_SYSTEMS"))
    history(state, runtime, stub, slip_system_inputs(stub, state.range(0)));
}

// The bins after `kwn_steps` steps of BATCH points; `forward(inputs)` takes a step.
template <class Forward>
at::Tensor kwn_bins(const Forward& forward, std::int64_t batch) {
  const auto opts = at::TensorOptions(at::kDouble);
  const auto times = at::cat({at::zeros({1}, opts), at::logspace(-3, 2, 500, 10.0, opts)});
  const auto temperature = at::linspace(300.0, 360.0, batch, opts);
  auto bins = at::zeros({batch, 300}, opts);
  for (int k = 1; k <= kwn_steps; ++k)
    bins = forward(Inputs{{"T", temperature},
                          {"number_density~1", bins},
                          {"t", times[k].expand({batch}).clone()},
                          {"t~1", times[k - 1].expand({batch}).clone()}})
               .at("number_density");
  return bins;
}

template <class History>
void kwn_history(benchmark::State& state, const History& history) {
  const auto batch = state.range(0);
  benchmark::DoNotOptimize(history(batch));
  for (auto _ : state)
    benchmark::DoNotOptimize(history(batch));
  state.SetItemsProcessed(state.iterations() * batch * kwn_steps);
}

// `ours_chord`: one NewtonFactors over the history.
void kwn(benchmark::State& state, Runtime runtime) {
  const char* stub = stub_named(state, "NEML2_DISPATCH_BENCH_KWN");
  if (!stub)
    return;
  auto peer_model = neml2::aoti::load_model(stub, "model_scaled",
                                            std::make_shared<neml2::aoti::SimpleScheduler>(
                                                neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
  const auto peer = [&](std::int64_t batch) {
    return kwn_bins([&](const Inputs& in) { return peer_model.forward(in); }, batch);
  };
  if (runtime == Runtime::peer) {
    kwn_history(state, peer);
    return;
  }
  auto model = neml2::load_model(stub, "model_scaled", neml2::SyncChunking{.device = "cpu"});
  const bool chord = runtime == Runtime::ours_chord;
  const auto ours = [&](std::int64_t batch) {
    neml2::NewtonFactors factors;
    return kwn_bins(
        [&](const Inputs& in) { return chord ? model.forward(in, factors) : model.forward(in); },
        batch);
  };
  std::map<std::string, double> calls;
  neml2::detail::observe_graph_calls(
      [&](const std::string& file, std::int64_t) { calls[file] += 1.0 / kwn_steps; });
  kwn_history(state, ours);
  neml2::detail::observe_graph_calls({});
  for (const auto& [file, n] : calls)
    state.counters[file] = n / static_cast<double>(state.iterations() + 1);
  // The history's last bins against NEML2's runtime's: the largest difference, over the
  // largest bin.
  const auto theirs = peer(state.range(0));
  state.counters["relative_difference_from_peer"] =
      ((ours(state.range(0)) - theirs).abs().max() / theirs.abs().max()).item<double>();
}

void batches(benchmark::internal::Benchmark* b) {
  for (std::int64_t batch : {1, 64, 1024})
    b->Arg(batch);
}

} // namespace

BENCHMARK_CAPTURE(grains, peer, true)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(grains, ours, false)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(multigrain, peer, true)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(multigrain, ours, false)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(slip_systems, peer, true)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(slip_systems, ours, false)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(grains_history, peer, Runtime::peer)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(grains_history, ours, Runtime::ours)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(grains_history, ours_chord, Runtime::ours_chord)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(multigrain_history, peer, Runtime::peer)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(multigrain_history, ours, Runtime::ours)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(multigrain_history, ours_chord, Runtime::ours_chord)
    ->Apply(batches)
    ->UseRealTime();
BENCHMARK_CAPTURE(slip_systems_history, peer, Runtime::peer)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(slip_systems_history, ours, Runtime::ours)->Apply(batches)->UseRealTime();
BENCHMARK_CAPTURE(slip_systems_history, ours_chord, Runtime::ours_chord)
    ->Apply(batches)
    ->UseRealTime();
BENCHMARK_CAPTURE(kwn, peer, Runtime::peer)->Arg(1)->Arg(32)->UseRealTime();
BENCHMARK_CAPTURE(kwn, ours, Runtime::ours)->Arg(1)->Arg(32)->UseRealTime();
BENCHMARK_CAPTURE(kwn, ours_chord, Runtime::ours_chord)->Arg(1)->Arg(32)->UseRealTime();
