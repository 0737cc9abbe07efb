// MaterialState: the state of material points kept over steps, against hand-written loops
// and eager NEML2; accept and reject; points cut alone against NEML2's bisection.

#include <cmath>
#include <limits>
#include <optional>

#include "model_checks.hpp"
#include "scalar_model.hpp"

using namespace neml2;
using test::step_name;

namespace {

DispatchedModel<SyncChunking> load(const std::string& artifact, SyncChunking policy = {}) {
  return test::load(artifact, "model", policy);
}

// The implicit models with a reference history (tools/make_reference.py --history), its
// steps, and whether their Jacobians were compiled.
struct History {
  const char* artifact;
  int steps;
  bool derivatives;
};
constexpr History histories[] = {
    {"scalar_backward_euler", 4, true},
    {"j2_radial_return", 5, true},
    {"perzyna_viscoplasticity", 5, true},
    {"chaboche_viscoplasticity", 5, true},
    {"perzyna_gmres", 5, true},
    {"binned_precipitation", 6, false},
    {"slip_systems", 5, false},
    {"gtn_viscoplasticity", 5, true},
    {"grains", 5, false},
};

bool is_output(const AnyDispatchedModel& m, const std::string& name) {
  const auto& out = m.output_names();
  return std::find(out.begin(), out.end(), name) != out.end();
}

// A host's loop by hand, as examples/time_stepping.cpp wrote it before MaterialState: the
// reference's inputs of each step, with every old state and initial guess replaced by the
// loop's own outputs of the step before.
struct HandLoop {
  const AnyDispatchedModel& model;
  TensorMap previous;

  TensorMap inputs(TensorMap in) const {
    for (auto& [name, value] : in) {
      const auto base = name.ends_with("~1") ? name.substr(0, name.size() - 2) : name;
      if (previous.count(base) && is_output(model, base))
        value = previous.at(base);
    }
    return in;
  }
};

// The values of a step's inputs a host drives: every input that is neither a state nor
// an old value.
TensorMap driven(const MaterialState& state, const TensorMap& inputs) {
  TensorMap forces;
  for (const auto& names : {state.roles().forces, state.roles().given})
    for (const auto& n : names)
      forces.emplace(n, inputs.at(n));
  return forces;
}

// The start of the first step as the reference history has it.
TensorMap initial(const StateRoles& roles, const TensorMap& inputs) {
  TensorMap start;
  for (const auto& x : roles.state)
    start.emplace(x, inputs.at(x + "~1"));
  for (const auto& f : roles.forces)
    start.emplace(f, inputs.at(f + "~1"));
  for (const auto& h : roles.fixed)
    start.emplace(h, inputs.at(h));
  return start;
}

TensorMap clone(const TensorMap& values) {
  TensorMap out;
  for (const auto& [name, t] : values)
    out.emplace(name, t.clone());
  return out;
}

// The scalar model's rows of scalar_substepping's reference: one step each, from x~1 over
// [t~1, t], some that converge only in bisected spans and some not even at depth 3.
struct ScalarCase {
  test::Reference ref{"scalar_substepping"};
  TensorMap in = ref.group("sub/in");
  std::int64_t rows = in.at("a").size(0);
};

// f throws a FatalError whose message holds `part`.
template <class F>
void refused(F&& f, const std::string& part) {
  const auto message = test::fatal_message(f);
  CHECK_MESSAGE(test::contains(message, part), message);
}

MaterialState scalar_state(const AnyDispatchedModel& m, const ScalarCase& c) {
  return MaterialState(m, c.rows, {{"x", c.in.at("x~1")}, {"t", c.in.at("t~1")}});
}

} // namespace

TEST_CASE("roles: state, forces, given and fixed inputs, from the names") {
  const auto j2 = load("j2_radial_return");
  const auto r = state_roles(j2);
  CHECK(r.state == std::vector<std::string>{"equivalent_plastic_strain", "plastic_strain"});
  CHECK(r.forces == std::vector<std::string>{"t"});
  CHECK(r.given == std::vector<std::string>{"E"});
  CHECK(r.fixed == std::vector<std::string>{"flow_rate~1"});

  const auto chaboche = state_roles(load("chaboche_viscoplasticity"));
  CHECK(chaboche.state ==
        std::vector<std::string>{"stress", "equivalent_plastic_strain", "X1", "X2"});
  CHECK(chaboche.forces == std::vector<std::string>{"E", "t"});
  CHECK(chaboche.given.empty());
  CHECK(chaboche.fixed.empty());

  const auto elastic = state_roles(load_model(test::stub("elasticity", "elasticity")));
  CHECK(elastic.state.empty());
  CHECK(elastic.given == std::vector<std::string>{"strain"});
}

TEST_CASE("every implicit model's history: the same bits as a hand-written loop, and eager "
          "NEML2's values") {
  for (const auto& h : histories) {
    CAPTURE(h.artifact);
    const test::Reference ref(h.artifact);
    // In chunks of 8 rows: failures and results are gathered across chunks.
    const auto model = load(h.artifact, SyncChunking{.batch_size = 8});
    const auto first = ref.group("s0/in");
    const auto points = first.begin()->second.size(0);
    MaterialState state(model, points, initial(state_roles(model), first));
    HandLoop hand{model, {}};
    for (int n = 0; n < h.steps; ++n) {
      CAPTURE(n);
      const auto in = ref.group(step_name(n) + "/in");
      const auto& r = state.step(driven(state, in), {.derivatives = h.derivatives, .max_cuts = 3});
      CHECK(r.failed == 0);
      CHECK(r.cut == 0);
      CHECK(at::equal(r.substeps, at::ones({points}, at::kLong)));
      test::check_close(r.outputs, ref.group(step_name(n) + "/out"), "eager NEML2", 1e-8);
      if (h.derivatives) {
        const auto [out, J] = model.jacobian(hand.inputs(in));
        CHECK(test::identical(r.outputs, out));
        for (const auto& [o, blocks] : J)
          for (const auto& [i, block] : blocks) {
            CAPTURE(o + "/" + i);
            CHECK(at::equal(r.derivatives.at(o).at(i), block.expand_as(r.derivatives.at(o).at(i))));
          }
        hand.previous = out;
      } else {
        hand.previous = model.forward(hand.inputs(in));
        CHECK(test::identical(r.outputs, hand.previous));
      }
      state.accept();
      for (const auto& x : state.roles().state)
        CHECK(at::equal(state.start().at(x), hand.previous.at(x)));
      for (const auto& f : state.roles().forces)
        CHECK(at::equal(state.start().at(f), in.at(f)));
    }
  }
}

