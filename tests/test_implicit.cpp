// Implicit models: Newton per row over compiled segments, against eager NEML2 solving each
// row on its own; results independent of the rows around them; per-row failures.

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <ATen/Parallel.h>
#include <c10/util/ScopeExit.h>
#include <unistd.h>

#include "graph/graph_calls.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "planned_newton.hpp"
#include "scalar_model.hpp"

using namespace neml2;
using test::contains;
using test::convergence_error;
using test::scalar_bisected;
using test::scalar_inputs;
using test::scalar_root;
using test::session;
using test::step_name;

namespace {

// name -> (model block, steps in its reference history)
struct Case {
  const char* artifact;
  int steps;
};
constexpr Case implicit_models[] = {{"scalar_backward_euler", 4},
                                    {"j2_radial_return", 5},
                                    {"perzyna_viscoplasticity", 5},
                                    {"chaboche_viscoplasticity", 5},
                                    {"gtn_viscoplasticity", 5}};

TensorMap rows_of(const TensorMap& values, const at::Tensor& index) {
  TensorMap out;
  for (const auto& [name, t] : values)
    out.emplace(name, t.index_select(0, index));
  return out;
}

at::Tensor mask_of(std::initializer_list<int> values) {
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

// The forward outputs and the converged mask, whether the call converged everywhere or not.
template <class Model>
std::pair<TensorMap, at::Tensor> forward_rows(const Model& m, const TensorMap& inputs) {
  try {
    auto out = m.forward(inputs);
    return {out, at::ones({inputs.begin()->second.size(0)}, at::kBool)};
  } catch (const ConvergenceError& e) {
    return {e.outputs(), e.converged_mask()};
  }
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
      test::check_forward(s, ref, step_name(n), 1e-8);
  }
}

TEST_CASE("Jacobians and jvp through implicit segments against eager NEML2") {
  for (const auto& c : implicit_models) {
    CAPTURE(c.artifact);
    const auto s = session(c.artifact);
    const test::Reference ref(c.artifact);
    for (int n = 1; n < c.steps; ++n) {
      const auto inputs = ref.group(step_name(n) + "/in");
      const auto [out, J] = s.jacobian(inputs);
      test::check_close(out, ref.group(step_name(n) + "/out"), step_name(n) + " outputs", 1e-8);
      for (const auto& o : s.output_names()) {
        // The floor under the relative error: 1e-4 of this output's largest block.
        double largest = 0;
        for (const auto& i : s.input_names())
          largest = std::max(largest,
                             ref[step_name(n) + "/jac/" + o + "/" + i].abs().max().item<double>());
        for (const auto& i : s.input_names()) {
          const auto& expected = ref[step_name(n) + "/jac/" + o + "/" + i];
          // Eager blocks are zero-sized or zero where nothing flows (the initial guess).
          if (!J.count(o) || !J.at(o).count(i)) {
            CHECK_MESSAGE(expected.abs().max().item<double>() == 0, o << "/" << i);
            continue;
          }
          check_block(J.at(o).at(i), expected, step_name(n) + " d" + o + "/d" + i, 1e-4 * largest);
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
          const auto& block = ref[step_name(n) + "/jac/" + o + "/" + i];
          const auto rows = t.size(0);
          expected += at::matmul(block.reshape({rows, values.at(o).numel() / rows, -1}),
                                 t.reshape({rows, -1, 1}))
                          .reshape(expected.sizes());
        }
        test::check_close(dout.at(o), expected, step_name(n) + " jvp " + o, 1e-8);
      }
    }
  }
}

TEST_CASE("chunk sizes 1, 3, 7 and the whole batch give the same rows (1e-13)") {
  for (const auto& c : implicit_models) {
    CAPTURE(c.artifact);
    const test::Reference ref(c.artifact);
    const auto inputs = ref.group(step_name(c.steps - 1) + "/in");
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
    CHECK(at::equal(e.converged_mask(), mask_of({1, 0, 1, 0, 1})));
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

TEST_CASE("a row converged where dR/du is singular: its derivatives are reported failed, "
          "never returned as inf or NaN") {
  // r = x - x~1 - (a - x^2)(t - t~1): with x = -0.5 (the start), x~1 = 0, a = -0.25 and a
  // step of 1, r = 0 and dr/dx = 1 + 2 x = 0 exactly: converged at once, singular there.
  const auto s = session("scalar_backward_euler");
  const TensorMap in = {{"a", at::tensor({-0.25, 1.0}, at::kDouble)},
                        {"x", at::tensor({-0.5, 0.5}, at::kDouble)},
                        {"x~1", at::tensor({0.0, 0.5}, at::kDouble)},
                        {"t", at::tensor({1.0, 0.1}, at::kDouble)},
                        {"t~1", at::tensor({0.0, 0.0}, at::kDouble)}};
  const auto forward = s.forward(in).at("x"); // the values are fine
  CHECK(at::isfinite(forward).all().item<bool>());
  const auto regular = at::tensor({1}, at::kLong);
  const auto [out, J] = s.jacobian(rows_of(in, regular));
  const auto e = convergence_error([&] { static_cast<void>(s.jacobian(in)); });
  REQUIRE(e.per_row());
  CHECK(at::equal(e.converged_mask(), mask_of({0, 1})));
  CHECK(contains(e.what(), "1 of them converged to a point where the results are not finite"));
  for (const auto& block : e.results()) { // the regular row kept, the singular one NaN
    CHECK(std::isnan(block[0].reshape({-1})[0].item<double>()));
    CHECK(at::isfinite(block[1]).all().item<bool>());
  }
  test::check_close(e.results().back().index_select(0, regular), J.at("x").at("t~1"),
                    "the regular row's block", 1e-13);
  // Through a DispatchedModel, in chunks of one row: the same mask over the batch.
  const auto m = load_model(test::stub("scalar_backward_euler", "model"), "model",
                            SyncChunking{.batch_size = 1});
  const auto through = convergence_error([&] { static_cast<void>(m.jacobian(in)); });
  CHECK(at::equal(through.converged_mask(), mask_of({0, 1})));
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
  config.ls_type = "MORE_THUENTE";
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }),
                 "ls_type is 'MORE_THUENTE'; it must be BACKTRACKING or STRONG_WOLFE"));
  config.ls_type = "STRONG_WOLFE";
  CHECK_NOTHROW(s.set_solver_config(config));
  config.substep_del_tol = -1;
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }),
                 "substep_del_tol is -1; it must be >= 0"));
  config.substep_del_tol = 1e-6;
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
  // dx/ds = -dt x^2 / (1 + 2 dt s x), the implicit function theorem by hand.
  const auto [out, P] = s.param_jacobian(inputs);
  const auto& x = out.at("x");
  test::check_close(P.at("x").at("residual.square.scaling"),
                    -dt * x * x / (1 + 2 * dt * scaling * x), "dx/ds", 1e-10);

  // param_vjp: the cotangents contracted with that Jacobian, summed over rows (the
  // parameter is unbatched), through chunks too; a missing cotangent counts as zero.
  const auto cotangent = at::tensor({0.3, -1.2, 0.7}, at::kDouble);
  const auto contracted = (cotangent * P.at("x").at("residual.square.scaling")).sum();
  const auto grads = s.param_vjp(inputs, {{"x", cotangent}});
  REQUIRE(grads.size() == 1);
  test::check_close(grads.at("residual.square.scaling"), contracted, "param_vjp", 1e-13);
  test::check_close(grads.at("residual.square.scaling"),
                    (cotangent * -dt * x * x / (1 + 2 * dt * scaling * x)).sum(),
                    "param_vjp by hand", 1e-10);
  CHECK(s.param_vjp(inputs, {}).at("residual.square.scaling").item<double>() == 0);
  auto chunked = load_model(test::stub("scalar_backward_euler_params", "model"), "model",
                            SyncChunking{.device = "cpu", .batch_size = 2});
  chunked.set_parameter("residual.square.scaling", at::full({}, scaling, at::kDouble));
  test::check_close(chunked.param_vjp(inputs, {{"x", cotangent}}).at("residual.square.scaling"),
                    contracted, "chunked param_vjp", 1e-13);
  // A row that fails spoils a sum over rows: a recoverable error, no gradient.
  try {
    static_cast<void>(s.param_vjp(scalar_inputs({1.0, -50.0, 2.0}), {{"x", cotangent}}));
    FAIL("expected a ConvergenceError");
  } catch (const ConvergenceError& e) {
    CHECK(e.recoverable());
    CHECK_FALSE(e.per_row());
    CHECK(contains(e.what(), "param_vjp(): Newton did not converge for 1 of 3 rows"));
  }
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

