// Why each row of a per-row ConvergenceError failed (reasons()) and its last residual norm
// (residual_norms()): decided from what Newton saw (the row pass, the tensor path, the
// Krylov step, substepping) and kept through everything that merges a call's rows (chunks,
// CPU lanes, the asynchronous engine, the maps of outputs).

#include <cmath>
#include <functional>
#include <limits>

#include "cube_root.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "planned_newton.hpp"
#include "scalar_model.hpp"

using namespace neml2;
using test::convergence_error;
using test::session;

namespace {

constexpr double not_a_number = std::numeric_limits<double>::quiet_NaN();

// One row of the scalar model: x' = a - x^2 by backward Euler over dt from x~1, Newton from
// x; its residual r(x) = x - x~1 - (a - x^2) dt and dr/dx = 1 + 2 x dt.
struct ScalarRow {
  double a, x, x_old, dt;

  [[nodiscard]] double residual(double at) const { return at - x_old - (a - at * at) * dt; }
  [[nodiscard]] double slope(double at) const { return 1 + 2 * at * dt; }
};

TensorMap scalar_inputs(const std::vector<ScalarRow>& rows) {
  std::vector<double> a, x, x_old, t;
  for (const auto& r : rows) {
    a.push_back(r.a);
    x.push_back(r.x);
    x_old.push_back(r.x_old);
    t.push_back(r.dt);
  }
  return {{"a", at::tensor(a, at::kDouble)},
          {"x", at::tensor(x, at::kDouble)},
          {"x~1", at::tensor(x_old, at::kDouble)},
          {"t", at::tensor(t, at::kDouble)},
          {"t~1", at::zeros({static_cast<std::int64_t>(rows.size())}, at::kDouble)}};
}

// A row that converges, one with no real root for its step (the iteration cap), one with a
// NaN input, one that starts where dr/dx = 1 + 2 x dt = 0 while r = -1.25 (a zero pivot).
const ScalarRow converges{1.0, 0.5, 0.5, 0.1};
const ScalarRow no_root{-50.0, 0.5, 0.5, 0.1};
const ScalarRow nan_input{not_a_number, 0.5, 0.5, 0.1};
const ScalarRow zero_slope{1.0, -0.5, 0.0, 1.0};

at::Tensor reasons_of(std::initializer_list<RowFailure> reasons) {
  std::vector<std::int8_t> codes;
  for (auto r : reasons)
    codes.push_back(static_cast<std::int8_t>(r));
  return at::tensor(codes, at::kChar);
}

// Exactly the same values, NaN where the other has NaN.
bool same_norms(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::allclose(a.cpu(), b.cpu(), 0, 0, /*equal_nan=*/true);
}

void check_per_row_detail(const ConvergenceError& e) {
  REQUIRE(e.per_row());
  REQUIRE(e.reasons().defined());
  REQUIRE(e.residual_norms().defined());
  CHECK((e.reasons().scalar_type() == at::kChar));
  CHECK((e.residual_norms().scalar_type() == at::kDouble));
  CHECK(e.reasons().sizes() == e.converged_mask().sizes());
  CHECK(e.residual_norms().sizes() == e.converged_mask().sizes());
  // none exactly where the row converged, and 0 as its norm
  CHECK(at::equal(e.reasons() == static_cast<std::int8_t>(RowFailure::none), e.converged_mask()));
  CHECK((e.residual_norms().index({e.converged_mask()}) == 0).all().item<bool>());
}

} // namespace

