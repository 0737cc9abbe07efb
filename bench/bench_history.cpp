// Whole strain histories against NEML2's own C++ runtime (neml2::aoti, SimpleScheduler on
// the CPU), same artifact, same process: 100 steps, each step's state the next step's old
// state, as NEML2's TransientDriver drives a model (outputs only).
//
// `<runtime>_<model>/POINTS`: runtime `peer` (NEML2's runtime, the inputs rebuilt every
// step from the last outputs), `hand` (DispatchedModel driven by the same loop), `state`
// (MaterialState: step, accept) or `extrapolated` (the same, Newton's guess extrapolated
// from the step before: StepOptions::extrapolate) or `chord` (the state's steps with
// StepOptions::chord); model `elasticity` (explicit), `perzyna`
// (rate-dependent flow), `j2` (radial return, isotropic hardening), `chaboche` (four unknowns, two
// back stresses) or `gtn` (porous: three unknowns, voids growing from 0.01). Items are point-steps.
// A strain ramp (uniaxial stress; uniaxial strain for GTN), its size spread 0.5x to 1.5x across the
// points, to several times yield. NEML2_DISPATCH_BENCH_THREADS sets the intra-op threads (default
// 1, single_thread_main.cpp). Ours also count each graph's rows per point-step (counters
// `residual`, `jacobian`, ...: one more history, untimed, under the graph-call observer).

#include <array>
#include <filesystem>
#include <mutex>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

#include "graph/graph_calls.hpp" // the library's private hook: graph calls counted

