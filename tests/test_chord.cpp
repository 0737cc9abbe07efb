// The chord (SolverConfig::chord, NewtonFactors, StepOptions::chord): each point steps from
// the factored Newton matrix it took last, in earlier calls too, calling the jacobian graph
// only where its residual stops falling fast enough. Against NEML2's Newton (the default):
// results within Newton's tolerance over 40-step histories of every implicit model in
// models/, derivatives, failure masks; the jacobian rows counted through the graph-call
// observer; when the chord pays, from synthetic costs.

#include <filesystem>

#include <c10/util/ScopeExit.h>

#include "graph/graph_calls.hpp"
#include "implicit/block_groups.hpp"
#include "implicit/newton_factors.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"

using namespace neml2;

namespace {

constexpr int steps = 40;
// How close the chord's results stay to Newton's over a history: each step meets the
// same test (||r|| < rtol ||r0|| or atol), so the two differ by what that test lets
// through, carried from step to step. Measured at most 2.2e-8 (docs/performance.md).
constexpr double history_rtol = 1e-7;

// The implicit models in models/ and the reference group that starts each one's history
// (its first step's inputs), on the row pass or not (block groups and 300 bins: the tensor
// path's chord; Krylov: the chord does not apply); scalar_substepping's rows substep.
const std::pair<const char*, const char*> implicit_models[] = {{"scalar_backward_euler", "s0"},
                                                               {"scalar_substepping", "sub"},
                                                               {"j2_radial_return", "s0"},
                                                               {"perzyna_viscoplasticity", "s0"},
                                                               {"chaboche_viscoplasticity", "s0"},
                                                               {"gtn_viscoplasticity", "s0"},
                                                               {"perzyna_gmres", "s0"},
                                                               {"binned_precipitation", "s0"},
                                                               {"binned_dissolution", "s0"},
                                                               {"binned_precipitation_300", "s0"},
                                                               {"grains", "s0"},
                                                               {"grains_40", "s0"},
                                                               {"slip_systems", "s0"}};

// Rows of each graph called while `f` runs, by graph (`jacobian`, `residual`, ...).
template <class F>
std::map<std::string, std::int64_t> graph_rows(const F& f) {
  std::map<std::string, std::int64_t> rows;
  neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
    const auto name = std::filesystem::path(file).stem().string();
    rows[name.substr(name.rfind('_') + 1)] += n;
  });
  const auto stop = c10::make_scope_exit([] { neml2::detail::observe_graph_calls({}); });
  f();
  return rows;
}

// A history of `steps` steps from the reference's first step: each force (and time) moves
// by its first increment (x - x~1) every step, a force with no old value is held, and each
// state's old value (and Newton's guess) is the last step's output.
class History {
public:
  History(const AnyDispatchedModel& model, TensorMap first)
      : _model(model)
      , _first(std::move(first)) {
    for (const auto& o : model.output_names())
      _outputs.insert(o);
  }

  [[nodiscard]] TensorMap inputs(int n, const TensorMap& last) const {
    TensorMap in;
    for (const auto& name : _model.input_names()) {
      const bool old = name.ends_with("~1");
      const auto base = old ? name.substr(0, name.size() - 2) : name;
      if (_outputs.count(base) && !last.empty())
        in[name] = last.at(base);
      else if (_outputs.count(base) || !_first.count(base + "~1") || !_first.count(base))
        in[name] = _first.at(name);
      else { // a force: its first increment, n times
        const auto& now = _first.at(base);
        const auto& before = _first.at(base + "~1");
        in[name] = before + (now - before) * (old ? n - 1 : n);
      }
    }
    return in;
  }

private:
  const AnyDispatchedModel& _model;
  TensorMap _first;
  std::set<std::string> _outputs;
};

// A step's outputs and which points converged (all: undefined); a failed point keeps its
// last state (its old value), as a host that cuts it would, so the history goes on.
struct Step {
  TensorMap outputs;
  at::Tensor converged;
};
template <class F>
Step evaluate(const F& forward, const TensorMap& in) {
  try {
    return {forward(in), {}};
  } catch (const ConvergenceError& e) {
    REQUIRE(e.per_row());
    Step s{e.outputs(), e.converged_mask()};
    for (auto& [name, value] : s.outputs)
      if (in.count(name + "~1")) {
        const auto& old = in.at(name + "~1");
        auto mask = s.converged;
        while (mask.dim() < value.dim())
          mask = mask.unsqueeze(-1);
        value = at::where(mask, value, old);
      }
    return s;
  }
}