TEST_CASE("each failed row says why: the iteration cap, a NaN input, a zero pivot") {
  const std::vector<ScalarRow> rows = {converges, no_root, nan_input, zero_slope, converges};
  const auto expected =
      reasons_of({RowFailure::none, RowFailure::not_converged, RowFailure::non_finite,
                  RowFailure::singular, RowFailure::none});
  for (const bool row_pass : {true, false}) { // the CPU's row pass, the accelerators' path
    CAPTURE(row_pass);
    const auto s = session("scalar_backward_euler", [&](auto& c) { c.row_pass = row_pass; });
    const auto e = convergence_error([&] { static_cast<void>(s.forward(scalar_inputs(rows))); });
    check_per_row_detail(e);
    CHECK(at::equal(e.reasons(), expected));
    CHECK(e.reason(1) == RowFailure::not_converged);
    CHECK(e.reason(2) == RowFailure::non_finite);
    CHECK(e.reason(3) == RowFailure::singular);
    CHECK(e.reason(4) == RowFailure::none);
    const auto norm = [&](std::int64_t r) { return e.residual_norms()[r].item<double>(); };
    CHECK(norm(1) > s.solver_config().atol);
    CHECK(std::isfinite(norm(1)));
    CHECK(std::isnan(norm(2)));
    // The row pass fails the row at its zero pivot, with the norm it tested there; the
    // tensor path divides by it and tests a residual that is not finite.
    if (row_pass)
      CHECK(norm(3) == std::abs(zero_slope.residual(zero_slope.x)));
    else
      CHECK(std::isnan(norm(3)));
    // jacobian() decides the same
    const auto through_jacobian =
        convergence_error([&] { static_cast<void>(s.jacobian(scalar_inputs(rows))); });
    CHECK(at::equal(through_jacobian.reasons(), expected));
    CHECK(same_norms(through_jacobian.residual_norms(), e.residual_norms()));
  }
}

TEST_CASE("a row converged where dR/du is singular fails as singular, with its converged norm") {
  // r = 0 at the guess x = -0.5 (a = -0.25, x~1 = 0, dt = 1), where dr/dx = 0: converged at
  // once, its derivatives not finite (docs/errors.md entry 88a).
  const ScalarRow singular_root{-0.25, -0.5, 0.0, 1.0};
  REQUIRE(singular_root.residual(singular_root.x) == 0);
  REQUIRE(singular_root.slope(singular_root.x) == 0);
  const auto s = session("scalar_backward_euler");
  const auto e = convergence_error([&] {
    static_cast<void>(s.jacobian(scalar_inputs({singular_root, converges, no_root})));
  });
  check_per_row_detail(e);
  CHECK(at::equal(e.reasons(),
                  reasons_of({RowFailure::singular, RowFailure::none, RowFailure::not_converged})));
  CHECK(e.residual_norms()[0].item<double>() == 0);
}

TEST_CASE("a failed row's norm is the residual Newton tested last: one and no update, by hand") {
  for (const bool row_pass : {true, false}) {
    CAPTURE(row_pass);
    // miters = N allows N - 1 updates.
    for (const std::int64_t miters : {1, 2}) {
      CAPTURE(miters);
      const auto s = session("scalar_backward_euler", [&](auto& c) {
        c.row_pass = row_pass;
        c.miters = miters;
      });
      const auto e = convergence_error([&] {
        static_cast<void>(s.forward(scalar_inputs({no_root, converges, no_root})));
      });
      check_per_row_detail(e);
      auto x = no_root.x;
      if (miters == 2)
        x -= no_root.residual(x) / no_root.slope(x);
      const auto by_hand = std::abs(no_root.residual(x));
      for (std::int64_t r : {0, 2}) {
        CAPTURE(r);
        CHECK(e.reason(r) == RowFailure::not_converged);
        CHECK(e.residual_norms()[r].item<double>() == doctest::Approx(by_hand).epsilon(1e-14));
      }
      // ... and the worst residual is the largest of the failed rows' norms
      CHECK(e.worst_residual() == e.residual_norms().max().item<double>());
    }
  }
}