TEST_CASE("accept and reject: a rejected step leaves the start bit for bit, a step replaces "
          "the trial, nothing to accept is an error") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  MaterialState state(model, points);
  CHECK_THROWS_AS(state.accept(), FatalError);
  state.step(driven(state, ref.group("s0/in")));
  state.accept();
  const auto before = clone(state.start());

  // Reject: the start as it was; accept() has nothing to take.
  state.step(driven(state, ref.group("s2/in")));
  CHECK(state.pending());
  state.reject();
  CHECK_FALSE(state.pending());
  CHECK(test::identical(state.start(), before));
  CHECK_THROWS_AS(state.accept(), FatalError);
  // Nothing pending: reject() refuses as accept() does (issue 51), the start untouched.
  CHECK(test::contains(test::fatal_message([&] { state.reject(); }),
                       "MaterialState::reject(): no step is pending; call step() first"));
  CHECK(test::identical(state.start(), before));

  // A step replaces the trial before it: residual evaluations of one time step, then accept.
  state.step(driven(state, ref.group("s2/in")));
  const auto& r = state.step(driven(state, ref.group("s1/in")));
  test::check_close(r.outputs, ref.group("s1/out"), "the last trial", 1e-8);
  state.accept();
  for (const auto& x : state.roles().state)
    CHECK(at::equal(state.start().at(x), r.outputs.at(x)));

  // Accept a subset: those points move, the others keep their start, bit for bit.
  const auto kept = clone(state.start());
  const auto& r2 = state.step(driven(state, ref.group("s2/in")));
  const auto some = at::tensor(std::vector<std::int64_t>{0, 3, points - 1});
  const auto trial = clone(r2.outputs);
  state.accept(some);
  auto moved = at::zeros({points}, at::kBool);
  moved.index_fill_(0, some, true);
  for (const auto& x : state.roles().state) {
    const auto& now = state.start().at(x);
    CHECK(at::equal(now.index({moved}), trial.at(x).index({moved})));
    CHECK(at::equal(now.index({~moved}), kept.at(x).index({~moved})));
  }
  CHECK(at::equal(state.start().at("t").index({moved}), ref["s2/in/t"].index({moved})));
  CHECK(at::equal(state.start().at("t").index({~moved}), kept.at("t").index({~moved})));
}

TEST_CASE("points cut alone: bisected spans as eager NEML2 takes them, the others untouched") {
  const ScalarCase c;
  const auto& expected = c.ref["sub/out/x"];
  const auto& spans = c.ref["sub/spans"];
  const auto model = load("scalar_backward_euler"); // compiled without substepping
  auto state = scalar_state(model, c);
  const TensorMap forces{{"a", c.in.at("a")}};
  const auto& r = state.step(forces, c.in.at("t"), {.max_cuts = 3});

  const auto converged = spans > 0;
  CHECK(at::equal(r.converged, converged));
  CHECK(r.failed == (~converged).sum().item<std::int64_t>());
  CHECK(r.cut == (spans > 1).sum().item<std::int64_t>());
  CHECK(at::equal(r.substeps, spans.to(at::kLong)));
  const auto& x = r.outputs.at("x");
  test::check_close(x.index({converged}), expected.index({converged}), "eager spans", 1e-8);
  CHECK(at::isnan(x.index({~converged})).all().item<bool>());
  // And the closed form, to the solver's tolerance (each span stops at rtol 1e-8).
  for (std::int64_t p = 0; p < c.rows; ++p) {
    CAPTURE(p);
    int count = 0;
    const auto root = test::scalar_bisected(c.in.at("x~1")[p].item<double>(),
                                            (c.in.at("t")[p] - c.in.at("t~1")[p]).item<double>(),
                                            c.in.at("a")[p].item<double>(), 3, count);
    REQUIRE(root.has_value() == converged[p].item<bool>());
    if (root)
      CHECK(std::abs(x[p].item<double>() - *root) <= 1e-7 * std::max(1.0, std::abs(*root)));
  }

  // The points that converge in one step: the same bits as a state without the others.
  const auto one = (spans == 1).nonzero().squeeze(1);
  const auto alone_model = load("scalar_backward_euler");
  MaterialState alone(
      alone_model, one.size(0),
      {{"x", c.in.at("x~1").index_select(0, one)}, {"t", c.in.at("t~1").index_select(0, one)}});
  const auto& ra =
      alone.step({{"a", c.in.at("a").index_select(0, one)}}, c.in.at("t").index_select(0, one));
  CHECK(at::equal(ra.outputs.at("x"), x.index_select(0, one)));

  // accept(): the converged points move, the failed keep their start.
  state.accept();
  CHECK(at::equal(state.start().at("x").index({converged}), x.index({converged})));
  CHECK(at::equal(state.start().at("x").index({~converged}), c.in.at("x~1").index({~converged})));
  CHECK(at::equal(state.start().at("t").index({~converged}), c.in.at("t~1").index({~converged})));
}

TEST_CASE("points cut alone: derivatives chained through the spans, as the library's own "
          "substepping chains them, and the closed form's") {
  const ScalarCase c;
  const auto converged = c.ref["sub/spans"] > 0;
  const auto ok = converged.nonzero().squeeze(1);
  const auto model = load("scalar_backward_euler");
  auto state = scalar_state(model, c);
  const auto& r =
      state.step({{"a", c.in.at("a")}}, c.in.at("t"), {.derivatives = true, .max_cuts = 3});
  CHECK(at::equal(r.converged, converged));

  // scalar_substepping bisects inside its implicit segment and chains there (src/implicit/).
  const auto substepping = load("scalar_substepping");
  TensorMap rows;
  for (const auto& [n, v] : c.in)
    rows.emplace(n, v.index_select(0, ok));
  const auto [out, J] = substepping.jacobian(rows);
  test::check_close(r.outputs.at("x").index_select(0, ok), out.at("x"), "x", 1e-8);
  for (const auto& [i, block] : J.at("x")) {
    CAPTURE(i);
    test::check_close(r.derivatives.at("x").at(i).index_select(0, ok), block, "dx/d" + i, 1e-8);
  }
  for (const auto& [i, block] : r.derivatives.at("x"))
    CHECK(at::isnan(block.index({~converged})).all().item<bool>());

  // Central differences of the closed form, on a point cut into several spans.
  const auto p = (c.ref["sub/spans"] >= 3).nonzero()[0][0].item<std::int64_t>();
  const double x0 = c.in.at("x~1")[p].item<double>(), t0 = c.in.at("t~1")[p].item<double>(),
               t1 = c.in.at("t")[p].item<double>(), a = c.in.at("a")[p].item<double>();
  const auto root = [&](double x_old, double dt, double a_) {
    int spans = 0;
    return *test::scalar_bisected(x_old, dt, a_, 3, spans);
  };
  const double h = 1e-6;
  const auto d = [&](const char* i) { return r.derivatives.at("x").at(i)[p].item<double>(); };
  CHECK(d("a") == doctest::Approx((root(x0, t1 - t0, a + h) - root(x0, t1 - t0, a - h)) / (2 * h))
                      .epsilon(1e-6));
  CHECK(d("x~1") == doctest::Approx((root(x0 + h, t1 - t0, a) - root(x0 - h, t1 - t0, a)) / (2 * h))
                        .epsilon(1e-6));
  CHECK(d("t") == doctest::Approx((root(x0, t1 + h - t0, a) - root(x0, t1 - h - t0, a)) / (2 * h))
                      .epsilon(1e-6));
  CHECK(d("t~1") == doctest::Approx(-d("t")).epsilon(1e-8));
  CHECK(d("x") == 0); // the initial guess: nothing flows from it
}

