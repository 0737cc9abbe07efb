// Implicit models: Newton per row over compiled segments, against eager NEML2 solving each
// row on its own; results independent of the rows around them; per-row failures.

#include <limits>

#include "model_checks.hpp"

using namespace neml2;
using test::contains;

namespace {

// name -> (model block, steps in its reference history)
struct Case {
  const char* artifact;
  int steps;
};
constexpr Case implicit_models[] = {{"scalar_backward_euler", 4},
                                    {"j2_radial_return", 5},
                                    {"perzyna_viscoplasticity", 5},
                                    {"chaboche_viscoplasticity", 5}};

Session session(const std::string& artifact) {
  return {std::make_shared<const Artifact>(
              read_artifact(resolve_artifact_root(test::stub(artifact, "model"), "model"))),
          "cpu"};
}

std::string step(int s) {
  return "s" + std::to_string(s);
}

TensorMap rows_of(const TensorMap& values, const at::Tensor& index) {
  TensorMap out;
  for (const auto& [name, t] : values)
    out.emplace(name, t.index_select(0, index));
  return out;
}

// The scalar model's inputs: x' = a - x^2 from x~1 = 0.5 over dt = 0.1, one row per `a`.
TensorMap scalar_inputs(std::vector<double> a) {
  const auto rows = static_cast<std::int64_t>(a.size());
  const auto filled = [&](double v) { return at::full({rows}, v, at::kDouble); };
  return {{"a", at::tensor(a, at::kDouble)},
          {"x", filled(0.5)},
          {"x~1", filled(0.5)},
          {"t", filled(0.1)},
          {"t~1", filled(0.0)}};
}

at::Tensor mask(std::initializer_list<int> values) {
  return at::tensor(std::vector<int>(values), at::kInt).to(at::kBool);
}

// Relative to the block's size, with a floor: a derivative that is zero in exact
// arithmetic (J2's rate independence: d/dt) is roundoff on both sides.
void check_block(const at::Tensor& actual, const at::Tensor& expected, const std::string& what,
                 double floor) {
  INFO(what);
  REQUIRE(actual.sizes() == expected.sizes());
  const auto scale = std::max(expected.abs().max().item<double>(), floor);
  const auto error = (actual - expected).abs().max().item<double>() / scale;
  CHECK_MESSAGE(error <= 1e-8, "relative error " << error);
}

ConvergenceError convergence_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ConvergenceError& e) {
    return e;
  }
  FAIL("expected a ConvergenceError");
  throw std::logic_error("unreachable");
}

} // namespace

TEST_CASE("implicit artifacts: segments, graphs, groups and the solver settings") {
  const auto a =
      read_artifact(resolve_artifact_root(test::stub("j2_radial_return", "model"), "model"));
  REQUIRE(a.segments.size() == 3);
  CHECK(std::holds_alternative<ForwardSegment>(a.segments[0]));
  CHECK(std::holds_alternative<ForwardSegment>(a.segments[2]));
  const auto& s = std::get<ImplicitSegment>(a.segments[1]);
  CHECK(s.residual_package == "model_seg1_residual.pt2");
  CHECK(s.solve_package == "model_seg1_solve.pt2");
  CHECK(s.predictor_package == "model_seg1_predictor.pt2");
  CHECK(s.predictor_inputs == std::vector<std::string>{"flow_rate~1"});
  CHECK(s.predictor_outputs == std::vector<std::string>{"flow_rate"});
  REQUIRE(s.unknowns.size() == 1);
  CHECK(s.unknowns[0].name == "flow_rate");
  REQUIRE(s.given_groups.size() == 1);
  CHECK(s.given_groups[0].names.size() == s.givens.size());
  CHECK(s.jacobian_pairs.size() == s.givens.size());
  CHECK(s.jacobian_pairs[1].col_offset == 6); // after NM (6 values)
  REQUIRE(a.solver_config);
  CHECK(a.solver_config->miters == 25);
  CHECK(a.solver_config->atol == 1e-10);
  CHECK(a.solver_config->rtol == 1e-8);
  CHECK(a.solver_config->ls_max_iters == 1);
  CHECK(!a.derivatives.empty());
  CHECK_FALSE(a.single_forward());
}