namespace {

constexpr int steps = 100;

struct Scenario {
  const char* artifact;
  const char* model;
  const char* strain; // the strain input's name
  double final_strain;
  std::array<double, 6> direction = {1.0, -0.5, -0.5, 0.2, 0.0, 0.0};
  const char* voids = nullptr; // a state that starts at 0.01 (zero otherwise)
};

const Scenario scenarios[] = {
    {"elasticity", "elasticity", "strain", 1e-3},
    {"perzyna_viscoplasticity", "model", "E", 2e-2},
    {"j2_radial_return", "model", "E", 4e-2},
    {"chaboche_viscoplasticity", "model", "E", 2e-2},
    {"gtn_viscoplasticity", "model", "E", 1e-1, {1.0, 0.0, 0.0, 0.2, 0.0, 0.0}, "void_fraction"}};
const char* names[] = {"elasticity", "perzyna", "j2", "chaboche", "gtn"};
constexpr double initial_voids = 0.01;

std::filesystem::path stub(const Scenario& s) {
  return std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / s.artifact /
         (std::string(s.model) + "_aoti.i");
}

// The prescribed strain and time of step n (0: the start) for every point.
struct Loading {
  at::Tensor amplitude; // (P, 6)
  [[nodiscard]] at::Tensor strain(int n) const { return amplitude * (double(n) / steps); }
  [[nodiscard]] at::Tensor time(int n, std::int64_t points) const {
    return at::full({points}, 0.1 * n, at::kDouble);
  }
};

Loading loading(const Scenario& s, std::int64_t points) {
  const auto opts = at::TensorOptions(at::kDouble);
  const auto direction = at::tensor(at::ArrayRef<double>(s.direction), opts);
  const auto size = s.final_strain * at::linspace(0.5, 1.5, points, opts);
  return {size.unsqueeze(1) * direction};
}

// A driver's loop over any runtime: each step's inputs rebuilt by name from the prescribed
// strain and time and the last step's outputs (old state and initial guesses), zeros at
// the start (the void fraction 0.01).
template <class Model>
at::Tensor drive(const Model& model, const neml2::Artifact& artifact, const Scenario& s,
                 const Loading& load, std::int64_t points) {
  std::map<std::string, at::Tensor> previous;
  std::set<std::string> outputs;
  for (const auto& o : artifact.outputs)
    outputs.insert(o.name);
  for (int n = 1; n <= steps; ++n) {
    std::map<std::string, at::Tensor> in;
    for (const auto& v : artifact.inputs) {
      const bool old = v.name.ends_with("~1");
      const auto base = old ? v.name.substr(0, v.name.size() - 2) : v.name;
      const int at_step = old ? n - 1 : n;
      if (base == s.strain)
        in[v.name] = load.strain(at_step);
      else if (base == "t")
        in[v.name] = load.time(at_step, points);
      else if (outputs.count(base) && previous.count(base))
        in[v.name] = previous.at(base);
      else {
        auto shape = v.base_shape;
        shape.insert(shape.begin(), points);
        in[v.name] = at::full(shape, s.voids && base == s.voids ? initial_voids : 0.0, at::kDouble);
      }
    }
    previous = model.forward(in);
  }
  return previous.begin()->second;
}

at::Tensor drive_state(neml2::MaterialState& state, const Scenario& s, const Loading& load,
                       std::int64_t points, const neml2::StepOptions& options) {
  const bool timed = !state.roles().forces.empty() || !state.roles().given.empty();
  for (int n = 1; n <= steps; ++n) {
    const neml2::TensorMap forces{{s.strain, load.strain(n)}};
    const auto has_time = std::find(state.roles().forces.begin(), state.roles().forces.end(),
                                    "t") != state.roles().forces.end();
    if (timed && has_time)
      state.step(forces, load.time(n, points), options);
    else
      state.step(forces, options);
    state.accept();
  }
  return state.start().empty() ? at::Tensor() : state.start().begin()->second;
}

enum class Runtime { peer, hand, state, extrapolated, chord };

void history(benchmark::State& bench, Runtime runtime, const Scenario& s) {
  const auto points = bench.range(0);
  const auto load = loading(s, points);
  const auto artifact = neml2::read_artifact(neml2::resolve_artifact_root(stub(s), s.model));
  const auto run = [&](auto&& once) {
    benchmark::DoNotOptimize(once()); // the first calls of a graph are slow
    for (auto _ : bench)
      benchmark::DoNotOptimize(once());
    bench.SetItemsProcessed(bench.iterations() * points * steps);
    if (runtime == Runtime::peer)
      return;
    std::map<std::string, double> rows; // by graph: `<model>_<graph>.pt2`
    std::mutex counting;                // graphs run on every CPU lane
    neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
      const auto name = std::filesystem::path(file).stem().string();
      const std::lock_guard lock(counting);
      rows[name.substr(name.rfind('_') + 1)] += static_cast<double>(n);
    });
    benchmark::DoNotOptimize(once());
    neml2::detail::observe_graph_calls({});
    for (const auto& [graph, n] : rows)
      bench.counters[graph] = n / static_cast<double>(points * steps);
  };
  if (runtime == Runtime::peer) {
    auto model = neml2::aoti::load_model(stub(s), s.model,
                                         std::make_shared<neml2::aoti::SimpleScheduler>(
                                             neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
    run([&] { return drive(model, artifact, s, load, points); });
    return;
  }
  const auto model = neml2::load_model(stub(s), s.model);
  if (runtime == Runtime::hand) {
    run([&] { return drive(model, artifact, s, load, points); });
    return;
  }
  neml2::TensorMap initial;
  if (s.voids)
    initial.emplace(s.voids, at::full({points}, initial_voids, at::kDouble));
  run([&] {
    neml2::MaterialState state(model, points, initial);
    return drive_state(
        state, s, load, points,
        {.extrapolate = runtime == Runtime::extrapolated, .chord = runtime == Runtime::chord});
  });
}

const bool registered = [] {
  const std::pair<Runtime, const char*> runtimes[] = {{Runtime::peer, "peer"},
                                                      {Runtime::hand, "hand"},
                                                      {Runtime::state, "state"},
                                                      {Runtime::extrapolated, "extrapolated"},
                                                      {Runtime::chord, "chord"}};
  for (std::size_t m = 0; m < std::size(scenarios); ++m)
    for (const auto& [runtime, label] : runtimes)
      benchmark::RegisterBenchmark((std::string(label) + "_" + names[m]).c_str(), history, runtime,
                                   scenarios[m])
          ->Arg(1 << 12)
          ->Arg(1 << 16)
          ->Unit(benchmark::kMillisecond)
          ->Iterations(1);
  return true;
}();

} // namespace