TEST_CASE("bad input is refused before anything is written") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  const auto E = ref["s1/in/E"];

  refused([&] { static_cast<void>(MaterialState(model, 0)); }, "at least 1");
  refused(
      [&] {
        static_cast<void>(MaterialState(model, points, {{"stress", at::zeros({points, 6})}}));
      },
      "'stress', which is not a state variable, force, given or fixed input or older value");
  refused(
      [&] {
        static_cast<void>(
            MaterialState(model, points, {{"plastic_strain", at::zeros({points, 5})}}));
      },
      "does not broadcast to [20, 6]");

  MaterialState state(model, points, {{"equivalent_plastic_strain", at::full({}, 0.25)}});
  CHECK(at::equal(state.start().at("equivalent_plastic_strain"),
                  at::full({points}, 0.25, at::kDouble)));
  state.step({{"E", ref["s0/in/E"]}}, ref["s0/in/t"]);
  state.accept();
  state.step({{"E", E}}, ref["s1/in/t"]);
  const auto start = clone(state.start());
  const auto trial = clone(state.step({{"E", E}}, ref["s1/in/t"]).outputs);
  const auto t = ref["s1/in/t"];

  refused(
      [&] {
        static_cast<void>(state.step({{"E", E}, {"strain", E}}, t));
      },
      "'strain' is not a force or given input");
  refused([&] { static_cast<void>(state.step({}, t)); }, "no value for 'E'");
  refused([&] { static_cast<void>(state.step({{"E", E}})); }, "no value for 't'");
  refused([&] { static_cast<void>(state.step({{"E", E}, {"t", t}}, t)); }, "'t' is given twice");
  refused(
      [&] {
        static_cast<void>(state.step({{"E", E.narrow(0, 0, 3)}}, t));
      },
      "'E' has shape [3, 6], which does not broadcast to [20, 6]");
  refused([&] { static_cast<void>(state.step({{"E", E.to(at::kInt)}}, t)); }, "floating-point");
  refused([&] { static_cast<void>(state.step({{"E", E}}, t, {.max_cuts = 31})); }, "max_cuts = 31");
  refused([&] { static_cast<void>(state.accept(at::zeros({points + 1}, at::kBool))); },
          "a mask of shape [21]");
  refused(
      [&] {
        static_cast<void>(state.accept(at::tensor(std::vector<std::int64_t>{0, points})));
      },
      "indices from 0 to 20");
  // Each refusal left the start and the pending trial as they were.
  CHECK(test::identical(state.start(), start));
  CHECK(state.pending());
  state.accept();
  for (const auto& x : state.roles().state)
    CHECK(at::equal(state.start().at(x), trial.at(x)));

  // Derivatives of a model compiled without them.
  const auto binned = load("binned_precipitation");
  MaterialState bins(binned, 2);
  refused(
      [&] {
        static_cast<void>(bins.step({{"T", at::ones({2})}}, at::ones({2}), {.derivatives = true}));
      },
      "no Jacobian graphs");
  CHECK_FALSE(bins.pending());

  // A time for a model without one.
  const auto elastic = load_model(test::stub("elasticity", "elasticity"));
  MaterialState points_of(elastic, 2);
  refused(
      [&] {
        static_cast<void>(points_of.step({{"strain", at::zeros({2, 6})}}, at::ones({2})));
      },
      "no input 't'");
}

TEST_CASE("accepting a point that failed is refused, naming it") {
  const ScalarCase c;
  const auto model = load("scalar_backward_euler");
  auto state = scalar_state(model, c);
  const auto before = clone(state.start());
  const auto& r = state.step({{"a", c.in.at("a")}}, c.in.at("t"));
  REQUIRE(r.failed > 0);
  CHECK(r.cut == 0);
  CHECK(at::equal(r.substeps, r.converged.to(at::kLong)));
  const auto bad = (~r.converged).nonzero()[0][0].item<std::int64_t>();
  refused([&] { static_cast<void>(state.accept(at::ones({c.rows}, at::kBool))); },
          "point " + std::to_string(bad) + " did not converge");
  CHECK(test::identical(state.start(), before));
  state.reject();
}

TEST_CASE("results straight into the host's storage: records per point, arrays per component, "
          "a subset by index") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  MaterialState plain(model, points), aos(model, points), soa(model, points), some(model, points);
  // Per point: stress (6), equivalent plastic strain (1), plastic strain (6), d(stress)/d(E) (36).
  auto records = at::full({points, 49}, 7.0, at::kDouble);
  const HostLayout records_layout{
      .outputs = {{"stress", records.narrow(1, 0, 6)},
                  {"equivalent_plastic_strain", records.select(1, 6)},
                  {"plastic_strain", records.narrow(1, 7, 6)}},
      .derivatives = {{"stress", {{"E", records.narrow(1, 13, 36).unflatten(1, {6, 6})}}}}};
  // One array per component: stress as (6, N), read as an (N, 6) view.
  auto stress_by_component = at::empty({6, points}, at::kDouble);
  const HostLayout arrays_layout{.outputs = {{"stress", stress_by_component.t()}}};
  const auto chosen = at::tensor(std::vector<std::int64_t>{5, 2, points - 1});
  auto chosen_stress = at::empty({3, 6}, at::kDouble);
  auto chosen_tangent = at::empty({3, 6, 6}, at::kDouble);
  const HostLayout subset_layout{.outputs = {{"stress", chosen_stress}},
                                 .derivatives = {{"stress", {{"E", chosen_tangent}}}},
                                 .points = chosen};
  for (int n = 0; n < 5; ++n) {
    CAPTURE(n);
    const auto in = ref.group(step_name(n) + "/in");
    const TensorMap forces{{"E", in.at("E")}};
    const auto& expected = plain.step(forces, in.at("t"), {.derivatives = true});
    const auto& r = aos.step(forces, in.at("t"), {.derivatives = true, .into = records_layout});
    CHECK(r.outputs.at("stress").data_ptr() == records.data_ptr()); // written there, not copied
    CHECK(at::equal(records.narrow(1, 0, 6), expected.outputs.at("stress")));
    CHECK(at::equal(records.select(1, 6), expected.outputs.at("equivalent_plastic_strain")));
    CHECK(at::equal(records.narrow(1, 7, 6), expected.outputs.at("plastic_strain")));
    CHECK(at::equal(records.narrow(1, 13, 36).unflatten(1, {6, 6}),
                    expected.derivatives.at("stress").at("E")));
    soa.step(forces, in.at("t"), {.into = arrays_layout});
    CHECK(at::equal(stress_by_component.t(), expected.outputs.at("stress")));
    some.step(forces, in.at("t"), {.derivatives = true, .into = subset_layout});
    CHECK(at::equal(chosen_stress, expected.outputs.at("stress").index_select(0, chosen)));
    CHECK(at::equal(chosen_tangent,
                    expected.derivatives.at("stress").at("E").index_select(0, chosen)));
    for (auto* s : {&plain, &aos, &soa, &some})
      s->accept();
    // A state that lives in host storage is copied at accept: the host may overwrite it.
    records.fill_(-1.0);
    for (const auto* s : {&aos, &soa, &some})
      CHECK(test::identical(s->start(), plain.start()));
  }
}