// The largest relative difference of two results over their outputs.
double relative_difference(const TensorMap& a, const TensorMap& b) {
  double worst = 0;
  for (const auto& [name, t] : a) {
    const auto scale = std::max(b.at(name).abs().max().item<double>(), 1e-300);
    worst = std::max(worst, (t - b.at(name)).abs().max().item<double>() / scale);
  }
  return worst;
}

// Newton and the chord (one NewtonFactors over the history) side by side for `count` steps
// of `history`: each step's failure masks identical and results within history_rtol; the
// jacobian rows each took, the last results and the largest difference.
struct SideBySide {
  TensorMap plain, chord;
  std::int64_t plain_a = 0, chord_a = 0;
  double worst = 0;
};
template <class Model>
SideBySide side_by_side(const Model& model, const History& history, int count,
                        NewtonFactors& factors) {
  SideBySide r;
  for (int n = 1; n <= count; ++n) {
    CAPTURE(n);
    const auto plain_in = history.inputs(n, r.plain), chord_in = history.inputs(n, r.chord);
    Step p, c;
    r.plain_a += graph_rows([&] {
      p = evaluate([&](const TensorMap& in) { return model.forward(in); }, plain_in);
    })["jacobian"];
    r.chord_a += graph_rows([&] {
      c = evaluate([&](const TensorMap& in) { return model.forward(in, factors); }, chord_in);
    })["jacobian"];
    REQUIRE(p.converged.defined() == c.converged.defined());
    if (p.converged.defined())
      CHECK(test::identical(p.converged, c.converged));
    r.plain = std::move(p.outputs);
    r.chord = std::move(c.outputs);
    const auto difference = relative_difference(r.chord, r.plain);
    CHECK(difference <= history_rtol);
    r.worst = std::max(r.worst, difference);
  }
  return r;
}

} // namespace

TEST_CASE("the chord over a 40-step history, on every implicit model: Newton's results within "
          "its tolerance, fewer jacobian rows where it applies, the same bits where not") {
  double worst = 0;
  for (const auto& [artifact, group] : implicit_models) {
    const std::string name = artifact;
    CAPTURE(name);
    const auto model = load_model(test::stub(name, "model"), "model");
    const History history(model, test::Reference(name).group(std::string(group) + "/in"));
    NewtonFactors factors;
    const auto r = side_by_side(model, history, steps, factors);
    worst = std::max(worst, r.worst);
    // Where Newton's steps are direct (the row pass; block groups, 300 bins: the tensor
    // path), each point keeps its factor; with Krylov steps the chord does not apply and
    // nothing changes.
    const auto& s = model.sessions().front();
    const bool applies = factors.points() > 0;
    CHECK(applies == (name != "perzyna_gmres"));
    if (applies && name != "j2_radial_return") // J2's one update a step: A where it starts
      CHECK(r.chord_a < r.plain_a);
    if (!applies)
      CHECK(test::identical(r.chord, r.plain));
    CHECK(s.solver_config().chord == false);
  }
  MESSAGE("largest relative difference from Newton over the histories: " << worst);
}

TEST_CASE("a point whose kept factor stops converging takes A again; the others do not") {
  // x' = a - x^2 by backward Euler (r = x - x~1 - dt (a - x^2), A = 1 + 2 dt x), 64 points
  // driven to x = 1. Then half of them get a = 100 (x -> 6.6): their kept A (1.2) is far
  // from the new one (2.3), so a chord step from it does not lower ||r|| enough, and each of
  // them takes A again; the others step from their kept factor, A nowhere.
  const auto model = load_model(test::stub("scalar_backward_euler", "model"), "model");
  const std::int64_t points = 64;
  const auto opts = at::TensorOptions(at::kDouble);
  auto a = at::ones({points}, opts);
  auto x = at::zeros({points}, opts), x_plain = x.clone();
  NewtonFactors factors;
  const auto step = [&](int n, const at::Tensor& from, NewtonFactors* f) {
    const TensorMap in{{"x", from},
                       {"x~1", from},
                       {"a", a},
                       {"t", at::full({points}, 0.1 * n, opts)},
                       {"t~1", at::full({points}, 0.1 * (n - 1), opts)}};
    return (f ? model.forward(in, *f) : model.forward(in)).at("x");
  };
  for (int n = 1; n <= 60; ++n) {
    x = step(n, x, &factors);
    x_plain = step(n, x_plain, nullptr);
  }
  test::check_close(x, x_plain, "steady", history_rtol);
  CHECK(graph_rows([&] { x = step(61, x, &factors); })["jacobian"] == 0);
  x_plain = step(61, x_plain, nullptr);

  a.narrow(0, 0, points / 2).fill_(100.0);
  at::Tensor x_jump;
  const auto rows = graph_rows([&] { x_jump = step(62, x, &factors); });
  CHECK(rows.at("jacobian") >= points / 2);
  CHECK(rows.at("jacobian") <= 3 * points / 2); // each jumped point a few times at most
  test::check_close(x_jump, step(62, x_plain, nullptr), "after the jump", history_rtol);
  // The points that did not jump still took no A: only the jumped ones appear in calls
  // after the first, which a factor per point (not per batch) makes so.
  auto again = graph_rows([&] { (void)step(63, x_jump, &factors); });
  CHECK(again["jacobian"] <= points / 2);
}