TEST_CASE("implicit models through DispatchedModel: chunked Jacobians, batch 0, no batch axis") {
  const test::Reference ref("j2_radial_return");
  const auto inputs = ref.group("s3/in");
  const auto [whole_out, whole_J] = session("j2_radial_return").jacobian(inputs);
  const auto m = load_model(test::stub("j2_radial_return", "model"), "model",
                            SyncChunking{.device = "cpu", .batch_size = 7});
  const auto [out, J] = m.jacobian(inputs);
  test::check_close(out, whole_out, "chunked outputs", 1e-13);
  for (const auto& [o, blocks] : whole_J)
    test::check_close(J.at(o), blocks, "chunked d" + o, 1e-13);

  test::check_empty_batch(m, true);

  // One point without a batch axis: results without one, the same numbers as row 5.
  TensorMap point;
  for (const auto& [name, value] : inputs)
    point.emplace(name, value[5]);
  const auto single = m.forward(point);
  for (const auto& [name, value] : whole_out)
    test::check_close(single.at(name), value[5], "unbatched " + name, 1e-13);
}

TEST_CASE("line search rescues a step that full Newton overshoots") {
  // x + dt x^2 = x~1 + dt a with dt = 10, from x = -0.049, next to the turning point
  // x = -1/(2 dt) where dr/dx vanishes: the full Newton step lands near x = 500 and needs
  // about ten halvings back; backtracking cuts that first step instead.
  auto s = session("scalar_backward_euler");
  const auto one = [](double v) { return at::full({1}, v, at::kDouble); };
  const TensorMap inputs = {
      {"a", one(1.0)}, {"x", one(-0.049)}, {"x~1", one(0.5)}, {"t", one(10.0)}, {"t~1", one(0.0)}};
  auto config = s.solver_config();
  config.miters = 6;
  s.set_solver_config(config);
  CHECK(convergence_error([&] { static_cast<void>(s.forward(inputs)); }).failed_rows() == 1);

  config.ls_max_iters = 20;
  s.set_solver_config(config);
  const double root = (std::sqrt(1 + 4 * 10 * (0.5 + 10 * 1.0)) - 1) / (2 * 10);
  test::check_close(s.forward(inputs).at("x"), one(root), "the positive root", 1e-10);
}