TEST_CASE("a host's records of outputs with sub-batch axes a forward segment made, in chunks") {
  // slip_systems: system_strength (12 systems) and mean_hardening (an SR2 averaged over
  // them) come from a forward segment after the solve; metadata.json gives neither its
  // sub-batch axes. The state's own outputs (work: not given) are allocated alike.
  const test::Reference ref("slip_systems");
  const auto model = load("slip_systems", SyncChunking{.batch_size = 7});
  const auto first = ref.group("s0/in");
  const auto points = first.at("f").size(0);
  MaterialState plain(model, points, initial(state_roles(model), first));
  MaterialState hosted(model, points, initial(state_roles(model), first));
  auto records = at::full({points, 18}, 7.0, at::kDouble);
  const HostLayout layout{.outputs = {{"system_strength", records.narrow(1, 0, 12)},
                                      {"mean_hardening", records.narrow(1, 12, 6)}}};
  for (int n = 0; n < 5; ++n) {
    CAPTURE(n);
    const auto in = ref.group(step_name(n) + "/in");
    const auto& expected = plain.step(driven(plain, in));
    test::check_close(expected.outputs, ref.group(step_name(n) + "/out"), "eager NEML2", 1e-8);
    const auto& r = hosted.step(driven(hosted, in), {.into = layout});
    CHECK(test::identical(r.outputs, expected.outputs));
    CHECK(at::equal(records.narrow(1, 0, 12), expected.outputs.at("system_strength")));
    CHECK(at::equal(records.narrow(1, 12, 6), expected.outputs.at("mean_hardening")));
    plain.accept();
    hosted.accept();
  }
}

TEST_CASE("points cut alone into the host's storage: converged rows written, failed rows NaN") {
  const ScalarCase c;
  const auto converged = c.ref["sub/spans"] > 0;
  const auto model = load("scalar_backward_euler");
  auto plain = scalar_state(model, c);
  auto hosted = scalar_state(model, c);
  auto records = at::full({c.rows, 2}, 7.0, at::kDouble); // x, then dx/da
  const HostLayout layout{.outputs = {{"x", records.select(1, 0)}},
                          .derivatives = {{"x", {{"a", records.select(1, 1)}}}}};
  const TensorMap forces{{"a", c.in.at("a")}};
  const auto& expected = plain.step(forces, c.in.at("t"), {.derivatives = true, .max_cuts = 3});
  const auto& r =
      hosted.step(forces, c.in.at("t"), {.derivatives = true, .max_cuts = 3, .into = layout});
  CHECK(at::equal(r.converged, expected.converged));
  CHECK(at::equal(r.substeps, expected.substeps));
  CHECK(at::equal(records.select(1, 0).index({converged}),
                  expected.outputs.at("x").index({converged})));
  CHECK(at::equal(records.select(1, 1).index({converged}),
                  expected.derivatives.at("x").at("a").index({converged})));
  CHECK(at::isnan(records.index({~converged})).all().item<bool>());
  plain.accept();
  hosted.accept();
  CHECK(test::identical(hosted.start(), plain.start()));
}

TEST_CASE("a host layout that does not fit is refused before anything is written") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  MaterialState state(model, points);
  const auto E = ref["s1/in/E"];
  const auto t = ref["s1/in/t"];
  auto buffer = at::full({points, 12}, 7.0, at::kDouble);
  const auto untouched = [&] { return (buffer == 7.0).all().item<bool>(); };
  // A trial pending: every refusal below keeps it.
  const auto trial = state.step({{"E", ref["s0/in/E"]}}, ref["s0/in/t"]).outputs;
  const auto step_into = [&](HostLayout layout, bool derivatives = false) {
    static_cast<void>(
        state.step({{"E", E}}, t, {.derivatives = derivatives, .into = std::move(layout)}));
  };
  refused(
      [&] {
        step_into({.outputs = {{"stress", buffer.narrow(0, 0, points - 1).narrow(1, 0, 6)}}});
      },
      "output 'stress' is Double of shape [19, 6]; pass a Double tensor of shape [20, 6]");
  refused(
      [&] {
        step_into({.outputs = {{"strss", buffer.narrow(1, 0, 6)}}});
      },
      "names output 'strss', which this model does not have");
  refused(
      [&] {
        step_into({.derivatives = {{"stress", {{"E", at::empty({points, 6, 6}, at::kDouble)}}}}});
      },
      "takes derivatives, but the step computes none");
  refused(
      [&] {
        step_into(
            {.derivatives = {{"stress", {{"strain", at::empty({points, 6, 6}, at::kDouble)}}}}},
            true);
      },
      "the block d(stress)/d(strain), which the artifact does not have");
  refused(
      [&] {
        step_into({.outputs = {{"stress", buffer.narrow(1, 0, 6)}},
                   .points = at::tensor(std::vector<std::int64_t>{0, points})});
      },
      "points run from 0 to 20");
  // Two outputs over the same columns: the model's own check, before anything runs.
  refused(
      [&] {
        step_into({.outputs = {{"stress", buffer.narrow(1, 0, 6)},
                               {"plastic_strain", buffer.narrow(1, 3, 6)}}});
      },
      "share memory");
  // The same with indices (results copied in): judged among the layout's destinations.
  const auto first = at::tensor(std::vector<std::int64_t>{0, 1, 2});
  refused(
      [&] {
        step_into({.outputs = {{"stress", buffer.narrow(0, 0, 3).narrow(1, 0, 6)},
                               {"plastic_strain", buffer.narrow(0, 0, 3).narrow(1, 3, 6)}},
                   .points = first});
      },
      "output 'plastic_strain' and output 'stress' share memory");
  // A broadcast destination, after one that fits; a negated view.
  refused(
      [&] {
        step_into({.outputs = {{"equivalent_plastic_strain", buffer.narrow(0, 0, 3).select(1, 0)},
                               {"stress", buffer.narrow(0, 0, 1).narrow(1, 6, 6).expand({3, 6})}},
                   .points = first});
      },
      "output 'stress' has elements that share memory");
  refused(
      [&] {
        step_into({.outputs = {{"stress", at::_neg_view(buffer.narrow(1, 6, 6))}}});
      },
      "output 'stress' is a lazy view");
  // The state's own start as the host's storage.
  refused(
      [&] {
        step_into({.outputs = {{"plastic_strain", state.start().at("plastic_strain")}}});
      },
      "shares memory with the state's own 'plastic_strain'");
  CHECK(untouched());
  REQUIRE(state.pending());
  CHECK(at::equal(state.start().at("plastic_strain"), at::zeros({points, 6}, at::kDouble)));
  state.accept();
  CHECK(at::equal(state.start().at("plastic_strain"), trial.at("plastic_strain")));
}