TEST_CASE("every step of every history against eager NEML2, row by row") {
  for (const auto& c : implicit_models) {
    CAPTURE(c.artifact);
    const auto s = session(c.artifact);
    const test::Reference ref(c.artifact);
    for (int n = 0; n < c.steps; ++n)
      test::check_forward(s, ref, step(n), 1e-8);
  }
}

TEST_CASE("Jacobians and jvp through implicit segments against eager NEML2") {
  for (const auto& c : implicit_models) {
    CAPTURE(c.artifact);
    const auto s = session(c.artifact);
    const test::Reference ref(c.artifact);
    for (int n = 1; n < c.steps; ++n) {
      const auto inputs = ref.group(step(n) + "/in");
      const auto [out, J] = s.jacobian(inputs);
      test::check_close(out, ref.group(step(n) + "/out"), step(n) + " outputs", 1e-8);
      for (const auto& o : s.output_names()) {
        // The floor under the relative error: 1e-4 of this output's largest block.
        double largest = 0;
        for (const auto& i : s.input_names())
          largest =
              std::max(largest, ref[step(n) + "/jac/" + o + "/" + i].abs().max().item<double>());
        for (const auto& i : s.input_names()) {
          const auto& expected = ref[step(n) + "/jac/" + o + "/" + i];
          // Eager blocks are zero-sized or zero where nothing flows (the initial guess).
          if (!J.count(o) || !J.at(o).count(i)) {
            CHECK_MESSAGE(expected.abs().max().item<double>() == 0, o << "/" << i);
            continue;
          }
          check_block(J.at(o).at(i), expected, step(n) + " d" + o + "/d" + i, 1e-4 * largest);
        }
      }

      // jvp along a tangent on every input = the blocks contracted with it.
      TensorMap tangents;
      for (const auto& [name, x] : inputs)
        tangents.emplace(name, at::rand_like(x) - 0.5);
      const auto [values, dout] = s.jvp(inputs, tangents);
      for (const auto& o : s.output_names()) {
        auto expected = at::zeros_like(values.at(o));
        for (const auto& [i, t] : tangents) {
          const auto& block = ref[step(n) + "/jac/" + o + "/" + i];
          const auto rows = t.size(0);
          expected += at::matmul(block.reshape({rows, values.at(o).numel() / rows, -1}),
                                 t.reshape({rows, -1, 1}))
                          .reshape(expected.sizes());
        }
        test::check_close(dout.at(o), expected, step(n) + " jvp " + o, 1e-8);
      }
    }
  }
}

TEST_CASE("chunk sizes 1, 3, 7 and the whole batch give the same rows (1e-13)") {
  for (const auto& c : implicit_models) {
    CAPTURE(c.artifact);
    const test::Reference ref(c.artifact);
    const auto inputs = ref.group(step(c.steps - 1) + "/in");
    const auto whole = session(c.artifact).forward(inputs);
    for (std::int64_t rows : {1, 3, 7, 0}) {
      CAPTURE(rows);
      const auto m = load_model(test::stub(c.artifact, "model"), "model",
                                SyncChunking{.device = "cpu", .batch_size = rows});
      test::check_close(m.forward(inputs), whole, "chunked", 1e-13);
    }
  }
}