TEST_CASE("substepping: rows that fail in one step converge in bisected spans, as eager NEML2") {
  // scalar_substepping (max_substepping_level = 3) against eager NEML2 solving each span of
  // the same bisection (it refuses to substep itself), and the closed form.
  const test::Reference ref("scalar_substepping");
  const auto inputs = ref.group("sub/in");
  const auto& expected = ref["sub/out/x"];
  const auto& spans = ref["sub/spans"];
  for (double n : {0.0, 1.0, 2.0, 3.0, 4.0}) // one step, depths 1 to 3, and failures at 3
    CHECK_MESSAGE((spans == n).any().item<bool>(), "no row takes " << n << " spans");
  const auto converged = spans > 0;
  const auto e =
      convergence_error([&] { static_cast<void>(session("scalar_substepping").forward(inputs)); });
  CHECK(e.recoverable());
  CHECK(at::equal(e.converged_mask(), converged));
  CHECK(e.failed_rows() == (~converged).sum().item<std::int64_t>());
  const auto& x = e.outputs().at("x");
  test::check_close(x.index({converged}), expected.index({converged}), "eager NEML2 spans", 1e-8);
  CHECK(at::isnan(x.index({~converged})).all().item<bool>());

  // The spans in closed form: the same count per row, the same root.
  for (std::int64_t r = 0; r < x.size(0); ++r) {
    CAPTURE(r);
    int count = 0;
    const auto root = scalar_bisected(inputs.at("x~1")[r].item<double>(),
                                      (inputs.at("t")[r] - inputs.at("t~1")[r]).item<double>(),
                                      inputs.at("a")[r].item<double>(), 3, count);
    REQUIRE(root.has_value() == converged[r].item<bool>());
    if (!root)
      continue;
    CHECK(count == spans[r].item<double>());
    CHECK(std::abs(x[r].item<double>() - *root) <= 1e-10 * std::max(1.0, std::abs(*root)));
  }
}

TEST_CASE("substepping off: the same rows fail; rows that converge in one step are untouched") {
  const test::Reference ref("scalar_substepping");
  const auto inputs = ref.group("sub/in");
  const auto one_step = ref["sub/spans"] == 1;
  const auto off = session("scalar_backward_euler"); // the same model, max_substepping_level 0
  const auto e_off = convergence_error([&] { static_cast<void>(off.forward(inputs)); });
  CHECK(at::equal(e_off.converged_mask(), one_step));

  // With NEML2's gate on the relative criterion wide open, the rows that converge in one
  // step run exactly as without substepping: the same bits, values and Jacobians.
  auto on = session("scalar_substepping");
  auto config = on.solver_config();
  config.substep_del_tol = 1e300;
  on.set_solver_config(config);
  const auto e_on = convergence_error([&] { static_cast<void>(on.forward(inputs)); });
  CHECK(at::equal(e_on.converged_mask() & one_step, one_step));
  CHECK(test::identical(e_on.outputs().at("x").index({one_step}),
                        e_off.outputs().at("x").index({one_step})));
  TensorMap easy;
  for (const auto& [name, value] : inputs)
    easy.emplace(name, value.index({one_step}));
  const auto [on_out, on_J] = on.jacobian(easy);
  const auto [off_out, off_J] = off.jacobian(easy);
  for (const auto& [i, block] : off_J.at("x"))
    CHECK_MESSAGE(test::identical(on_J.at("x").at(i), block), "dx/d" << i);
}

TEST_CASE("substep_del_tol: with substepping on, the relative criterion needs a small update") {
  // rtol = 0.5 is met after one update. Without substepping that ends the solve; with it
  // (NEML2's rule, seen in its runtime) the update must also be below
  // substep_del_tol (||u|| + atol), so Newton goes on to the root.
  const std::vector<double> a = {1.0, -12.0};
  auto off = session("scalar_backward_euler");
  auto on = session("scalar_substepping");
  for (auto* s : {&off, &on}) {
    auto config = s->solver_config();
    config.rtol = 0.5;
    s->set_solver_config(config);
  }
  const double dt = 0.1, x_old = 0.5;
  const auto root =
      (at::sqrt(1 + 4 * dt * (x_old + dt * at::tensor(a, at::kDouble))) - 1) / (2 * dt);
  const auto x_off = off.forward(scalar_inputs(a)).at("x");
  test::check_close(on.forward(scalar_inputs(a)).at("x"), root, "gated", 1e-10);
  CHECK((x_off - root).abs().min().item<double>() > 1e-4); // stopped after one update

  auto config = on.solver_config();
  config.substep_del_tol = 1e300;
  on.set_solver_config(config);
  CHECK(test::identical(on.forward(scalar_inputs(a)).at("x"), x_off));
}

TEST_CASE("substepped rows do not depend on the rows beside them") {
  const test::Reference ref("scalar_substepping");
  const auto inputs = ref.group("sub/in");
  const auto converged = ref["sub/spans"] > 0;
  const auto [whole, whole_mask] = forward_rows(session("scalar_substepping"), inputs);
  REQUIRE(at::equal(whole_mask, converged));
  for (std::int64_t rows : {1, 5, 7}) {
    CAPTURE(rows);
    const auto m = load_model(test::stub("scalar_substepping", "model"), "model",
                              SyncChunking{.device = "cpu", .batch_size = rows});
    const auto [out, mask] = forward_rows(m, inputs);
    CHECK(at::equal(mask, converged));
    test::check_close(out.at("x").index({converged}), whole.at("x").index({converged}), "chunked",
                      1e-13);
  }
  // The asynchronous pool: chunks of 5 on a worker, failures merged into one mask.
  const auto pooled = load_model(test::stub("scalar_substepping", "model"), "model",
                                 GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {5}});
  const auto [pooled_out, pooled_mask] = forward_rows(pooled, inputs);
  CHECK(at::equal(pooled_mask, converged));
  test::check_close(pooled_out.at("x").index({converged}), whole.at("x").index({converged}),
                    "pooled", 1e-13);
  // The deepest row alone, and beside a row that fails.
  const auto deepest = (ref["sub/spans"] == 4).nonzero()[0][0].item<std::int64_t>();
  const auto failing = (~converged).nonzero()[0][0].item<std::int64_t>();
  const auto s = session("scalar_substepping");
  const auto alone = s.forward(rows_of(inputs, at::tensor({deepest}, at::kLong))).at("x");
  const auto [beside, mask] =
      forward_rows(s, rows_of(inputs, at::tensor({failing, deepest}, at::kLong)));
  CHECK(at::equal(mask, mask_of({0, 1})));
  test::check_close(alone, whole.at("x").narrow(0, deepest, 1), "alone", 1e-13);
  test::check_close(beside.at("x").narrow(0, 1, 1), alone, "beside a failing row", 1e-13);
}