TEST_CASE("a model with a promoted parameter: its value seen by every step, each step the "
          "closed form's, and explicit models step as their forward()") {
  // -p residual.square.scaling: x' = a - s x^2, one backward-Euler step x + h s x^2 = x~1 + h a.
  auto model = load("scalar_backward_euler_params");
  const double s = 2.0, h = 0.1;
  model.set_parameter("residual.square.scaling", at::full({}, s, at::kDouble));
  const auto a = at::tensor({1.0, 2.0, 0.3}, at::kDouble);
  MaterialState state(model, 3, {{"x", at::full({}, 0.5)}});
  auto x = at::full({3}, 0.5, at::kDouble);
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const auto& r = state.step({{"a", a}}, at::full({3}, h * n, at::kDouble));
    x = (at::sqrt(1 + 4 * h * s * (x + h * a)) - 1) / (2 * h * s);
    test::check_close(r.outputs.at("x"), x, "closed form", 1e-8);
    state.accept();
    x = state.start().at("x");
  }

  // An explicit model: no state, a step is its forward().
  const test::Reference ref("elasticity");
  const auto elastic = load_model(test::stub("elasticity", "elasticity"));
  const auto strain = ref["b33/in/strain"];
  MaterialState points(elastic, strain.size(0));
  const auto& r = points.step({{"strain", strain}}, {.derivatives = true});
  const auto [out, J] = elastic.jacobian({{"strain", strain}});
  CHECK(test::identical(r.outputs, out));
  CHECK(at::equal(r.derivatives.at("stress").at("strain"),
                  J.at("stress").at("strain").expand_as(r.derivatives.at("stress").at("strain"))));
  CHECK(r.derivatives.at("stress").at("strain").size(0) == strain.size(0));
  points.accept();
  CHECK(points.start().empty());

  // Its block is one for every row (batch-independent): spread into the host's records.
  auto records = at::full({strain.size(0), 6 + 36}, 7.0, at::kDouble);
  const auto tangent = records.narrow(1, 6, 36).view({-1, 6, 6});
  const auto& into = points.step({{"strain", strain}},
                                 {.derivatives = true,
                                  .into = {.outputs = {{"stress", records.narrow(1, 0, 6)}},
                                           .derivatives = {{"stress", {{"strain", tangent}}}}}});
  CHECK(at::equal(records.narrow(1, 0, 6), out.at("stress")));
  CHECK(at::equal(tangent, J.at("stress").at("strain").expand_as(tangent)));
  CHECK(into.derivatives.at("stress").at("strain").is_same(tangent));
}

TEST_CASE("tensors once handed out (start(), a step's results) are never written again") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  MaterialState state(model, points);
  // Handles a host may keep, and their values when taken.
  std::vector<std::pair<at::Tensor, at::Tensor>> held;
  const auto hold = [&](const at::Tensor& t) { held.emplace_back(t, t.clone()); };
  auto records = at::empty({points, 6}, at::kDouble);
  for (int n = 0; n < 5; ++n) {
    const auto in = ref.group(step_name(n) + "/in");
    for (const auto& [name, t] : state.start())
      hold(t);
    const auto& r = n % 2 ? state.step({{"E", in.at("E")}}, in.at("t"))
                          : state.step({{"E", in.at("E")}}, in.at("t"),
                                       {.into = {.outputs = {{"plastic_strain", records}}}});
    for (const auto& [name, t] : r.outputs)
      if (!t.is_same(records))
        hold(t);
    // Every second step only some points move (a partial accept writes new tensors).
    n == 3 ? state.accept(at::arange(0, points, 2)) : state.accept();
  }
  for (std::size_t k = 0; k < held.size(); ++k) {
    CAPTURE(k);
    CHECK(at::equal(held[k].first, held[k].second));
  }
}

TEST_CASE("a force or given input in the same memory as a result the layout receives is read "
          "as given, also by the retry of failed points") {
  const ScalarCase c;
  const auto model = load("scalar_backward_euler");
  auto plain = scalar_state(model, c);
  auto shared = scalar_state(model, c);
  const auto& expected = plain.step({{"a", c.in.at("a")}}, c.in.at("t"), {.max_cuts = 3});
  // One column holds `a`, and receives x; another holds t, and receives dx/da.
  auto records = at::stack({c.in.at("a"), c.in.at("t")}, 1);
  const auto& r = shared.step({{"a", records.select(1, 0)}}, records.select(1, 1),
                              {.derivatives = true,
                               .max_cuts = 3,
                               .into = {.outputs = {{"x", records.select(1, 0)}},
                                        .derivatives = {{"x", {{"a", records.select(1, 1)}}}}}});
  CHECK(r.cut > 0);
  CHECK(at::equal(r.converged, expected.converged));
  CHECK(at::equal(r.substeps, expected.substeps));
  const auto ok = expected.converged;
  CHECK(at::equal(records.select(1, 0).index({ok}), expected.outputs.at("x").index({ok})));
  plain.accept();
  shared.accept();
  CHECK(test::identical(shared.start(), plain.start())); // t as given, not dx/da
}

TEST_CASE("a callback of the model that steps and accepts the same state meanwhile") {
  // The observer (called per chunk) steps the state again and accepts: the outer step runs
  // on the start it began with, then replaces the trial; nothing crashes or mixes.
  const test::Reference ref("j2_radial_return");
  auto model =
      load_model(test::stub("j2_radial_return", "model"), "model", SyncChunking{.batch_size = 8});
  const auto points = ref["s0/in/E"].size(0);
  const auto in = ref.group("s2/in");
  const auto other = ref.group("s4/in");
  MaterialState state(model, points);
  bool inside = false;
  model.set_observer([&](const ChunkEvent&) {
    if (inside)
      return;
    inside = true;
    state.step({{"E", other.at("E")}}, other.at("t"));
    state.accept();
  });
  const auto& r = state.step({{"E", in.at("E")}}, in.at("t"));
  model.set_observer({});
  MaterialState fresh(model, points);
  const auto& expected = fresh.step({{"E", in.at("E")}}, in.at("t"));
  CHECK(test::identical(r.outputs, expected.outputs));
  state.accept();
  for (const auto& x : state.roles().state)
    CHECK(at::equal(state.start().at(x), expected.outputs.at(x)));
}