TEST_CASE("the chord's derivatives are the implicit function theorem's at its solution") {
  for (const std::string name : {"perzyna_viscoplasticity", "chaboche_viscoplasticity"}) {
    CAPTURE(name);
    const auto model = load_model(test::stub(name, "model"), "model");
    const History history(model, test::Reference(name).group("s0/in"));
    NewtonFactors factors;
    TensorMap state;
    for (int n = 1; n <= 10; ++n)
      state = model.forward(history.inputs(n, state), factors);
    const auto in = history.inputs(11, state);
    const auto [chord_out, chord_J] = model.jacobian(in, factors);
    const auto [plain_out, plain_J] = model.jacobian(in);
    test::check_close(chord_out, plain_out, "outputs", history_rtol);
    for (const auto& [o, blocks] : plain_J)
      for (const auto& [i, block] : blocks)
        test::check_close(chord_J.at(o).at(i), block, "d" + o + "/d" + i, history_rtol);
    // At the chord's own solution, Newton (0 updates) gives the same derivatives: they are
    // the theorem's there, whatever the iteration that reached it.
    auto at_solution = in;
    for (const auto& [o, value] : chord_out)
      if (at_solution.count(o))
        at_solution[o] = value;
    const auto [again_out, again_J] = model.jacobian(at_solution);
    for (const auto& [o, blocks] : again_J)
      for (const auto& [i, block] : blocks)
        test::check_close(chord_J.at(o).at(i), block, "at the solution d" + o + "/d" + i, 1e-9);
  }
}

TEST_CASE("points the chord cannot solve fail as Newton's do: same mask, same reasons; the "
          "model and the factors stay usable") {
  // a = -1000: r = x - x~1 + 0.1 (1000 + x^2) has no root.
  const auto model = load_model(test::stub("scalar_backward_euler", "model"), "model");
  const std::int64_t points = 16;
  const auto opts = at::TensorOptions(at::kDouble);
  auto a = at::ones({points}, opts);
  a.index_put_({at::arange(0, points, 3)}, -1000.0);
  const TensorMap in{{"x", at::zeros({points}, opts)},
                     {"x~1", at::zeros({points}, opts)},
                     {"a", a},
                     {"t", at::full({points}, 0.1, opts)},
                     {"t~1", at::zeros({points}, opts)}};
  NewtonFactors factors;
  const auto chord = test::convergence_error([&] { (void)model.forward(in, factors); });
  const auto plain = test::convergence_error([&] { (void)model.forward(in); });
  CHECK(test::identical(chord.converged_mask(), plain.converged_mask()));
  CHECK(test::identical(chord.reasons(), plain.reasons()));
  test::check_close(chord.outputs().at("x").nan_to_num(0), plain.outputs().at("x").nan_to_num(0),
                    "converged points", history_rtol);
  a.fill_(1.0);
  auto fixed = in;
  fixed["a"] = a;
  test::check_close(model.forward(fixed, factors), model.forward(fixed), "after", history_rtol);
}