TEST_CASE("Jacobians of substepped rows: chained through the spans, against finite differences") {
  const test::Reference ref("scalar_substepping");
  const auto all = ref.group("sub/in");
  const auto substepped = ref["sub/spans"] > 1;
  TensorMap inputs;
  for (const auto& [name, value] : all)
    inputs.emplace(name, value.index({substepped}));
  const auto s = session("scalar_substepping");
  const auto [out, J] = s.jacobian(inputs);
  test::check_close(out.at("x"), ref["sub/out/x"].index({substepped}), "outputs", 1e-8);
  for (const auto& name : {"a", "x~1", "t", "t~1"}) {
    CAPTURE(name);
    const auto h = 1e-6;
    auto plus = inputs, minus = inputs;
    plus[name] = inputs.at(name) + h;
    minus[name] = inputs.at(name) - h;
    const auto fd = (s.forward(plus).at("x") - s.forward(minus).at("x")) / (2 * h);
    test::check_close(J.at("x").at(name), fd, std::string("dx/d") + name, 1e-6);
  }
  // The initial guess moves nothing.
  CHECK(J.at("x").at("x").abs().max().item<double>() == 0);
  // jvp: the same blocks, contracted.
  TensorMap tangents;
  auto expected = at::zeros_like(out.at("x"));
  for (const auto& [name, value] : inputs) {
    tangents.emplace(name, at::rand_like(value) - 0.5);
    expected += J.at("x").at(name) * tangents.at(name);
  }
  test::check_close(s.jvp(inputs, tangents).second.at("x"), expected, "jvp", 1e-12);
}

TEST_CASE("line searches as eager NEML2's: which rows converge, and to which root") {
  // x + dt x^2 = x~1 + dt a with dt = 10 from guesses around the turning point x = -0.05,
  // where full Newton steps overshoot: the line search decides which rows converge within
  // miters and to which root. Each case's settings are stored with its reference.
  const test::Reference ref("scalar_backward_euler");
  std::map<std::string, at::Tensor> masks;
  for (const std::string c :
       {"ls_none", "ls_backtracking", "ls_strong_wolfe", "ls_strong_wolfe_short"}) {
    CAPTURE(c);
    const auto settings = ref[c + "/config"];
    auto s = session("scalar_backward_euler");
    auto config = s.solver_config();
    config.miters = settings[0].item<std::int64_t>();
    config.ls_max_iters = settings[1].item<std::int64_t>();
    config.ls_cutback = settings[2].item<double>();
    config.ls_c = settings[3].item<double>();
    config.ls_type = contains(c, "strong_wolfe") ? "STRONG_WOLFE" : "BACKTRACKING";
    s.set_solver_config(config);
    const auto& expected = ref[c + "/out/x"];
    const auto converged = at::isfinite(expected);
    const auto [out, mask] = forward_rows(s, ref.group(c + "/in"));
    CHECK(at::equal(mask, converged));
    if (converged.any().item<bool>())
      test::check_close(out.at("x").index({converged}), expected.index({converged}), "roots", 1e-8);
    masks[c] = converged;
  }
  // The settings matter here: without a line search every row fails; with one most rows
  // converge, to both roots; two evaluations per step (ls_max_iters = 3) lose a band.
  CHECK_FALSE(masks["ls_none"].any().item<bool>());
  CHECK(masks["ls_strong_wolfe"].sum().item<std::int64_t>() >
        masks["ls_strong_wolfe_short"].sum().item<std::int64_t>());
  const auto roots = ref["ls_strong_wolfe/out/x"].index({masks["ls_strong_wolfe"]});
  CHECK(((roots > 0).any() & (roots < 0).any()).item<bool>());
}