TEST_CASE("a step lets go of the trial before it once its checks pass: two steps' results are "
          "never held at once, and a step that fails leaves no trial") {
  const test::Reference ref("j2_radial_return");
  auto model = load("j2_radial_return");
  const auto points = ref["s0/in/E"].size(0);
  const auto in = ref.group("s2/in");
  MaterialState state(model, points);
  const auto& first = state.step({{"E", in.at("E")}}, in.at("t"), {.derivatives = true});
  const c10::weak_intrusive_ptr<c10::TensorImpl> block(
      first.derivatives.at("stress").at("E").getIntrusivePtr());
  const auto start = clone(state.start());

  // Refused by its checks: the trial stays.
  CHECK_THROWS_AS(state.step({{"E", in.at("E").narrow(1, 0, 5)}}, in.at("t")), FatalError);
  CHECK(state.pending());
  CHECK_FALSE(block.expired());

  // While the next step evaluates, the first's blocks are gone; it fails (the observer
  // throws), and leaves no trial to accept and the start as it was.
  bool released = false;
  model.set_observer([&](const ChunkEvent&) {
    released = block.expired();
    throw std::runtime_error("host callback failed");
  });
  CHECK_THROWS_AS(state.step({{"E", in.at("E")}}, in.at("t"), {.derivatives = true}),
                  std::runtime_error);
  model.set_observer({});
  CHECK(released);
  CHECK_FALSE(state.pending());
  CHECK_THROWS_AS(state.accept(), FatalError);
  CHECK(test::identical(state.start(), start));
}

TEST_CASE("the start before is kept only for a state that extrapolates") {
  const test::Reference ref("perzyna_viscoplasticity");
  const auto model = load("perzyna_viscoplasticity");
  const auto points = ref["s0/in/E"].size(0);
  const auto in = ref.group("s2/in");
  for (bool extrapolate : {false, true}) {
    CAPTURE(extrapolate);
    MaterialState state(model, points);
    state.step({{"E", in.at("E")}}, in.at("t"), {.extrapolate = extrapolate});
    const c10::weak_intrusive_ptr<c10::TensorImpl> start(
        state.start().at("stress").getIntrusivePtr());
    state.accept();
    CHECK(start.expired() != extrapolate);
  }
}

TEST_CASE("extrapolate on a model that takes no state as Newton's guess is refused, the trial "
          "kept") {
  const test::Reference ref("j2_radial_return"); // its guess: flow_rate~1, not a state
  const auto model = load("j2_radial_return");
  MaterialState state(model, ref["s0/in/E"].size(0));
  const auto in = ref.group("s0/in");
  state.step({{"E", in.at("E")}}, in.at("t"));
  refused(
      [&] {
        state.step({{"E", in.at("E")}}, in.at("t"), {.extrapolate = true});
      },
      "extrapolate asked, but this model takes no input named after a state variable");
  CHECK(state.pending());
}

TEST_CASE("an explicit model's point with a non-finite input fails as non-finite, and accept() "
          "keeps its start") {
  const auto model = load_model(test::stub("rates", "eq"), "eq"); // forces a, b, c, t, each paired
  const test::Reference ref("rates");
  const auto in = ref.group("b7/in");
  const auto points = in.at("a").size(0);
  REQUIRE(points >= 4);
  TensorMap start, forces;
  for (const auto& f : {"a", "b", "c", "t"}) {
    start.emplace(f, in.at(std::string(f) + "~1"));
    forces.emplace(f, in.at(f).clone());
  }
  forces.at("a")[1] = std::numeric_limits<double>::quiet_NaN();
  forces.at("c")[3] = std::numeric_limits<double>::infinity();
  for (const bool into : {false, true}) {
    CAPTURE(into);
    MaterialState state(model, points, start);
    auto host = at::full({points}, 7.0, at::kDouble);
    const auto& r = state.step(
        forces, {.derivatives = true,
                 .into = into ? HostLayout{.outputs = {{"a_rate", host}}} : HostLayout{}});
    const auto bad = at::zeros({points}, at::kBool)
                         .index_fill_(0, at::tensor(std::vector<std::int64_t>{1, 3}), true);
    CHECK(r.failed == 2);
    CHECK(at::equal(r.converged, ~bad));
    CHECK(at::equal(r.reasons.index({bad}),
                    at::full({2}, static_cast<std::int8_t>(RowFailure::non_finite), at::kChar)));
    CHECK(at::equal(r.reasons.index({~bad}), at::zeros({points - 2}, at::kChar)));
    CHECK(at::isnan(r.residuals.index({bad})).all().item<bool>());
    // Failed points NaN, the others the raw graph's.
    TensorMap inputs = forces;
    for (const auto& [f, v] : start)
      inputs.emplace(f + "~1", v);
    const auto [expected, J] = model.jacobian(inputs);
    for (const auto& [y, value] : r.outputs) {
      CAPTURE(y);
      CHECK(at::isnan(value.index({bad})).all().item<bool>());
      CHECK(at::equal(value.index({~bad}), expected.at(y).index({~bad})));
    }
    CHECK(at::isnan(r.derivatives.at("a_rate").at("a").index({bad})).all().item<bool>());
    if (into)
      CHECK(r.outputs.at("a_rate").is_same(host));
    state.accept();
    CHECK(at::equal(state.start().at("a").index({bad}), start.at("a").index({bad})));
    CHECK(at::equal(state.start().at("c").index({bad}), start.at("c").index({bad})));
    CHECK(at::equal(state.start().at("a").index({~bad}), forces.at("a").index({~bad})));
  }
}