TEST_CASE("a row's result does not depend on the rows beside it") {
  // The last step of J2: the first rows are elastic (converged before any update), the
  // last far past yield (the most iterations).
  const test::Reference ref("j2_radial_return");
  const auto inputs = ref.group("s4/in");
  const auto rows = inputs.at("E").size(0);
  auto s = session("j2_radial_return");
  const auto together = s.forward(inputs);
  // Each row alone, and an easy row beside the hardest ones.
  for (std::int64_t r : {std::int64_t{0}, rows / 2, rows - 1}) {
    CAPTURE(r);
    const auto alone = s.forward(rows_of(inputs, at::tensor({r}, at::kLong)));
    const auto with_hard =
        s.forward(rows_of(inputs, at::tensor({rows - 1, r, rows - 2}, at::kLong)));
    for (const auto& [name, value] : together) {
      test::check_close(alone.at(name), value.narrow(0, r, 1), "alone " + name, 1e-13);
      test::check_close(with_hard.at(name).narrow(0, 1, 1), value.narrow(0, r, 1),
                        "beside hard rows " + name, 1e-13);
    }
  }
  // The active set changes which rows the graphs see, never the numbers: never compacting
  // (every row evaluated to the end, masked), and compacting at every convergence.
  for (double compact_below : {0.0, 1.0}) {
    CAPTURE(compact_below);
    auto config = s.solver_config();
    config.compact_below = compact_below;
    s.set_solver_config(config);
    test::check_close(s.forward(inputs), together, "compaction", 1e-13);
  }
}

TEST_CASE("per-row failure: the mask, the worst residual and the converged rows") {
  const auto s = session("scalar_backward_euler");
  const std::vector<double> a = {1.0, -50.0, 2.0, std::numeric_limits<double>::quiet_NaN(), 0.3};
  const auto good = at::tensor({0, 2, 4}, at::kLong);
  const auto expected = s.forward(rows_of(scalar_inputs(a), good)).at("x");

  SUBCASE("no root for one row (iteration cap), NaN in another") {
    const auto e = convergence_error([&] { static_cast<void>(s.forward(scalar_inputs(a))); });
    CHECK(e.recoverable());
    REQUIRE(e.per_row());
    CHECK(at::equal(e.converged_mask(), mask({1, 0, 1, 0, 1})));
    CHECK(e.failed_rows() == 2);
    CHECK(std::isnan(e.worst_residual())); // one failed row was not finite
    CHECK(contains(e.what(), "2 of 5 rows"));
    const auto& x = e.outputs().at("x");
    test::check_close(x.index_select(0, good), expected, "converged rows", 1e-13);
    CHECK(at::isnan(x.index_select(0, at::tensor({1, 3}, at::kLong))).all().item<bool>());
    REQUIRE(e.results().size() == 1);
    CHECK(at::equal(e.results()[0].index_select(0, good), x.index_select(0, good)));
  }
  SUBCASE("a finite failure reports its residual norm") {
    const auto e = convergence_error([&] {
      static_cast<void>(s.forward(scalar_inputs({1.0, -50.0, 2.0})));
    });
    CHECK(e.failed_rows() == 1);
    CHECK(std::isfinite(e.worst_residual()));
    CHECK(e.worst_residual() > 1e-10);
  }
  SUBCASE("through jacobian(): the blocks of failed rows are NaN, the others right") {
    const auto e = convergence_error([&] { static_cast<void>(s.jacobian(scalar_inputs(a))); });
    CHECK(e.failed_rows() == 2);
    const auto [out, J] = s.jacobian(rows_of(scalar_inputs(a), good));
    const auto& dx_dt_old = e.results().back(); // the last block: d x / d t~1
    CHECK(at::isnan(dx_dt_old.index_select(0, at::tensor({1, 3}, at::kLong))).all().item<bool>());
    test::check_close(dx_dt_old.index_select(0, good), J.at("x").at("t~1"), "converged blocks",
                      1e-13);
  }
}

TEST_CASE("miters = 1 allows no update: only rows converged at the start pass") {
  const test::Reference ref("j2_radial_return");
  const auto inputs = ref.group("s4/in");
  auto s = session("j2_radial_return");
  auto config = s.solver_config();
  config.miters = 1;
  s.set_solver_config(config);
  const auto e = convergence_error([&] { static_cast<void>(s.forward(inputs)); });
  const auto elastic = ref["s4/out/equivalent_plastic_strain"] == 0;
  REQUIRE(elastic.any().item<bool>());
  REQUIRE_FALSE(elastic.all().item<bool>());
  CHECK(at::equal(e.converged_mask(), elastic));
  for (const auto& [name, value] : ref.group("s4/out"))
    test::check_close(e.outputs().at(name).index({elastic}), value.index({elastic}),
                      "elastic rows " + name, 1e-8);
}