TEST_CASE("line search: every trial point where NEML2's own Newton loop puts it") {
  // r(u) = atan(u), one row at a time, through detail::newton_solve with graphs written
  // here, against NEML2's newton_solve_eager (the loop its eager models and its runtime
  // share) on the same function: every residual evaluation of the line search, in order.
  const test::Reference ref("scalar_backward_euler");
  const auto& starts = ref["newton/starts"];
  for (const std::string c : {"bt", "sw", "bt_short", "sw_steep", "bt_steep", "sw_atol"}) {
    CAPTURE(c);
    const auto settings = ref["newton/" + c + "/config"];
    SolverConfig config;
    config.atol = settings[0].item<double>();
    config.miters = settings[1].item<std::int64_t>();
    config.ls_max_iters = settings[2].item<std::int64_t>();
    config.ls_cutback = settings[3].item<double>();
    config.ls_c = settings[4].item<double>();
    config.ls_type = settings[5].item<double>() != 0 ? "STRONG_WOLFE" : "BACKTRACKING";
    for (std::int64_t k = 0; k < starts.size(0); ++k)
      for (const bool row_pass : {false, true}) {
        CAPTURE(k);
        CAPTURE(row_pass);
        config.row_pass = row_pass;
        std::vector<double> trials;
        neml2::detail::NewtonGraphs graphs;
        graphs.residual = [&](const std::vector<at::Tensor>& args) {
          trials.push_back(args[0].item<double>());
          return std::vector<at::Tensor>{-at::atan(args[0])};
        };
        // Tensor path: "A" = 1 + u^2 = (dr/du)^-1 and du = b A, NEML2's step operation for
        // operation. The row pass solves A du = b itself, so it gets A = dr/du.
        graphs.jacobian = [row_pass](const std::vector<at::Tensor>& args) {
          const auto& u = args[0];
          const auto a = row_pass ? 1 / (1 + u * u) : 1 + u * u;
          return std::vector<at::Tensor>{a.reshape({-1, 1, 1}), -at::atan(u)};
        };
        graphs.solve = [](const std::vector<at::Tensor>& ops) {
          return std::vector<at::Tensor>{ops[1] * ops[0].reshape({-1, 1})};
        };
        graphs.a_blocks = 1;
        const auto result = test::newton_solve(
            graphs, {at::full({1, 1}, starts[k].item<double>(), at::kDouble)}, {}, {}, config);
        const auto expected = ref["newton/" + c + "/" + std::to_string(k) + "/trials"];
        const auto end = ref["newton/" + c + "/" + std::to_string(k) + "/u"].item<double>();
        // A row that diverges to inf has A = 0 there: the row pass fails it at that pivot,
        // where NEML2 goes on with inf and NaN, so its trials are a prefix of NEML2's.
        if (row_pass && std::isnan(end))
          REQUIRE(static_cast<std::int64_t>(trials.size()) <= expected.numel());
        else
          REQUIRE(static_cast<std::int64_t>(trials.size()) == expected.numel());
        for (std::size_t i = 0; i < trials.size(); ++i) {
          const auto e = expected[static_cast<std::int64_t>(i)].item<double>();
          // Equal, or both past overflow (a diverging row reaches inf, then NaN).
          const bool same = trials[i] == e || (std::isnan(trials[i]) && std::isnan(e)) ||
                            std::abs(trials[i] - e) <= 1e-12 * std::max(1.0, std::abs(e));
          CHECK_MESSAGE(same, "trial " << i << ": " << trials[i] << " vs NEML2's " << e);
        }
        CHECK(result.converged.item<bool>() == !std::isnan(end));
        if (!std::isnan(end))
          CHECK(std::abs(result.u[0].item<double>() - end) <= 1e-12);
      }
  }
}

TEST_CASE("substepping bisects recursively: after a deep left half, the right half is whole") {
  // u^2 = q with q = 1 - 5 (f - f~1) while f~1 < 1/2 and 1 - (f - f~1) after (no root when
  // q < 0), f ramped from f~1 = 0 to f = 1, down to depth 3: the start needs spans of 1/8,
  // then [1/4, 1/2] fails and takes two more, and [1/2, 1] converges whole. A driver that
  // went on in eighths would end with q = 7/8 instead of 1/2.
  std::vector<std::pair<double, double>> spans; // (f~1, f) of every try, in order
  neml2::detail::NewtonGraphs graphs;
  const auto q = [](const at::Tensor& g) {
    const auto f = g.select(1, 0), f_old = g.select(1, 1);
    return 1 - at::where(f_old < 0.5, 5.0, 1.0) * (f - f_old);
  };
  graphs.residual = [&](const std::vector<at::Tensor>& args) {
    return std::vector<at::Tensor>{
        (q(args[1]) - args[0].squeeze(1) * args[0].squeeze(1)).unsqueeze(1)};
  };
  graphs.jacobian = [&](const std::vector<at::Tensor>& args) {
    const std::pair span{args[1][0][1].item<double>(), args[1][0][0].item<double>()};
    if (spans.empty() || spans.back() != span)
      spans.push_back(span);
    const auto& u = args[0];
    return std::vector<at::Tensor>{(2 * u).reshape({-1, 1, 1}), q(args[1]).unsqueeze(1) - u * u};
  };
  graphs.solve = [](const std::vector<at::Tensor>& ops) {
    return std::vector<at::Tensor>{ops[1] / ops[0].reshape({-1, 1})};
  };
  graphs.a_blocks = 1;
  neml2::detail::SubstepPlan plan;
  plan.max_level = 3;
  plan.ramps.push_back({{0, 0, 1}, {0, 1, 1}});
  const auto givens = at::tensor({1.0, 0.0}, at::kDouble).reshape({1, 2});
  const std::vector u0{at::ones({1, 1}, at::kDouble)};
  const auto result = neml2::detail::solve_with_substeps(
      graphs, neml2::detail::plan_newton(graphs, u0, SolverConfig{}), u0, {givens}, {},
      SolverConfig{}, plan);
  const std::vector<std::pair<double, double>> expected = {
      {0, 1},      {0, 0.5},      {0, 0.25},    {0, 0.125}, {0.125, 0.25},
      {0.25, 0.5}, {0.25, 0.375}, {0.375, 0.5}, {0.5, 1}};
  CHECK(spans == expected);
  REQUIRE(result.converged.item<bool>());
  CHECK(std::abs(result.u[0].item<double>() - std::sqrt(0.5)) <= 1e-12);
}

