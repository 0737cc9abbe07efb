// A finite-element host's time steps, MOOSE-shaped: P points, 10 steps, 3 residual
// evaluations a step each asking for outputs and the tangent, the host's storage one record
// per point (its force, old state, outputs, tangent).
//
// `<host>_<model>/POINTS`: host `peer` (NEML2's runtime as MOOSE's NEML2ModelExecutor uses
// it: inputs gathered from the records, the whole batch called, results scattered back, old
// state copied by the host, and on a failure the whole step cut in halves), `state`
// (MaterialState: the records' columns as the results' storage, the failing points cut
// alone) or `overlap` (`state` with submit: the host does `work` of its own between submit
// and wait); model `j2` (d(stress)/d(E)), `chaboche` (four unknowns) or `cuts` (the scalar
// model x' = a - x^2, d(x)/d(a), where at step 10 1 % of the points get a = -40: their full
// step has no root, its halves have). Items are point-steps. Counters: `cut` (points cut,
// or whole-step cuts for the peer), `peak_bytes` over `io_bytes` (inputs, state, outputs
// and every derivative block, and the state kept), and for overlap the host's own `work_ms`
// a step against `step_ms`.
// NEML2_DISPATCH_BENCH_THREADS sets the intra-op threads (default 1).

#include <chrono>
#include <filesystem>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <neml2/csrc/dispatchers/SimpleScheduler.h>
#include <neml2/csrc/dispatchers/factory.h>
#include <neml2/dispatch.hpp>

#include "counting_allocator.hpp"

namespace {

test::CountingAllocator counting;
[[maybe_unused]] const bool counting_installed =
    (c10::SetCPUAllocator(&counting, /*priority=*/100), true);

constexpr int steps = 10, evaluations = 3;

struct Scenario {
  const char* artifact;
  const char* force;              // what the host drives (a strain, or `a`)
  const char* output;             // the tangent is d(output)/d(force)
  std::int64_t force_size;        // values per point
  double final;                   // the force's size at the end (strains)
  std::vector<const char*> state; // the state variables the host keeps
};
const Scenario j2{
    "j2_radial_return", "E", "stress", 6, 4e-2, {"plastic_strain", "equivalent_plastic_strain"}};
const Scenario chaboche{"chaboche_viscoplasticity",
                        "E",
                        "stress",
                        6,
                        2e-2,
                        {"stress", "equivalent_plastic_strain", "X1", "X2"}};
const Scenario cuts{"scalar_backward_euler", "a", "x", 1, 0, {"x"}};

std::filesystem::path stub(const Scenario& s) {
  return std::filesystem::path(NEML2_DISPATCH_BENCH_ARTIFACTS) / s.artifact / "model_aoti.i";
}

// The host's records: per point, strain (6) and, per state variable, its old value, then
// each output's value, then the tangent (36). Columns by name.
struct Records {
  at::Tensor data;
  std::map<std::string, at::Tensor> old, out; // views into data
  at::Tensor strain, tangent;
};

Records records(const neml2::AnyDispatchedModel& model, const Scenario& s, std::int64_t points) {
  std::int64_t width = s.force_size * (1 + s.force_size);
  std::map<std::string, std::int64_t> size;
  for (std::size_t o = 0; o < model.output_names().size(); ++o) {
    std::int64_t n = 1;
    for (auto d : model.output_base_shapes()[o])
      n *= d;
    size[model.output_names()[o]] = n;
    width += n;
  }
  for (const auto* x : s.state)
    width += size.at(x);
  Records r{at::zeros({points, width}, at::kDouble), {}, {}, {}, {}};
  std::int64_t column = 0;
  const auto take = [&](std::int64_t n) {
    auto v = r.data.narrow(1, column, n);
    column += n;
    return v;
  };
  const auto shaped = [&](const std::string& name, at::Tensor v) {
    return size.at(name) == 1 ? v.squeeze(1) : v;
  };
  r.strain = take(s.force_size);
  if (s.force_size == 1)
    r.strain = r.strain.squeeze(1);
  for (const auto* x : s.state)
    r.old[x] = shaped(x, take(size.at(x)));
  for (const auto& [name, n] : size)
    r.out[name] = shaped(name, take(n));
  r.tangent =
      s.force_size == 1 ? take(1).squeeze(1) : take(36).unflatten(1, {s.force_size, s.force_size});
  return r;
}

// The force of step n at evaluation k (the host's Newton iterates approach the step's
// strain), `at_fraction` of the way through the step.
at::Tensor force(const Scenario& s, const at::Tensor& amplitude, int n, int k,
                 double at_fraction = 1.0) {
  if (s.final == 0) { // the scalar model's a: 1, and -40 at 1 % of the points at step 10
    auto a = at::ones({amplitude.size(0)}, at::kDouble);
    if (n % 10 == 0)
      a.slice(0, 0, std::nullopt, 100).fill_(-40.0);
    return a;
  }
  const auto before = amplitude * (double(n - 1) / steps / 10);
  const auto increment = amplitude * (1.0 / steps / 10) * (1.0 - 0.05 * (evaluations - 1 - k));
  return before + increment * at_fraction;
}

at::Tensor loading(const Scenario& s, std::int64_t points) {
  const auto direction = at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, at::kDouble);
  return (s.final * at::linspace(0.5, 1.5, points, at::kDouble)).unsqueeze(1) * direction;
}