TEST_CASE("a huge strain increment fails only the rows that got it") {
  const test::Reference ref("perzyna_viscoplasticity");
  auto inputs = ref.group("s2/in");
  auto s = session("perzyna_viscoplasticity");
  const auto normal = s.forward(inputs);
  inputs["E"] = inputs["E"].clone();
  inputs["E"][3] *= 1e3;
  auto config = s.solver_config();
  config.miters = 6;
  s.set_solver_config(config);
  const auto e = convergence_error([&] { static_cast<void>(s.forward(inputs)); });
  auto expected_mask = at::ones({inputs["E"].size(0)}, at::kBool);
  expected_mask[3] = false;
  CHECK(at::equal(e.converged_mask(), expected_mask));
  for (const auto& [name, value] : normal)
    test::check_close(e.outputs().at(name).index({expected_mask}), value.index({expected_mask}),
                      "other rows " + name, 1e-13);
}

TEST_CASE("solver settings: read, changed, checked") {
  auto s = session("scalar_backward_euler");
  auto config = s.solver_config();
  CHECK(config.solver_kind == "direct");
  config.miters = 0;
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }), "miters is 0"));
  config.miters = 25;
  config.ls_max_iters = 4;
  config.ls_type = "STRONG_WOLFE";
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }),
                 "only BACKTRACKING line search runs here"));
  config.ls_type = "BACKTRACKING";
  config.ls_max_iters = 1;
  config.rtol = -1;
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }), "rtol"));

  // A forward model has nothing to configure.
  const Session forward(std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(
                            test::stub("elasticity", "elasticity"), "elasticity"))),
                        "cpu");
  CHECK(contains(test::fatal_message([&] { static_cast<void>(forward.solver_config()); }),
                 "no implicit segment"));
}

TEST_CASE("a promoted parameter inside the residual: one stored value for every row") {
  // -p residual.square.scaling -d x:residual.square.scaling: x' = a - s x^2.
  auto s = session("scalar_backward_euler_params");
  REQUIRE(s.named_parameters().count("residual.square.scaling"));
  const double scaling = 2.0, dt = 0.1, x_old = 0.5;
  s.set_parameter("residual.square.scaling", at::full({}, scaling, at::kDouble));
  const auto inputs = scalar_inputs({1.0, 2.0, 0.3});
  // The positive root of x + dt s x^2 = x~1 + dt a.
  const auto expected =
      (at::sqrt(1 + 4 * dt * scaling * (x_old + dt * inputs.at("a"))) - 1) / (2 * dt * scaling);
  test::check_close(s.forward(inputs).at("x"), expected, "analytic x", 1e-8);

  s.set_parameter("residual.square.scaling", at::full({3}, scaling, at::kDouble));
  CHECK(contains(test::fatal_message([&] { static_cast<void>(s.forward(inputs)); }),
                 "has one value per row, but an implicit segment"));
  s.set_parameter("residual.square.scaling", at::full({}, scaling, at::kDouble));
  CHECK(contains(test::fatal_message([&] { static_cast<void>(s.param_jacobian(inputs)); }),
                 "parameter derivatives of a composed (multi-segment or implicit) model are not "
                 "supported"));
}

TEST_CASE("backtracking line search, per row: the same solutions, rows still independent") {
  for (const char* artifact : {"perzyna_viscoplasticity", "chaboche_viscoplasticity"}) {
    CAPTURE(artifact);
    const test::Reference ref(artifact);
    const auto inputs = ref.group("s4/in");
    auto s = session(artifact);
    auto config = s.solver_config();
    config.ls_max_iters = 10;
    config.ls_c = 1e-3;
    s.set_solver_config(config);
    const auto together = s.forward(inputs);
    test::check_close(together, ref.group("s4/out"), "with line search", 1e-8);
    const auto last = inputs.at("E").size(0) - 1;
    const auto alone = s.forward(rows_of(inputs, at::tensor({last}, at::kLong)));
    for (const auto& [name, value] : together)
      test::check_close(alone.at(name), value.narrow(0, last, 1), "alone " + name, 1e-13);
  }
}