TEST_CASE("parameter derivatives of substepped rows: chained through the spans") {
  // neml2-compile writes the same graphs whatever max_substepping_level is (only that field
  // differs: scalar_substepping against scalar_backward_euler), so the parameter artifact
  // with the field set to 3 is what compiling it with substepping would give.
  namespace fs = std::filesystem;
  const auto root =
      fs::temp_directory_path() / ("neml2_dispatch_substep_params_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::copy(test::artifacts() / "scalar_backward_euler_params" / "model", root,
           fs::copy_options::recursive);
  std::stringstream text;
  text << std::ifstream(root / "metadata.json").rdbuf();
  auto metadata = text.str();
  const std::string from = "\"max_substepping_level\": 0";
  REQUIRE(metadata.find(from) != std::string::npos);
  metadata.replace(metadata.find(from), from.size(), "\"max_substepping_level\": 3");
  std::ofstream(root / "metadata.json") << metadata;
  auto s = Session(std::make_shared<const Artifact>(read_artifact(root)), "cpu");

  // The substepped rows of the reference cases; scaling = 1 is the compiled model's.
  const test::Reference ref("scalar_substepping");
  const auto substepped = ref["sub/spans"] > 1;
  TensorMap inputs;
  for (const auto& [name, value] : ref.group("sub/in"))
    inputs.emplace(name, value.index({substepped}));
  const auto [out, P] = s.param_jacobian(inputs);
  test::check_close(out.at("x"), ref["sub/out/x"].index({substepped}), "outputs", 1e-8);
  const double h = 1e-6;
  s.set_parameter("residual.square.scaling", at::full({}, 1 + h, at::kDouble));
  const auto plus = s.forward(inputs).at("x");
  s.set_parameter("residual.square.scaling", at::full({}, 1 - h, at::kDouble));
  const auto minus = s.forward(inputs).at("x");
  test::check_close(P.at("x").at("residual.square.scaling"), (plus - minus) / (2 * h), "dx/ds",
                    1e-6);
  fs::remove_all(root);
}

TEST_CASE("converged rows are not evaluated again: the graphs see only the rows iterating") {
  // 56 rows at equilibrium (a = 0.25: the old state solves the step) and 8 that iterate,
  // 4 of them longer than the others (a = 40 against a = 2).
  std::vector<double> a(64, 0.25);
  for (std::size_t k = 0; k < 8; ++k)
    a[8 * k + 3] = k % 2 ? 40.0 : 2.0;
  auto m = load_model(test::stub("scalar_backward_euler", "model"), "model",
                      SyncChunking{.cpu_lanes = 1}); // one graph call at a time
  const auto calls = [&](double compact_below) {
    auto config = m.solver_config();
    config.row_pass = false; // the tensor path (tests/test_row_pass.cpp: the CPU's row pass)
    config.compact_below = compact_below;
    m.set_solver_config(config);
    std::map<std::string, std::vector<std::int64_t>> rows; // per graph file, in call order
    neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
      rows[std::filesystem::path(file).stem().string()].push_back(n);
    });
    const auto out = m.forward(scalar_inputs(a)).at("x");
    neml2::detail::observe_graph_calls({});
    for (std::size_t r = 0; r < a.size(); ++r)
      CHECK(out[static_cast<std::int64_t>(r)].item<double>() ==
            doctest::Approx(*scalar_root(0.5, 0.1, a[r])).epsilon(1e-10));
    return rows;
  };
  const auto compacted = calls(0.5); // the default
  const auto& solves = compacted.at("model_solve");
  REQUIRE(solves.size() >= 3);
  CHECK(solves.front() == 8); // the 56 converged rows left before the first solve
  CHECK(solves.back() == 4);  // then the 4 slower ones alone
  CHECK(std::is_sorted(solves.rbegin(), solves.rend()));
  const auto& jacobians = compacted.at("model_jacobian");
  CHECK(jacobians.front() == 64); // the first residual, of every row (a batch of 64)
  CHECK(std::all_of(jacobians.begin() + 1, jacobians.end(), [](auto n) { return n <= 8; }));
  // A Newton that never compacts evaluates every row to the last iteration.
  const auto masked = calls(0.0);
  const auto& all_rows = masked.at("model_solve");
  CHECK(all_rows.size() == solves.size());
  CHECK(std::all_of(all_rows.begin(), all_rows.end(), [](auto n) { return n == 64; }));
}

TEST_CASE("a padded call's result that is its input passed through is its own memory") {
  // J2's predictor returns its input (the last step's flow rate), as the very tensor it was
  // given: a one-row call gives it the graph's two-row padding buffer, which the next
  // padded call writes again.
  const auto a =
      read_artifact(resolve_artifact_root(test::stub("j2_radial_return", "model"), "model"));
  const neml2::detail::Graph predictor(a.root / "cpu" / "float64", "model_seg1_predictor.pt2",
                                       c10::Device(c10::kCPU), at::kDouble, 1, "predictor_package");
  auto sizes = predictor.signature().inputs.at(0).sizes;
  sizes.at(0) = 1;
  const auto first = predictor.run({at::full(sizes, 0.25, at::kDouble)}).at(0);
  const auto second = predictor.run({at::full(sizes, 0.75, at::kDouble)}).at(0);
  CHECK(first.size(0) == 1);
  CHECK(at::equal(first, at::full(sizes, 0.25, at::kDouble)));
  CHECK(at::equal(second, at::full(sizes, 0.75, at::kDouble)));
}

// Unknowns with a sub-batch axis (binned_precipitation: a number density over 8 size bins,
// coupled through the precipitated volume): a row is a material point, its 8 bins one
// system.