TEST_CASE("a failed point says why: did not converge (its last residual norm) or non-finite") {
  const ScalarCase c;
  const auto model = load("scalar_backward_euler");
  auto a = c.in.at("a").clone();
  const auto spans = c.ref["sub/spans"];
  const auto one = (spans == 1).nonzero().squeeze(1);
  REQUIRE(one.numel() > 0);
  const auto nan_point = one[0].item<std::int64_t>(); // converges when its input is finite
  a[nan_point] = std::numeric_limits<double>::quiet_NaN();
  // The model's own per-row error, as the reference for the norms.
  TensorMap inputs = c.in;
  inputs.at("a") = a;
  inputs.at("x") = c.in.at("x~1");
  std::optional<ConvergenceError> error;
  try {
    static_cast<void>(model.forward(inputs));
  } catch (const ConvergenceError& e) {
    error = e;
  }
  REQUIRE(error);
  REQUIRE(error->per_row());
  for (const int cuts : {0, 3}) {
    CAPTURE(cuts);
    auto state = scalar_state(model, c);
    const auto& r = state.step({{"a", a}}, c.in.at("t"), {.max_cuts = cuts});
    const auto failed = ~r.converged;
    CHECK(r.reasons[nan_point].item<std::int8_t>() ==
          static_cast<std::int8_t>(RowFailure::non_finite));
    CHECK(std::isnan(r.residuals[nan_point].item<double>()));
    CHECK(at::equal(r.reasons.index({r.converged}),
                    at::zeros({r.converged.sum().item<std::int64_t>()}, at::kChar)));
    CHECK(at::equal(r.residuals.index({r.converged}),
                    at::zeros_like(r.residuals.index({r.converged}))));
    const auto stuck =
        failed.logical_and(r.reasons != static_cast<std::int8_t>(RowFailure::non_finite));
    REQUIRE(stuck.any().item<bool>());
    CHECK((r.reasons.index({stuck}) != 0).all().item<bool>());
    if (cuts == 0) // the model's own call: the same reasons and norms
      for (const auto& [mine, its] : {std::pair{r.reasons, error->reasons()},
                                      std::pair{r.residuals, error->residual_norms()}})
        CHECK(at::equal(at::nan_to_num(mine.to(at::kDouble), -1.0),
                        at::nan_to_num(its.to(at::kDouble), -1.0)));
    else // a point failed at the deepest cut: a finite norm above the tolerance, or NaN
      CHECK(((r.residuals.index({stuck}) > 1e-10) | at::isnan(r.residuals.index({stuck})))
                .all()
                .item<bool>());
  }
}

TEST_CASE("a cut interpolates a given input from its last accepted value") {
  const ScalarCase c; // `a` is a given input: the model has no a~1
  const auto model = load("scalar_backward_euler");
  const auto a1 = c.in.at("a");
  const auto a0 = a1 * 0.5;
  MaterialState state(model, c.rows, {{"x", c.in.at("x~1")}, {"t", c.in.at("t~1")}, {"a", a0}});
  const auto& r = state.step({{"a", a1}}, c.in.at("t"), {.max_cuts = 3});
  // A point cut once: its two halves by hand, `a` and `t` halfway at the first's end.
  const auto once = (r.substeps == 2).nonzero().squeeze(1);
  REQUIRE(once.numel() > 0);
  const auto pick = [&](const at::Tensor& t) { return t.index_select(0, once); };
  const auto t0 = pick(c.in.at("t~1")), t1 = pick(c.in.at("t"));
  MaterialState halves(model, once.size(0), {{"x", pick(c.in.at("x~1"))}, {"t", t0}});
  const auto& h1 =
      halves.step({{"a", pick(a0) + (pick(a1) - pick(a0)) * 0.5}}, t0 + (t1 - t0) * 0.5);
  REQUIRE(h1.failed == 0);
  halves.accept();
  const auto& h2 = halves.step({{"a", pick(a1)}}, t1);
  REQUIRE(h2.failed == 0);
  test::check_close(pick(r.outputs.at("x")), h2.outputs.at("x"), "two half steps by hand", 1e-12);

  // Without a value the state keeps (no initial, nothing accepted yet): held at the step's.
  auto held = scalar_state(model, c);
  const auto& rh = held.step({{"a", a1}}, c.in.at("t"), {.max_cuts = 3});
  CHECK(at::equal(rh.substeps, c.ref["sub/spans"].to(at::kLong)));
}

TEST_CASE("a state two steps deep (NEML2's LinearExtrapolationPredictor): x~2 and t~2 kept, as a "
          "hand-written loop and eager NEML2") {
  const test::Reference ref("scalar_backward_euler"); // the same model, a constant guess
  const auto model = load("scalar_linear_predictor");
  const auto roles = state_roles(model);
  CHECK(roles.state == std::vector<std::string>{"x"});
  CHECK(roles.forces == std::vector<std::string>{"t"});
  CHECK(roles.given == std::vector<std::string>{"a"});
  CHECK(roles.fixed.empty());
  CHECK(roles.depth == std::map<std::string, int>{{"t", 2}, {"x", 2}});
  const auto first = ref.group("s0/in");
  const auto points = first.at("a").size(0);
  MaterialState state(model, points, {{"x", first.at("x~1")}, {"t", first.at("t~1")}});
  // By hand: before the first step, the older values are the initial ones.
  at::Tensor x1 = first.at("x~1"), x2 = x1, t1 = first.at("t~1"), t2 = t1;
  for (int n = 0; n < 4; ++n) {
    CAPTURE(n);
    const auto in = ref.group(step_name(n) + "/in");
    const auto& r = state.step({{"a", in.at("a")}}, in.at("t"), {.derivatives = true});
    REQUIRE(r.failed == 0);
    const auto [out, J] = model.jacobian(
        {{"a", in.at("a")}, {"x~1", x1}, {"x~2", x2}, {"t", in.at("t")}, {"t~1", t1}, {"t~2", t2}});
    CHECK(test::identical(r.outputs, out));
    CHECK(at::equal(r.derivatives.at("x").at("x~2"), J.at("x").at("x~2")));
    test::check_close(r.outputs, ref.group(step_name(n) + "/out"), "eager NEML2", 1e-8);
    state.accept();
    x2 = x1;
    x1 = out.at("x");
    t2 = t1;
    t1 = in.at("t");
  }
}

TEST_CASE("a state two steps deep cuts its points as one step deep does, to Newton's "
          "tolerance") {
  const ScalarCase c;
  const auto deep = load("scalar_linear_predictor");
  auto state = scalar_state(deep, c);
  const auto& r = state.step({{"a", c.in.at("a")}}, c.in.at("t"), {.max_cuts = 3});
  const auto converged = c.ref["sub/spans"] > 0;
  CHECK(at::equal(r.converged, converged));
  test::check_close(r.outputs.at("x").index({converged}), c.ref["sub/out/x"].index({converged}),
                    "eager spans", 1e-8);
}