TEST_CASE("SolverConfig::chord within one call; NewtonFactors' slots; chord_rate checked") {
  const auto model = load_model(test::stub("chaboche_viscoplasticity", "model"), "model");
  const History history(model, test::Reference("chaboche_viscoplasticity").group("s0/in"));
  TensorMap state;
  for (int n = 1; n <= 5; ++n)
    state = model.forward(history.inputs(n, state));
  const auto in = history.inputs(6, state);
  TensorMap plain, chord;
  const auto plain_rows = graph_rows([&] { plain = model.forward(in); });
  auto config = model.solver_config();
  config.chord = true;
  auto& mutable_model = const_cast<DispatchedModel<SyncChunking>&>(model);
  mutable_model.set_solver_config(config);
  const auto chord_rows = graph_rows([&] { chord = model.forward(in); });
  test::check_close(chord, plain, "within a call", history_rtol);
  // Two updates a point: A twice by Newton, once by the chord (then its factor again).
  const auto points = in.at("E").size(0);
  CHECK(plain_rows.at("jacobian") >= 2 * points);
  CHECK(chord_rows.at("jacobian") == points);

  NewtonFactors factors;
  CHECK(factors.points() == 0);
  (void)model.forward(in, factors);
  CHECK(factors.points() == points);
  CHECK(factors.bytes() == points * (1 + 19 + 19 * 19) * 8); // Chaboche: 19 unknowns
  factors.clear();
  CHECK(factors.points() == 0);
  // An explicit model keeps none.
  const auto elastic = load_model(test::stub("elasticity", "elasticity"), "elasticity");
  (void)elastic.forward({{"strain", at::zeros({4, 6}, at::kDouble)}}, factors);
  CHECK(factors.points() == 0);

  config.chord_rate = 1;
  const auto message = test::fatal_message([&] { mutable_model.set_solver_config(config); });
  CHECK(test::contains(message, "chord_rate"));
  CHECK(test::contains(message, "within (0, 1)"));
  CHECK(model.solver_config().chord_rate == 0.1);
}

TEST_CASE("a chord row takes A again where its residual falls slower than chord_rate, or "
          "would not converge in time") {
  using neml2::detail::chord_refactors;
  // rate, ||r|| over its tolerance, iterations left, chord_rate
  CHECK(chord_refactors(1.2, 1e6, 20, 0.1));        // growing
  CHECK(chord_refactors(0.3, 1e6, 20, 0.1));        // slow
  CHECK_FALSE(chord_refactors(0.3, 1e6, 20, 0.5));  // ... but within a looser chord_rate
  CHECK_FALSE(chord_refactors(0.05, 1e6, 20, 0.1)); // fast: 4.6 steps
  CHECK(chord_refactors(0.05, 1e6, 4, 0.1));        // ... but only 4 left
  CHECK_FALSE(chord_refactors(0.05, 0.5, 1, 0.1));  // within its tolerance already
}

TEST_CASE("the chord pays where A costs a row more than three residuals, as measured") {
  CHECK(neml2::detail::chord_pays(0, 0)); // nothing measured: assumed to
  CHECK_FALSE(neml2::detail::chord_pays(1e-8, 2e-8));
  CHECK(neml2::detail::chord_pays(1e-8, 5e-8));
  neml2::detail::NewtonSchedule schedule;
  schedule.record_cost(false, 1000, 1000 * 1e-8);
  schedule.record_cost(true, 1000, 1000 * 2e-8);
  CHECK_FALSE(schedule.chord_pays());        // J2's graphs: A about twice a residual
  schedule.record_cost(true, 10, 10 * 1e-5); // too few rows to tell
  CHECK_FALSE(schedule.chord_pays());
  for (int k = 0; k < 20; ++k)
    schedule.record_cost(true, 1000, 1000 * 5e-7); // Perzyna's: fifty residuals
  CHECK(schedule.chord_pays());
}

TEST_CASE("MaterialState's StepOptions::chord: the state keeps a factor a point, a step over "
          "some points uses and keeps theirs") {
  const auto model = load_model(test::stub("perzyna_viscoplasticity", "model"), "model");
  const std::int64_t points = 64;
  const auto opts = at::TensorOptions(at::kDouble);
  const auto direction = at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, opts);
  const auto amplitude = (2e-2 * at::linspace(0.5, 1.5, points, opts)).unsqueeze(1) * direction;
  MaterialState plain(model, points), chord(model, points);
  std::int64_t late_a = 0;
  for (int n = 1; n <= steps; ++n) {
    const TensorMap forces{{"E", amplitude * (n / 40.0)}};
    const auto t = at::full({points}, 0.1 * n, opts);
    const auto& p = plain.step(forces, t);
    const StepResult* c = nullptr;
    auto rows = graph_rows([&] { c = &chord.step(forces, t, {.chord = true}); });
    if (n > 20)
      late_a += rows["jacobian"];
    test::check_close(c->outputs, p.outputs, "step", history_rtol);
    plain.accept();
    chord.accept();
  }
  CHECK(late_a < 20 * points / 4); // A at few point-steps once the flow is steady
  // A step over some points: their factors, gathered and put back.
  const auto some = at::arange(0, points, 2, at::kLong);
  const TensorMap forces{{"E", amplitude.index_select(0, some) * (41 / 40.0)}};
  const auto t = at::full({some.size(0)}, 4.1, opts);
  const StepResult* c = nullptr;
  auto rows = graph_rows([&] { c = &chord.step(forces, t, {.points = some, .chord = true}); });
  CHECK(rows["jacobian"] < some.size(0));
  test::check_close(c->outputs, plain.step(forces, t, {.points = some}).outputs, "subset",
                    history_rtol);
}