TEST_CASE("an unknown with a sub-batch axis: read as written, each point solved as eager NEML2") {
  const auto a =
      read_artifact(resolve_artifact_root(test::stub("binned_precipitation", "model"), "model"));
  const auto& seg = std::get<ImplicitSegment>(a.segments.front());
  CHECK(seg.unknowns.front().sub_batch_shape == Shape{8});
  CHECK(seg.unknowns.front().base_shape.empty());
  CHECK(seg.unknowns.front().var_size == 8);
  CHECK(seg.unknown_groups.front().sub_batch_shape == Shape{8});
  const auto s = session("binned_precipitation");
  const test::Reference ref("binned_precipitation");
  for (int n = 0; n < 6; ++n) {
    CHECK(s.forward(ref.group(step_name(n) + "/in")).at("number_density").sizes() ==
          at::IntArrayRef{20, 8});
    test::check_forward(s, ref, step_name(n), 1e-8);
  }
}

TEST_CASE("binned unknowns: chunks of 1 and 7, the whole batch, _into and both policies") {
  const test::Reference ref("binned_precipitation");
  const auto inputs = ref.group("s5/in");
  const auto expected = ref.group("s5/out");
  const auto stub = test::stub("binned_precipitation", "model");
  for (std::int64_t rows : {1, 7, 0}) {
    CAPTURE(rows);
    const auto m = load_model(stub, "model", SyncChunking{.device = "cpu", .batch_size = rows});
    test::check_close(m.forward(inputs), expected, "chunked", 1e-8);
    const auto into = at::full({20, 8}, std::numeric_limits<double>::quiet_NaN(), at::kDouble);
    m.forward_into(inputs, {{"number_density", into}});
    test::check_close(into, expected.at("number_density"), "into", 1e-8);
    // A prepared call: inputs in the model's order, (B, 8) out.
    const auto call = m.prepare();
    std::vector<at::Tensor> ordered;
    for (const auto& name : call.input_names())
      ordered.push_back(inputs.at(name));
    test::check_close(call.forward(ordered).at(0), expected.at("number_density"), "prepared", 1e-8);
  }
  const auto greedy =
      load_model(stub, "model", GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {7}});
  test::check_close(greedy.forward(inputs), expected, "greedy", 1e-8);
}

TEST_CASE("block-structured groups: as eager NEML2 solves each point, whole or in chunks") {
  // grains: 4 grains' hardening and slip (a block group, the two interleaved per grain in
  // the graphs) beside a plain p, then a forward segment. Eager NEML2 solved each row alone.
  const test::Reference ref("grains");
  const auto stub = test::stub("grains", "model");
  const auto whole = load_model(stub, "model", SyncChunking{.device = "cpu"});
  for (int n = 0; n < 5; ++n) {
    CAPTURE(n);
    const auto inputs = ref.group(step_name(n) + "/in");
    const auto expected = ref.group(step_name(n) + "/out");
    const auto together = whole.forward(inputs);
    test::check_close(together, expected, "whole batch", 1e-8);
    for (const std::int64_t rows : {1, 7}) {
      CAPTURE(rows);
      const auto chunked =
          load_model(stub, "model", SyncChunking{.device = "cpu", .batch_size = rows});
      CHECK(test::identical(chunked.forward(inputs), together));
      const auto greedy = load_model(
          stub, "model", GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {rows}});
      CHECK(test::identical(greedy.forward(inputs), together));
    }
  }
  // Derivatives: neml2-compile writes none for a sub-batched unknown.
  CHECK(contains(test::fatal_message([&] { (void)whole.jacobian(ref.group("s0/in")); }),
                 "implicit variable 'hardening' has sub-batch shape [4], and neml2-compile "
                 "3.1 compiles no derivative of a sub-batched implicit variable"));
}

TEST_CASE("binned unknowns: a point's bins do not depend on the points beside it, on either path") {
  // Homologous temperatures 0.5 to 1.5 across the rows: the slowest and fastest
  // precipitation side by side, each as it is alone.
  const test::Reference ref("binned_precipitation");
  const auto inputs = ref.group("s5/in");
  auto s = session("binned_precipitation");
  std::optional<TensorMap> on_rows;
  for (const bool row_pass : {true, false}) {
    CAPTURE(row_pass);
    auto config = s.solver_config();
    config.row_pass = row_pass;
    s.set_solver_config(config);
    const auto together = s.forward(inputs);
    for (std::int64_t r : {0, 19}) {
      const auto alone = s.forward(rows_of(inputs, at::tensor({r}, at::kLong)));
      const auto mixed = s.forward(rows_of(inputs, at::tensor({19 - r, r}, at::kLong)));
      test::check_close(alone.at("number_density"), together.at("number_density").narrow(0, r, 1),
                        "alone", 1e-13);
      test::check_close(mixed.at("number_density").narrow(0, 1, 1),
                        together.at("number_density").narrow(0, r, 1), "mixed", 1e-13);
    }
    if (on_rows)
      test::check_close(together, *on_rows, "row pass against the tensor path", 1e-12);
    on_rows = together;
  }
}

TEST_CASE("300 unknowns per point (binned_precipitation over 300 bins) at 1, 2 and 3 intra-op "
          "threads: as eager NEML2, the same bits at each") {
  // Above the row pass's size each point's LU is LAPACK's. Through the solve graph (torch's
  // batched LU) it went wrong from 2 threads on, with the row pass on or off: MKL's LU
  // threading itself inside torch's team gave wrong pivots, or never returned.
  const test::Reference ref("binned_precipitation_300");
  const auto s = session("binned_precipitation_300");
  const auto restore =
      c10::make_scope_exit([threads = at::get_num_threads()] { at::set_num_threads(threads); });
  std::vector<TensorMap> at_one_thread;
  for (const int threads : {1, 2, 3}) {
    CAPTURE(threads);
    at::set_num_threads(threads);
    for (int n = 0; n < 6; ++n) {
      const auto out = s.forward(ref.group(step_name(n) + "/in"));
      test::check_close(out, ref.group(step_name(n) + "/out"), step_name(n), 1e-8);
      if (threads == 1)
        at_one_thread.push_back(out);
      else
        CHECK(test::identical(out, at_one_thread.at(n)));
    }
  }
}