TEST_CASE("a step over a subset of points: forces and start gathered by its indices, results and "
          "accept scattered by them, the other points untouched") {
  const test::Reference ref("j2_radial_return");
  const auto model = load("j2_radial_return");
  const auto s0 = ref.group("s0/in"), s1 = ref.group("s1/in");
  const auto points = s0.at("E").size(0);
  MaterialState whole(model, points), part(model, points);
  for (auto* state : {&whole, &part}) {
    state->step({{"E", s0.at("E")}}, s0.at("t"));
    state->accept();
  }
  const auto idx = at::tensor(std::vector<std::int64_t>{7, 2, 11});
  const auto pick = [&](const at::Tensor& t) { return t.index_select(0, idx); };
  const auto before = whole.start();
  const auto& rw = whole.step({{"E", s1.at("E")}}, s1.at("t"));
  auto stress = at::full({3, 6}, 7.0, at::kDouble);
  const auto& rp = part.step({{"E", pick(s1.at("E"))}}, pick(s1.at("t")),
                             {.into = {.outputs = {{"stress", stress}}}, .points = idx});
  CHECK(rp.outputs.at("stress").is_same(stress));
  for (const auto& [y, value] : rw.outputs) {
    CAPTURE(y);
    test::check_close(rp.outputs.at(y), pick(value), "the whole step's rows", 1e-12);
  }
  CHECK(rp.converged.size(0) == 3);
  part.accept();
  const auto others = at::ones({points}, at::kBool).index_fill_(0, idx, false);
  for (const auto& x : part.roles().state) {
    CAPTURE(x);
    CHECK(at::equal(pick(part.start().at(x)), rp.outputs.at(x)));
    CHECK(at::equal(part.start().at(x).index({others}), before.at(x).index({others})));
  }
  CHECK(at::equal(pick(part.start().at("t")), pick(s1.at("t"))));
  CHECK(at::equal(part.start().at("t").index({others}), before.at("t").index({others})));

  // accept(points) names state points: one outside the step is refused.
  const auto s2 = ref.group("s2/in");
  REQUIRE(part.step({{"E", pick(s2.at("E"))}}, pick(s2.at("t")), {.points = idx}).failed == 0);
  refused([&] { part.accept(at::tensor(std::vector<std::int64_t>{0})); },
          "point 0 was not among this step's points");
  part.accept(at::tensor(std::vector<std::int64_t>{11}));
  CHECK_FALSE(part.pending());
  // Bad points: refused before anything runs.
  const auto bad = [&](const at::Tensor& p, const std::string& part_of_message) {
    refused(
        [&] {
          part.step({{"E", s1.at("E").narrow(0, 0, p.numel())}}, s1.at("t").narrow(0, 0, p.numel()),
                    {.points = p});
        },
        part_of_message);
  };
  bad(at::tensor(std::vector<std::int64_t>{3, 1, 3}), "name point 3 more than once");
  bad(at::tensor(std::vector<std::int64_t>{1, points}), "run from 1 to 20");
  bad(at::tensor(std::vector<std::int32_t>{1}), "pass 1-d int64 indices");
}

TEST_CASE("a step over a subset of points cuts them as the whole step does") {
  const ScalarCase c;
  const auto model = load("scalar_backward_euler");
  auto whole = scalar_state(model, c);
  auto part = scalar_state(model, c);
  const auto& rw = whole.step({{"a", c.in.at("a")}}, c.in.at("t"), {.max_cuts = 3});
  const auto idx = at::flip((rw.substeps != 1).nonzero().squeeze(1), {0}); // cut or failed
  REQUIRE(idx.numel() > 1);
  const auto& rp = part.step({{"a", c.in.at("a").index_select(0, idx)}},
                             c.in.at("t").index_select(0, idx), {.max_cuts = 3, .points = idx});
  CHECK(at::equal(rp.substeps, rw.substeps.index_select(0, idx)));
  CHECK(at::equal(rp.converged, rw.converged.index_select(0, idx)));
  CHECK(at::equal(rp.reasons, rw.reasons.index_select(0, idx)));
  const auto ok = rp.converged;
  REQUIRE(ok.any().item<bool>());
  test::check_close(rp.outputs.at("x").index({ok}),
                    rw.outputs.at("x").index_select(0, idx).index({ok}), "whole step", 1e-12);
}

TEST_CASE("a state two steps deep: a partial accept moves x~2 for the accepted points only, and "
          "a cut point's spans see the span before as theirs") {
  const auto model = load("scalar_linear_predictor");
  const test::Reference ref("scalar_backward_euler");
  const auto s0 = ref.group("s0/in"), s1 = ref.group("s1/in"), s2 = ref.group("s2/in");
  const auto points = s0.at("a").size(0);
  REQUIRE(points >= 2);
  const auto x0 = s0.at("x~1"), t0 = s0.at("t~1");
  // The values a step before the start: far enough off for the guess to change the bits.
  const auto x_older = x0 - 3.0, t_older = t0 - 0.01;
  MaterialState state(model, points, {{"x", x0}, {"t", t0}, {"x~2", x_older}, {"t~2", t_older}});
  const auto& r0 = state.step({{"a", s0.at("a")}}, s0.at("t"));
  REQUIRE(r0.failed == 0);
  const auto x1 = r0.outputs.at("x").clone();
  const auto even = at::arange(points, at::kLong).remainder(2) == 0;
  state.accept(even);
  // By hand: the accepted points one step on, the others where they were.
  const auto pick = [&](const at::Tensor& moved, const at::Tensor& stayed) {
    return at::where(even, moved, stayed);
  };
  const TensorMap by_hand{{"a", s1.at("a")},
                          {"t", s1.at("t")},
                          {"x~1", pick(x1, x0)},
                          {"x~2", pick(x0, x_older)},
                          {"t~1", pick(s0.at("t"), t0)},
                          {"t~2", pick(t0, t_older)}};
  const auto& r1 = state.step({{"a", s1.at("a")}}, s1.at("t"));
  CHECK(test::identical(r1.outputs, model.forward(by_hand)));
  auto every_point_moved = by_hand; // what a shift of every point's x~2 would give
  every_point_moved.at("x~2") = x0;
  every_point_moved.at("t~2") = t0;
  REQUIRE_FALSE(test::identical(r1.outputs, model.forward(every_point_moved)));

  // A cut point's second span: x~1 and t~1 where its first span ended, x~2 and t~2 where
  // it began (the step's start); the first span's x~2 and t~2 the step's, given here.
  const ScalarCase c;
  const auto x_before = c.in.at("x~1") * 0.5, t_before = c.in.at("t~1") - 1.0;
  MaterialState cut(
      model, c.rows,
      {{"x", c.in.at("x~1")}, {"t", c.in.at("t~1")}, {"x~2", x_before}, {"t~2", t_before}});
  const auto& rc = cut.step({{"a", c.in.at("a")}}, c.in.at("t"), {.max_cuts = 3});
  const auto once = (rc.substeps == 2).nonzero().squeeze(1);
  REQUIRE(once.numel() > 0);
  const auto at_once = [&](const at::Tensor& t) { return t.index_select(0, once); };
  const auto xa = at_once(c.in.at("x~1")), ta = at_once(c.in.at("t~1")), tb = at_once(c.in.at("t")),
             a = at_once(c.in.at("a"));
  const auto tm = ta + (tb - ta) * 0.5;
  const auto first = model.forward({{"a", a},
                                    {"t", tm},
                                    {"x~1", xa},
                                    {"x~2", at_once(x_before)},
                                    {"t~1", ta},
                                    {"t~2", at_once(t_before)}});
  const auto second = model.forward(
      {{"a", a}, {"t", tb}, {"x~1", first.at("x")}, {"x~2", xa}, {"t~1", tm}, {"t~2", ta}});
  test::check_close(at_once(rc.outputs.at("x")), second.at("x"), "two spans by hand", 1e-12);
}