TEST_CASE("the chord's results do not depend on chunks or lanes beyond rounding: each point's "
          "factor is its own") {
  // Whole batches on one lane against chunks of 37 rows on 2 lanes, each with its own
  // NewtonFactors over the same 12-step history. Not the same bits: Newton's own results
  // here differ by 5e-17 at step 2 between the two (measured; the cause not located), and
  // the chord carries that along (3e-16 to 5e-16). A factor shared across chunks (a
  // chunk's row k taking another's slot) would miss by far more: the chord's tolerance.
  const auto stub = test::stub("chaboche_viscoplasticity", "model");
  const auto whole = load_model(stub, "model", SyncChunking{.cpu_lanes = 1});
  const auto chunked = load_model(stub, "model", SyncChunking{.batch_size = 37, .cpu_lanes = 2});
  const auto first = test::Reference("chaboche_viscoplasticity").group("s0/in");
  TensorMap tiled_first;
  for (const auto& [name, value] : first) // 5 copies of the reference's rows
    tiled_first.emplace(name, value.repeat_interleave(5, 0));
  const History a(whole, tiled_first), b(chunked, tiled_first);
  NewtonFactors fa, fb;
  TensorMap sa, sb;
  for (int n = 1; n <= 12; ++n) {
    CAPTURE(n);
    sa = whole.forward(a.inputs(n, sa), fa);
    sb = chunked.forward(b.inputs(n, sb), fb);
    CHECK(relative_difference(sa, sb) <= 1e-14);
  }
  CHECK(fa.points() == fb.points());
}

TEST_CASE("an asynchronous policy's CPU chunks keep their points' factors too") {
  const auto stub = test::stub("perzyna_viscoplasticity", "model");
  const auto plain = load_model(stub, "model");
  const auto pooled =
      load_model(stub, "model", GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {7}});
  const History history(plain, test::Reference("perzyna_viscoplasticity").group("s0/in"));
  NewtonFactors factors;
  TensorMap a, b;
  std::int64_t late_a = 0;
  for (int n = 1; n <= 20; ++n) {
    CAPTURE(n);
    a = plain.forward(history.inputs(n, a));
    auto rows = graph_rows([&] { b = pooled.forward(history.inputs(n, b), factors); });
    if (n > 10)
      late_a += rows["jacobian"];
    CHECK(relative_difference(b, a) <= history_rtol);
  }
  const auto points = a.begin()->second.size(0);
  CHECK(factors.points() == points);
  CHECK(late_a < 10 * points); // Newton takes A at every point-step that updates
}

TEST_CASE("the chord off the row pass: block groups (4 and 40 grains, 9 and 81 unknowns) and "
          "300 bins keep a factor a point, and each step of eager NEML2's history matches") {
  // unknowns per point: a NewtonFactors row holds 1 + n + n^2 values for the segment.
  const std::tuple<const char*, std::int64_t, int> models[] = {
      {"grains", 9, 5}, {"grains_40", 81, 5}, {"binned_precipitation_300", 300, 6}};
  for (const auto& [artifact, n, steps] : models) {
    const std::string name = artifact;
    CAPTURE(name);
    const test::Reference ref(name);
    const auto stub = test::stub(name, "model");
    const auto whole = load_model(stub, "model");
    const auto chunked = load_model(stub, "model", SyncChunking{.device = "cpu", .batch_size = 3});
    NewtonFactors factors, chunked_factors;
    std::int64_t plain_a = 0, chord_a = 0;
    for (int s = 0; s < steps; ++s) {
      CAPTURE(s);
      const auto in = ref.group(test::step_name(s) + "/in");
      const auto expected = ref.group(test::step_name(s) + "/out");
      TensorMap chord, plain;
      const auto converted = neml2::detail::block_group_conversions();
      chord_a += graph_rows([&] { chord = whole.forward(in, factors); })["jacobian"];
      plain_a += graph_rows([&] { plain = whole.forward(in); })["jacobian"];
      // Each solve converts its block groups once (the unknowns, the givens, the solution),
      // not at each of its graph calls.
      CHECK(neml2::detail::block_group_conversions() - converted == (n == 300 ? 0 : 2 * 3));
      test::check_close(chord, expected, "the chord against eager NEML2", 1e-8);
      test::check_close(chord, plain, "the chord against Newton", history_rtol);
      // Chunks of 3 with their own factors: each point's factor is its own.
      test::check_close(chunked.forward(in, chunked_factors), chord, "in chunks", 1e-12);
    }
    const auto points = ref.group("s0/in").begin()->second.size(0);
    CHECK(factors.points() == points);
    CHECK(factors.bytes() == points * (1 + n + n * n) * 8);
    CHECK(chord_a < plain_a);
  }
}