// NEML2's runtime as MOOSE drives it: gather, call the whole batch, scatter; a failure cuts
// the step for every point (two half steps, recursively).
struct PeerHost {
  neml2::aoti::DispatchedModel& model;
  const neml2::Artifact& artifact;
  const Scenario& s;
  Records& rec;
  at::Tensor amplitude;
  std::int64_t points, whole_step_cuts = 0;

  std::map<std::string, at::Tensor> inputs(const at::Tensor& E, const at::Tensor& E_old, double t,
                                           double t_old) const {
    std::map<std::string, at::Tensor> in;
    for (const auto& v : artifact.inputs) {
      const bool old = v.name.ends_with("~1");
      const auto base = old ? v.name.substr(0, v.name.size() - 2) : v.name;
      if (base == s.force)
        in[v.name] = old ? E_old : E;
      else if (base == "t")
        in[v.name] = at::full({points}, old ? t_old : t, at::kDouble);
      else if (rec.old.count(base)) // gathered from the records
        in[v.name] = rec.old.at(base).contiguous();
      else {
        auto shape = v.base_shape;
        shape.insert(shape.begin(), points);
        in[v.name] = at::zeros(shape, at::kDouble);
      }
    }
    return in;
  }

  // The span [a, b] of step n: `evaluations` calls, results scattered; false on a failure.
  bool span(int n, double a, double b) {
    for (int k = 0; k < evaluations; ++k) {
      rec.strain.copy_(force(s, amplitude, n, k, b));
      try {
        const auto in = inputs(rec.strain.contiguous(), force(s, amplitude, n, k, a),
                               0.1 * (n - 1 + b), 0.1 * (n - 1 + a));
        const auto [out, J] = model.jacobian(in);
        for (const auto& [name, value] : out)
          rec.out.at(name).copy_(value);
        rec.tangent.copy_(J.at(s.output).at(s.force));
      } catch (const std::exception&) {
        return false;
      }
    }
    return true;
  }
  void step(int n, double a = 0, double b = 1, int depth = 0) {
    const auto kept = rec.data.clone(); // the host's own undo copy of its records
    if (span(n, a, b)) {
      for (const auto* x : s.state)
        rec.old.at(x).copy_(rec.out.at(x));
      return;
    }
    rec.data.copy_(kept);
    if (depth == 4)
      throw std::runtime_error("the peer's step failed at depth 4");
    ++whole_step_cuts;
    step(n, a, (a + b) / 2, depth + 1);
    step(n, (a + b) / 2, b, depth + 1);
  }
};

// MaterialState over the records: the results written into their columns.
struct StateHost {
  const Scenario& s;
  neml2::MaterialState& state;
  Records& rec;
  at::Tensor amplitude;
  std::int64_t points, cut = 0;
  neml2::StepOptions options;

  StateHost(const Scenario& scenario, neml2::MaterialState& st, Records& r, at::Tensor amp,
            std::int64_t p)
      : s(scenario)
      , state(st)
      , rec(r)
      , amplitude(std::move(amp))
      , points(p) {
    neml2::HostLayout into;
    for (const auto& [name, column] : rec.out)
      into.outputs.emplace(name, column);
    into.derivatives[s.output][s.force] = rec.tangent;
    options = {.derivatives = true, .max_cuts = 4, .into = into};
  }

  const neml2::StepResult& evaluate(int n, int k) {
    rec.strain.copy_(force(s, amplitude, n, k));
    return state.step({{s.force, rec.strain}}, at::full({points}, 0.1 * n, at::kDouble), options);
  }
  void step(int n) {
    for (int k = 0; k < evaluations; ++k)
      cut += evaluate(n, k).cut;
    state.accept();
  }
};