TEST_CASE("the same reasons and norms whole, in chunks, on 2 CPU lanes and through "
          "GreedyPriorityCapacity") {
  std::vector<ScalarRow> rows;
  for (int k = 0; k < 3; ++k)
    rows.insert(rows.end(), {converges, no_root, nan_input, converges, zero_slope});
  const auto inputs = scalar_inputs(rows);
  const auto whole = convergence_error(
      [&] { static_cast<void>(session("scalar_backward_euler").forward(inputs)); });
  check_per_row_detail(whole);
  REQUIRE(at::equal(whole.reasons().narrow(0, 0, 5),
                    reasons_of({RowFailure::none, RowFailure::not_converged, RowFailure::non_finite,
                                RowFailure::none, RowFailure::singular})));

  const auto stub = test::stub("scalar_backward_euler", "model");
  std::vector<std::pair<std::string, AnyDispatchedModel>> models;
  models.emplace_back("SyncChunking whole", load_model(stub, "model", SyncChunking{}));
  models.emplace_back("SyncChunking 1", load_model(stub, "model", SyncChunking{.batch_size = 1}));
  models.emplace_back("SyncChunking 4",
                      load_model(stub, "model", SyncChunking{.batch_size = 4, .cpu_lanes = 1}));
  models.emplace_back("SyncChunking 2 on 2 lanes",
                      load_model(stub, "model", SyncChunking{.batch_size = 2, .cpu_lanes = 2}));
  models.emplace_back(
      "GreedyPriorityCapacity 3",
      load_model(stub, "model", GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {3}}));
  models.emplace_back(
      "GreedyPriorityCapacity 2 on 2 lanes",
      load_model(stub, "model",
                 GreedyPriorityCapacity{.devices = {"cpu"}, .batch_sizes = {2}, .cpu_lanes = 2}));
  for (const auto& [name, m] : models) {
    CAPTURE(name);
    for (const bool jacobian : {false, true}) {
      CAPTURE(jacobian);
      const auto e = convergence_error([&, &m = m] {
        if (jacobian)
          static_cast<void>(m.jacobian(inputs));
        else
          static_cast<void>(m.forward(inputs));
      });
      check_per_row_detail(e);
      CHECK(at::equal(e.converged_mask(), whole.converged_mask()));
      CHECK(at::equal(e.reasons(), whole.reasons()));
      CHECK(same_norms(e.residual_norms(), whole.residual_norms()));
      CHECK(!e.outputs().empty()); // the maps of outputs keep them too
    }
  }
}

TEST_CASE("substepping: a row rescued by bisection is none, one failing at the deepest level "
          "says why its last span failed") {
  // scalar_substepping bisects a failed step down to 1/8: a = -50 over 0.1 has a root over
  // half of it; a = -5000 has none even over an eighth.
  const ScalarRow rescued{-50.0, 0.5, 0.5, 0.1}, hopeless{-5000.0, 0.5, 0.5, 0.1};
  int spans = 0;
  REQUIRE(test::scalar_bisected(rescued.x_old, rescued.dt, rescued.a, 3, spans).has_value());
  REQUIRE_FALSE(test::scalar_bisected(hopeless.x_old, hopeless.dt, hopeless.a, 3, spans));
  for (const bool row_pass : {true, false}) {
    CAPTURE(row_pass);
    const auto s = session("scalar_substepping", [&](auto& c) { c.row_pass = row_pass; });
    const auto e = convergence_error([&] {
      static_cast<void>(s.forward(scalar_inputs({converges, rescued, hopeless, nan_input})));
    });
    check_per_row_detail(e);
    CHECK(at::equal(e.reasons(), reasons_of({RowFailure::none, RowFailure::none,
                                             RowFailure::not_converged, RowFailure::non_finite})));
    CHECK(e.residual_norms()[2].item<double>() > s.solver_config().atol);
    CHECK(std::isnan(e.residual_norms()[3].item<double>()));
  }
}

TEST_CASE("a Krylov step: rows at the iteration cap are not_converged, a NaN row non_finite") {
  const test::Reference ref("perzyna_gmres");
  auto inputs = ref.group("s0/in");
  const auto elastic = test::every_other_row_elastic(inputs); // the others need up to nine
  inputs["E"][0][0] = not_a_number;
  const auto s = session("perzyna_gmres", [](auto& c) { c.miters = 6; });
  const auto e = convergence_error([&] { static_cast<void>(s.forward(inputs)); });
  check_per_row_detail(e);
  auto expected = at::where(elastic, static_cast<std::int64_t>(RowFailure::none),
                            static_cast<std::int64_t>(RowFailure::not_converged))
                      .to(at::kChar);
  expected[0] = static_cast<std::int8_t>(RowFailure::non_finite);
  CHECK(at::equal(e.reasons(), expected));
  CHECK((e.residual_norms().index({~elastic}) > s.solver_config().atol).all().item<bool>());
}