TEST_CASE("the chord with NEML2's line search (on the row pass's models and on block groups): "
          "Newton's results within its tolerance, fewer jacobian rows, the same failure masks") {
  // ls_max_iters = 5: a fresh A's step takes the line search; a step from an older factor
  // that the search's sufficient decrease at alpha = 1 refuses is taken back.
  for (const auto* type : {"BACKTRACKING", "STRONG_WOLFE"})
    for (const auto& [artifact, group] :
         {std::pair{"chaboche_viscoplasticity", "s0"}, {"grains", "s0"}, {"grains_40", "s0"}}) {
      const std::string name = artifact;
      CAPTURE(name);
      CAPTURE(type);
      auto model = load_model(test::stub(name, "model"), "model");
      auto config = model.solver_config();
      config.ls_max_iters = 5;
      config.ls_type = type;
      model.set_solver_config(config);
      const History history(model, test::Reference(name).group(std::string(group) + "/in"));
      NewtonFactors factors;
      const auto r = side_by_side(model, history, 10, factors);
      CHECK(factors.points() > 0);
      CHECK(r.chord_a < r.plain_a);
    }
}

TEST_CASE("the tensor path's chord gives each point the same bits on one lane or two") {
  // The same chunks (7 rows) on 1 and 2 lanes, each with its own NewtonFactors over the
  // reference's history: block groups of 80 unknowns (LAPACK's LU) and 9 (ours).
  for (const auto* name : {"grains_40", "grains"}) {
    CAPTURE(name);
    const test::Reference ref(name);
    const auto stub = test::stub(name, "model");
    const auto one = load_model(stub, "model", SyncChunking{.batch_size = 7, .cpu_lanes = 1});
    const auto two = load_model(stub, "model", SyncChunking{.batch_size = 7, .cpu_lanes = 2});
    NewtonFactors f1, f2;
    for (int s = 0; s < 5; ++s) {
      CAPTURE(s);
      const auto in = ref.group(test::step_name(s) + "/in");
      CHECK(test::identical(one.forward(in, f1), two.forward(in, f2)));
    }
    CHECK(f1.points() == f2.points());
  }
}

TEST_CASE("the tensor path's chord takes back a step from a factor that does not lower ||r||, "
          "and takes A where it started") {
  // Every point's slot holds a factor of 1e-8 I: its step is 1e8 b, far off. Taken back, A
  // is taken at the start and the step ends where Newton's does.
  const test::Reference ref("grains");
  const auto model = load_model(test::stub("grains", "model"), "model");
  const auto in = ref.group("s1/in");
  NewtonFactors factors;
  (void)model.forward(ref.group("s0/in"), factors); // slots of the right size
  auto& slots = neml2::detail::NewtonFactorsAccess::held(factors);
  const std::int64_t n = 9;
  slots.zero_();
  slots.select(1, 0).fill_(1.0);
  for (std::int64_t k = 0; k < n; ++k) {
    slots.select(1, 1 + k * n + k).fill_(1e-8);
    slots.select(1, 1 + n * n + k).fill_(static_cast<double>(k));
  }
  TensorMap chord;
  const auto rows = graph_rows([&] { chord = model.forward(in, factors); });
  test::check_close(chord, model.forward(in), "after a bad factor", history_rtol);
  // Each point takes A once, where it started (without the take-back: 133 rows for 20).
  CHECK(rows.at("jacobian") == in.at("t").size(0));
}