TEST_CASE("a batch where NEML2's shared Newton fails converges here, each point as it is alone") {
  // A point frozen where its Jacobian is NaN (converged at its first guess) beside a moving
  // one: eager NEML2 solves each alone, but fails them together, since every point of its
  // batch takes the batch's Newton steps. Here each point converges, or not, on its own.
  const test::Reference ref("binned_dissolution");
  CHECK(ref["mixed/eager_batched_failed"].item<double>() == 1.0);
  auto s = session("binned_dissolution");
  for (const bool row_pass : {true, false}) {
    CAPTURE(row_pass);
    auto config = s.solver_config();
    config.row_pass = row_pass;
    s.set_solver_config(config);
    test::check_forward(s, ref, "mixed", 1e-8);
  }
}

TEST_CASE("a sub-batched unknown beside a plain one: each output in its own shape, as eager") {
  // slip_systems: hardening over 12 slip systems and the accumulated slip p, one system per
  // point. p is (B,) although an input (hardening~1) is sub-batched.
  const test::Reference ref("slip_systems");
  const auto m = load_model(test::stub("slip_systems", "model"), "model",
                            SyncChunking{.device = "cpu", .batch_size = 7});
  for (int n = 0; n < 5; ++n)
    test::check_forward(m, ref, step_name(n), 1e-8);
  const auto inputs = ref.group("s4/in");
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  const auto hardening = at::full({20, 12}, nan, at::kDouble), p = at::full({20}, nan, at::kDouble);
  TensorMap into;
  for (const auto& [name, t] : ref.group("s4/out"))
    into.emplace(name, at::full(t.sizes(), nan, at::kDouble));
  m.forward_into(inputs, into);
  test::check_close(into, ref.group("s4/out"), "into", 1e-8);
}

TEST_CASE("a forward segment after a sub-batched solve: chunks of 1 and 7 and pieces, on both "
          "policies, bit for bit as the whole batch") {
  // slip_systems' forward segment reads the solve's results: system_strength keeps the 12
  // systems, mean_hardening (an SR2) averages them away, work is plain. metadata.json gives
  // only base shapes: a chunk's outputs were allocated with the inputs' 12 systems.
  const test::Reference ref("slip_systems");
  const auto stub = test::stub("slip_systems", "model");
  const auto inputs = ref.group("s4/in");
  const auto expected = ref.group("s4/out");
  CHECK(expected.at("system_strength").sizes() == at::IntArrayRef{20, 12});
  CHECK(expected.at("mean_hardening").sizes() == at::IntArrayRef{20, 6});
  CHECK(expected.at("work").sizes() == at::IntArrayRef{20});
  const auto whole_model = load_model(stub, "model", SyncChunking{.device = "cpu"});
  CHECK(whole_model.output_shapes() ==
        std::vector<Shape>{{12}, {}, {6}, {12}, {}}); // system_strength work mean_hardening ...
  const auto whole = whole_model.forward(inputs);
  test::check_close(whole, expected, "whole batch", 1e-8);
  const auto nan = std::numeric_limits<double>::quiet_NaN();
  for (std::int64_t rows : {1, 7}) {
    CAPTURE(rows);
    const auto m = load_model(stub, "model", SyncChunking{.device = "cpu", .batch_size = rows});
    CHECK(test::identical(m.forward(inputs), whole));
    TensorMap into;
    for (const auto& [name, t] : whole)
      into.emplace(name, at::full(t.sizes(), nan, at::kDouble));
    m.forward_into(inputs, into);
    CHECK(test::identical(into, whole));
    const auto call = m.prepare();
    std::vector<at::Tensor> ordered;
    for (const auto& name : call.input_names())
      ordered.push_back(inputs.at(name));
    const auto prepared = call.forward(ordered);
    for (std::size_t o = 0; o < m.output_names().size(); ++o)
      CHECK(test::identical(prepared.at(o), whole.at(m.output_names()[o])));
    const auto greedy = load_model(
        stub, "model", GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {rows}});
    CHECK(test::identical(greedy.forward(inputs), whole));
  }
  // A whole batch above one cache-sized piece (4096 rows here) is gathered piece by piece,
  // as SyncChunking's default chunk of 16384 rows is: the rows repeated 300 times.
  TensorMap many;
  for (const auto& [name, t] : inputs)
    many.emplace(name, t.repeat_interleave(300, 0));
  const auto pieces = whole_model.forward(many);
  for (const auto& [name, t] : whole)
    CHECK_MESSAGE(test::identical(pieces.at(name), t.repeat_interleave(300, 0)), name);
}

TEST_CASE("a sub-batched solve has no derivative graphs: a chunked jacobian says so before "
          "any chunk runs") {
  const test::Reference ref("slip_systems");
  const auto m = load_model(test::stub("slip_systems", "model"), "model",
                            SyncChunking{.device = "cpu", .batch_size = 7});
  const auto inputs = ref.group("s4/in");
  for (const auto& message : {test::fatal_message([&] { static_cast<void>(m.jacobian(inputs)); }),
                              test::fatal_message([&] { static_cast<void>(m.jvp(inputs, {})); })}) {
    CAPTURE(message);
    CHECK(contains(message, "compiled without the graphs it needs"));
    CHECK(contains(message, "'hardening' has sub-batch shape [12]"));
    CHECK(contains(message, "neml2-compile 3.1 compiles no derivative of a sub-batched "
                            "implicit variable"));
  }
}