TEST_CASE("a sub-batched model: one reason per material point, a NaN point non_finite") {
  const test::Reference ref("binned_precipitation");
  auto inputs = ref.group("s2/in");
  const auto rows = inputs.begin()->second.size(0);
  REQUIRE(rows > 3);
  for (auto& [name, value] : inputs)
    if (value.is_floating_point() && value.dim() > 0 && value.size(0) == rows)
      value = value.clone();
  // The first batched input of row 3: NaN through the point's residual.
  for (auto& [name, value] : inputs)
    if (value.is_floating_point() && value.dim() > 0 && value.size(0) == rows) {
      value[3].fill_(not_a_number);
      break;
    }
  const auto e = convergence_error(
      [&] { static_cast<void>(session("binned_precipitation").forward(inputs)); });
  check_per_row_detail(e);
  CHECK(e.reasons().sizes() == at::IntArrayRef{rows});
  auto expected = at::zeros({rows}, at::kChar);
  expected[3] = static_cast<std::int8_t>(RowFailure::non_finite);
  CHECK(at::equal(e.reasons(), expected));
  // in chunks of 2 on 2 lanes: the same
  const auto m = load_model(test::stub("binned_precipitation", "model"), "model",
                            SyncChunking{.batch_size = 2, .cpu_lanes = 2});
  const auto chunked = convergence_error([&] { static_cast<void>(m.forward(inputs)); });
  CHECK(at::equal(chunked.reasons(), expected));
  CHECK(same_norms(chunked.residual_norms(), e.residual_norms()));
}

TEST_CASE("newton_solve decides the reasons itself: a zero pivot among two unknowns, in the "
          "row pass's SIMD lanes and on the tensor path") {
  // u^3 = a per unknown, two unknowns a row (A = diag(3 u^2)); Newton from u0.
  auto graphs = test::cube_root();
  graphs.jacobian = [](const std::vector<at::Tensor>& args) {
    const auto& u = args[0];
    return std::vector<at::Tensor>{at::diag_embed(3 * u.square()), args[1] - u.pow(3)};
  };
  graphs.solve = [](const std::vector<at::Tensor>& ops) { // b / diag(A): inf at a zero pivot
    return std::vector<at::Tensor>{ops[1] / at::diagonal(ops[0], 0, 1, 2)};
  };
  // rows: converges; a zero pivot (u = 0 in the first unknown); NaN given; too far for 25
  // iterations (from 1 to 1e10, about 2/3 closer each); then 8 rows that converge, so that
  // the lanes are full.
  std::vector<double> a = {8, 8, 8, 8, not_a_number, 8, 1e30, 1e30}, u0 = {1, 1, 0, 1, 1, 1, 1, 1};
  for (int k = 0; k < 8; ++k) {
    a.insert(a.end(), {27, 64});
    u0.insert(u0.end(), {2, 3});
  }
  const auto rows = static_cast<std::int64_t>(a.size() / 2);
  const auto given = at::tensor(a, at::kDouble).reshape({rows, 2});
  const auto guess = at::tensor(u0, at::kDouble).reshape({rows, 2});
  auto expected = at::zeros({rows}, at::kChar);
  expected[1] = static_cast<std::int8_t>(RowFailure::singular);
  expected[2] = static_cast<std::int8_t>(RowFailure::non_finite);
  expected[3] = static_cast<std::int8_t>(RowFailure::not_converged);
  for (const bool row_pass : {true, false}) {
    CAPTURE(row_pass);
    SolverConfig config;
    config.row_pass = row_pass;
    const auto result = test::newton_solve(graphs, {guess}, {given}, {}, config);
    REQUIRE(result.reasons.defined());
    CHECK(at::equal(result.reasons, expected));
    CHECK(at::equal(result.converged, expected == 0));
    // every row converging: nothing decided, nothing allocated
    const auto easy = at::tensor({0, 4, 5}, at::kLong);
    const auto fine = test::newton_solve(graphs, {guess.index_select(0, easy)},
                                         {given.index_select(0, easy)}, {}, config);
    CHECK(fine.converged.all().item<bool>());
    CHECK_FALSE(fine.reasons.defined());
  }
}