// The bytes of one evaluation's inputs, outputs and every derivative block the artifact
// has, and of the state kept (start and trial), for `points` points.
std::int64_t io_bytes(const neml2::AnyDispatchedModel& model, std::int64_t points) {
  const auto numel = [](const neml2::Shape& s) {
    std::int64_t n = 1;
    for (auto d : s)
      n *= d;
    return n;
  };
  std::map<std::string, std::int64_t> in, out;
  for (std::size_t i = 0; i < model.input_names().size(); ++i)
    in[model.input_names()[i]] = numel(model.input_base_shapes()[i]);
  for (std::size_t o = 0; o < model.output_names().size(); ++o)
    out[model.output_names()[o]] = numel(model.output_base_shapes()[o]);
  std::int64_t per_point = 0;
  for (const auto& [name, n] : in)
    per_point += n + (name.ends_with("~1") && out.count(name.substr(0, name.size() - 2)) ? n : 0);
  for (const auto& [name, n] : out)
    per_point += n;
  for (const auto& [o, i] : model.artifact().derivatives)
    per_point += out.at(o) * in.at(i);
  return per_point * points * 8;
}

void measure(benchmark::State& bench, const std::function<void()>& history, std::int64_t io_bytes) {
  std::int64_t peak = 0;
  for (auto _ : bench) {
    const auto live = counting.reset();
    history();
    peak = std::max(peak, counting.peak.load() - live);
  }
  bench.SetItemsProcessed(bench.iterations() * bench.range(0) * steps);
  bench.counters["peak_bytes"] = static_cast<double>(peak);
  bench.counters["io_bytes"] = static_cast<double>(io_bytes);
  bench.counters["peak_over_io"] = static_cast<double>(peak) / static_cast<double>(io_bytes);
}

void peer(benchmark::State& bench, const Scenario& s) {
  const auto points = bench.range(0);
  auto model = neml2::aoti::load_model(stub(s), "model",
                                       std::make_shared<neml2::aoti::SimpleScheduler>(
                                           neml2::aoti::SimpleScheduler::Config{"cpu", 0}));
  const auto artifact = neml2::read_artifact(neml2::resolve_artifact_root(stub(s), "model"));
  const auto ours = neml2::load_model(stub(s), "model"); // for the record layout only
  auto rec = records(ours, s, points);
  PeerHost host{model, artifact, s, rec, loading(s, points), points};
  measure(
      bench,
      [&] {
        rec.data.zero_();
        for (int n = 1; n <= steps; ++n)
          host.step(n);
      },
      io_bytes(ours, points));
  bench.counters["cut"] = static_cast<double>(host.whole_step_cuts);
}

void state(benchmark::State& bench, const Scenario& s, double work_ms) {
  const auto points = bench.range(0);
  const auto model = neml2::load_model(stub(s), "model");
  auto rec = records(model, s, points);
  double step_seconds = 0;
  std::int64_t cut = 0;
  measure(
      bench,
      [&] {
        rec.data.zero_();
        neml2::MaterialState st(model, points);
        StateHost host(s, st, rec, loading(s, points), points);
        for (int n = 1; n <= steps; ++n) {
          const auto start = std::chrono::steady_clock::now();
          if (work_ms == 0)
            host.step(n);
          else
            for (int k = 0; k < evaluations; ++k) {
              rec.strain.copy_(force(s, host.amplitude, n, k));
              auto pending = st.submit({{s.force, rec.strain}},
                                       at::full({points}, 0.1 * n, at::kDouble), host.options);
              // The host's own work meanwhile: a busy wait of work_ms.
              const auto until =
                  std::chrono::steady_clock::now() + std::chrono::duration<double>(work_ms / 1e3);
              while (std::chrono::steady_clock::now() < until)
                ;
              host.cut += pending.wait().cut;
              if (k == evaluations - 1)
                st.accept();
            }
          step_seconds +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        }
        cut = host.cut;
      },
      io_bytes(model, points));
  bench.counters["cut"] = static_cast<double>(cut);
  if (work_ms > 0) {
    bench.counters["work_ms"] = work_ms * evaluations;
    bench.counters["step_ms"] = 1e3 * step_seconds / (steps * bench.iterations());
  }
}

const bool registered = [] {
  for (const auto& [label, s] :
       {std::pair{"j2", &j2}, std::pair{"chaboche", &chaboche}, std::pair{"cuts", &cuts}}) {
    const auto points =
        label == std::string("chaboche") ? std::int64_t{1} << 14 : std::int64_t{1} << 16;
    benchmark::RegisterBenchmark((std::string("peer_") + label).c_str(), peer, *s)
        ->Arg(points)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1);
    benchmark::RegisterBenchmark((std::string("state_") + label).c_str(), state, *s, 0.0)
        ->Arg(points)
        ->Unit(benchmark::kMillisecond)
        ->Iterations(1);
  }
  // The host's work per evaluation close to the step's own: overlapped, the step takes
  // the larger of the two, not their sum.
  benchmark::RegisterBenchmark("overlap_j2", state, j2, 150.0)
      ->Arg(std::int64_t{1} << 16)
      ->Unit(benchmark::kMillisecond)
      ->Iterations(1);
  return true;
}();

} // namespace
