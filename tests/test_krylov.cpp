// Matrix-free Krylov Newton steps: GMRES per row against dense solves and NEML2's measured
// behaviour (restarts, left preconditioning; the iteration cap, kept inside a cycle), the
// preconditioner's cache strategies counted through graphs of our own, and the compiled
// Perzyna models (GMRES, block Jacobi, chord) against eager NEML2 and the direct solve.

#include <functional>
#include <limits>

#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "planned_newton.hpp"
#include "scratch.hpp"

using namespace neml2;
using test::contains;
using test::session;
using test::step_name;

namespace {

using Krylov = SolverConfig::Krylov;

// Dense per-row operators `(rows, n, n)`, counting their applications.
struct Dense {
  at::Tensor a;
  int applies = 0, preconditions = 0;
  std::function<at::Tensor(const at::Tensor&)> inverse; // M^-1 r, or none

  neml2::detail::KrylovOperators ops() {
    neml2::detail::KrylovOperators o;
    o.apply = [this](const at::Tensor& v) {
      ++applies;
      return at::matmul(a, v.unsqueeze(2)).squeeze(2);
    };
    if (inverse)
      o.precondition = [this](const at::Tensor& r) {
        ++preconditions;
        return inverse(r);
      };
    return o;
  }
};

at::Tensor well_conditioned(std::int64_t rows, std::int64_t n, double seed) {
  const auto noise = 0.5 * at::sin(at::arange(rows * n * n, at::kDouble) * seed);
  return at::eye(n, at::kDouble).expand({rows, n, n}) * 4 + noise.reshape({rows, n, n});
}

// The cyclic shift e_i -> e_{i+1}: GMRES(m) from b = e_1 makes no progress until m = n.
at::Tensor cyclic_shift(std::int64_t n) {
  return at::roll(at::eye(n, at::kDouble), 1, 0).unsqueeze(0);
}

at::Tensor e1(std::int64_t n) {
  auto b = at::zeros({1, n}, at::kDouble);
  b[0][0] = 1;
  return b;
}

Krylov tight() {
  Krylov k;
  k.rel_tol = 1e-13;
  return k;
}

} // namespace

TEST_CASE("GMRES solves each row to its tolerance, each row on its own") {
  Dense op{well_conditioned(5, 9, 17)};
  const auto b = at::cos(at::arange(45, at::kDouble)).reshape({5, 9});
  const auto solved = neml2::detail::gmres(op.ops(), b, tight());
  CHECK(solved.converged.all().item<bool>());
  test::check_close(solved.x, at::linalg_solve(op.a, b), "x", 1e-11);
  // A row alone and beside the others: the same numbers.
  for (std::int64_t r : {0, 3}) {
    Dense one{op.a.narrow(0, r, 1)};
    const auto alone = neml2::detail::gmres(one.ops(), b.narrow(0, r, 1), tight());
    CHECK(at::equal(alone.x, solved.x.narrow(0, r, 1)));
    CHECK(alone.iterations.item<std::int64_t>() == solved.iterations[r].item<std::int64_t>());
  }
  SUBCASE("rel_tol is relative to ||b||: scaling b changes no iteration") {
    Krylov loose;
    loose.rel_tol = 0.1;
    const auto small = neml2::detail::gmres(op.ops(), b, loose);
    const auto large = neml2::detail::gmres(op.ops(), b * 1e6, loose);
    CHECK(at::equal(small.iterations, large.iterations));
    CHECK((small.iterations <= solved.iterations).all().item<bool>());
    CHECK((small.iterations < solved.iterations).any().item<bool>());
    const auto residual = (b - at::matmul(op.a, small.x.unsqueeze(2)).squeeze(2)).norm(2, 1);
    CHECK((residual <= 0.1 * b.norm(2, 1)).all().item<bool>());
  }
  SUBCASE("abs_tol alone") {
    Krylov absolute;
    absolute.rel_tol = 0;
    absolute.abs_tol = 0.3;
    const auto s = neml2::detail::gmres(op.ops(), b, absolute);
    const auto residual = (b - at::matmul(op.a, s.x.unsqueeze(2)).squeeze(2)).norm(2, 1);
    CHECK((residual <= 0.3).all().item<bool>());
    CHECK((s.iterations < solved.iterations).any().item<bool>()); // it stopped early
  }
  SUBCASE("rows outside the active set are not solved") {
    const auto active = at::tensor({1, 0, 1, 0, 1}, at::kInt).to(at::kBool);
    const auto s = neml2::detail::gmres(op.ops(), b, tight(), active);
    CHECK(at::equal(s.x.index({~active}), at::zeros({2, 9}, at::kDouble)));
    CHECK((s.iterations.index({~active}) == 0).all().item<bool>());
    test::check_close(s.x.index({active}), solved.x.index({active}), "active rows", 1e-13);
  }
}

TEST_CASE("GMRES's per-row CPU loops and its tensor operations (other devices) agree") {
  using neml2::detail::GmresKernel;
  Dense op{well_conditioned(5, 9, 17)};
  const auto b = at::cos(at::arange(45, at::kDouble)).reshape({5, 9});
  const auto active = at::tensor({1, 1, 0, 1, 1}, at::kInt).to(at::kBool);
  auto k = tight();
  k.restart = 3; // several cycles, rows finishing in different ones
  const auto check_same = [&](const char* what) {
    CAPTURE(what);
    const auto loops = neml2::detail::gmres(op.ops(), b, k, active, GmresKernel::automatic);
    const auto tensors = neml2::detail::gmres(op.ops(), b, k, active, GmresKernel::tensors);
    CHECK(at::equal(loops.iterations, tensors.iterations));
    CHECK(at::equal(loops.converged, tensors.converged));
    test::check_close(loops.x, tensors.x, "x", 1e-12);
    CHECK(loops.converged.index({active}).all().item<bool>());
    CHECK((loops.iterations.index({~active}) == 0).all().item<bool>());
  };
  check_same("plain");
  { // one cycle of more steps than a cycle first makes room for (8)
    // Eigenvalues spread over 1..24: GMRES needs about one step per eigenvalue.
    Dense big{at::diag_embed(at::arange(1, 25, at::kDouble).expand({2, 24})) +
              0.1 * well_conditioned(2, 24, 3)};
    const auto rhs = at::cos(at::arange(48, at::kDouble)).reshape({2, 24});
    const auto loops = neml2::detail::gmres(big.ops(), rhs, tight());
    const auto tensors = neml2::detail::gmres(big.ops(), rhs, tight(), {}, GmresKernel::tensors);
    CHECK((loops.iterations > 8).all().item<bool>());
    CHECK(at::equal(loops.iterations, tensors.iterations));
    test::check_close(loops.x, at::linalg_solve(big.a, rhs), "x", 1e-11);
    test::check_close(tensors.x, at::linalg_solve(big.a, rhs), "x", 1e-11);
  }
  op.inverse = [](const at::Tensor& r) { return r * at::arange(1, 10, at::kDouble); };
  check_same("preconditioned");
  // A float32 system through the loops' float instantiation.
  Dense single{op.a.to(at::kFloat)};
  Krylov f;
  f.rel_tol = 1e-5;
  const auto loops = neml2::detail::gmres(single.ops(), b.to(at::kFloat), f);
  const auto tensors =
      neml2::detail::gmres(single.ops(), b.to(at::kFloat), f, {}, GmresKernel::tensors);
  CHECK(at::equal(loops.iterations, tensors.iterations));
  test::check_close(loops.x.to(at::kDouble), at::linalg_solve(op.a, b), "float x", 1e-4);
}

TEST_CASE("GMRES restarts: GMRES(m) on the cyclic shift stagnates until m = n") {
  constexpr std::int64_t n = 6;
  Dense op{cyclic_shift(n)};
  auto k = tight();
  k.restart = n;
  const auto full = neml2::detail::gmres(op.ops(), e1(n), k);
  CHECK(full.converged.item<bool>());
  CHECK(full.iterations.item<std::int64_t>() == n);
  test::check_close(full.x, at::linalg_solve(op.a, e1(n)), "x", 1e-12);

  // restart = 2, max_its = 5: no progress at all (a solver that ignored the restart would
  // converge), and the cap holds inside the third cycle (NEML2 would finish it: 6 steps).
  op.applies = 0;
  k.restart = 2;
  k.max_its = 5;
  const auto restarted = neml2::detail::gmres(op.ops(), e1(n), k);
  CHECK_FALSE(restarted.converged.item<bool>());
  CHECK(restarted.iterations.item<std::int64_t>() == 5);
  CHECK(restarted.x.abs().max().item<double>() < 1e-14);
  CHECK(op.applies == 5 + 2); // and the true residual after the first two cycles
}

TEST_CASE("GMRES stops at max_its inside a cycle, with the iterate of that many steps") {
  using neml2::detail::GmresKernel;
  // Eigenvalues spread over 1..9: GMRES needs about one step per eigenvalue.
  Dense op{at::diag_embed(at::arange(1, 10, at::kDouble).expand({3, 9})) +
           0.1 * well_conditioned(3, 9, 5)};
  const auto b = at::cos(at::arange(27, at::kDouble)).reshape({3, 9});
  REQUIRE((neml2::detail::gmres(op.ops(), b, tight()).iterations > 3).all().item<bool>());
  for (const auto kernel : {GmresKernel::automatic, GmresKernel::tensors}) {
    CAPTURE(static_cast<int>(kernel));
    auto capped = tight(); // restart 40
    capped.max_its = 3;
    op.applies = 0;
    const auto s = neml2::detail::gmres(op.ops(), b, capped, {}, kernel);
    CHECK((s.iterations == 3).all().item<bool>());
    CHECK(op.applies == 3); // no true residual once every row is at the cap
    CHECK_FALSE(s.converged.any().item<bool>());
    // The same three steps as one cycle of GMRES(3): the minimiser over K_3.
    auto cycle = capped;
    cycle.restart = 3;
    test::check_close(s.x, neml2::detail::gmres(op.ops(), b, cycle, {}, kernel).x, "x", 1e-14);
  }
}

TEST_CASE("GMRES rows that break down stop with what they had; the others are exact") {
  using neml2::detail::GmresKernel;
  constexpr std::int64_t n = 4;
  // Row 0 well conditioned; row 1 maps e_1 to 0 (a zero pivot at the first step: A is
  // singular on the Krylov space); row 2's operator returns NaN (a graph that failed).
  auto a = well_conditioned(3, n, 7).clone();
  a[1].zero_();
  a[1][0][1] = 1;
  a[2].fill_(std::numeric_limits<double>::quiet_NaN());
  Dense op{a};
  auto b = at::cos(at::arange(3 * n, at::kDouble)).reshape({3, n});
  b[1] = e1(n)[0];
  for (const auto kernel : {GmresKernel::automatic, GmresKernel::tensors}) {
    CAPTURE(static_cast<int>(kernel));
    op.applies = 0;
    const auto s = neml2::detail::gmres(op.ops(), b, tight(), {}, kernel);
    CHECK(at::isfinite(s.x).all().item<bool>());
    CHECK(at::equal(s.converged, at::tensor({1, 0, 0}, at::kInt).to(at::kBool)));
    CHECK(s.x.narrow(0, 1, 2).abs().max().item<double>() == 0); // no step survived
    test::check_close(s.x[0], at::linalg_solve(a[0], b[0]), "row 0", 1e-12);
    CHECK(op.applies < 2 * n); // the broken rows are not restarted over and over
  }
}

TEST_CASE("GMRES is left-preconditioned: M^-1 applied to every Arnoldi vector and tested") {
  Dense op{well_conditioned(3, 8, 5)};
  const auto b = at::cos(at::arange(24, at::kDouble)).reshape({3, 8});
  const auto plain = neml2::detail::gmres(op.ops(), b, tight());
  // The exact inverse: one step (a preconditioner never applied would take ~8).
  op.inverse = [&](const at::Tensor& r) { return at::linalg_solve(op.a, r); };
  const auto exact = neml2::detail::gmres(op.ops(), b, tight());
  CHECK((exact.iterations == 1).all().item<bool>());
  CHECK((plain.iterations > 1).all().item<bool>());
  CHECK(op.preconditions == 1 + 1 + 1); // M^-1 b, one Arnoldi vector, the true residual
  test::check_close(exact.x, plain.x, "x", 1e-10);
  // NEML2 tests the preconditioned residual against abs_tol and rel_tol ||b|| (measured: a
  // preconditioner scaled by 1e-6 stops before any step with abs_tol = 1e-3, and with
  // rel_tol = 0.1; one scaled by 1e6 iterates longer): so do we.
  Krylov absolute;
  absolute.rel_tol = 0;
  absolute.abs_tol = 1e-3;
  Krylov relative;
  relative.rel_tol = 0.1;
  for (const auto& k : {absolute, relative}) {
    op.inverse = [](const at::Tensor& r) { return r * 1e-6; };
    const auto small = neml2::detail::gmres(op.ops(), b, k);
    CHECK((small.iterations == 0).all().item<bool>());
    CHECK(small.converged.all().item<bool>());
  }
  op.inverse = {};
  const auto unscaled = neml2::detail::gmres(op.ops(), b, relative);
  op.inverse = [](const at::Tensor& r) { return r * 1e6; };
  const auto large = neml2::detail::gmres(op.ops(), b, relative);
  CHECK((large.iterations > unscaled.iterations).all().item<bool>());
}

namespace {

// r(u) = A u + c u^3 - f per row (c = 0: linear, one exact step), through counting graphs
// shaped as an artifact's: matvec (u, g, v) -> J v; the preconditioner's state is diag(J).
struct Cubic {
  at::Tensor a, c; // (rows, n, n), (rows, 1)
  at::Tensor f;    // (rows, n): the right-hand side, ones if undefined
  int setups = 0, matvecs = 0;
  std::vector<std::int64_t> matvec_rows, setup_rows;

  neml2::detail::NewtonGraphs graphs(bool preconditioned) {
    neml2::detail::NewtonGraphs g;
    const auto rows_of = [this](const std::vector<at::Tensor>& args) {
      // The working set's rows: the givens carry each row's index.
      return args[1].select(1, 0).to(at::kLong);
    };
    g.residual = [this, rows_of](const std::vector<at::Tensor>& args) {
      const auto& u = args[0];
      const auto r = rows_of(args);
      const auto au = at::matmul(a.index_select(0, r), u.unsqueeze(2)).squeeze(2);
      const auto rhs = f.defined() ? f.index_select(0, r) : at::ones_like(u);
      return std::vector<at::Tensor>{rhs - au - c.index_select(0, r) * u.pow(3)};
    };
    g.matvec = [this, rows_of](const std::vector<at::Tensor>& args) {
      ++matvecs;
      matvec_rows.push_back(args[0].size(0));
      const auto& u = args[0];
      const auto& v = args[2];
      const auto r = rows_of(args);
      const auto av = at::matmul(a.index_select(0, r), v.unsqueeze(2)).squeeze(2);
      return std::vector<at::Tensor>{av + 3 * c.index_select(0, r) * u.square() * v};
    };
    if (preconditioned) {
      g.precond_setup = [this, rows_of](const std::vector<at::Tensor>& args) {
        ++setups;
        setup_rows.push_back(args[0].size(0));
        const auto r = rows_of(args);
        const auto diag = at::diagonal(a.index_select(0, r), 0, 1, 2);
        return std::vector<at::Tensor>{diag + 3 * c.index_select(0, r) * args[0].square()};
      };
      g.precond_apply = [](const std::vector<at::Tensor>& args) {
        return std::vector<at::Tensor>{args[1] / args[0]};
      };
    }
    return g;
  }

  [[nodiscard]] neml2::detail::NewtonResult solve(neml2::detail::NewtonGraphs g,
                                                  SolverConfig config) const {
    const auto rows = a.size(0), n = a.size(1);
    const auto index = at::arange(rows, at::kDouble).unsqueeze(1);
    config.solver_kind = "krylov";
    return test::newton_solve(g, {at::zeros({rows, n}, at::kDouble)}, {index}, {}, config);
  }
};

Cubic cubic(std::int64_t rows, std::int64_t nonlinear) {
  constexpr std::int64_t n = 5;
  auto c = at::zeros({rows, 1}, at::kDouble);
  c.narrow(0, rows - nonlinear, nonlinear).fill_(2.0);
  return {well_conditioned(rows, n, 3), c};
}

} // namespace

TEST_CASE("Newton with GMRES steps: converged rows leave, the rest keep iterating") {
  auto m = cubic(100, 10); // 90 linear rows (one step), 10 cubic ones
  SolverConfig config;
  config.rtol = 1e-12;
  config.krylov.rel_tol = 1e-10;
  const auto solved = m.solve(m.graphs(false), config);
  CHECK(solved.converged.all().item<bool>());
  CHECK(solved.iterations > 2);
  // The residual at the solution, from its definition.
  const auto r =
      1 - at::matmul(m.a, solved.u[0].unsqueeze(2)).squeeze(2) - m.c * solved.u[0].pow(3);
  CHECK(r.abs().max().item<double>() < 1e-9);
  // The active set: after the linear rows converge, matvec sees the cubic rows alone.
  CHECK(m.matvec_rows.front() == 100);
  CHECK(m.matvec_rows.back() == 10);
}

TEST_CASE("the preconditioner's cache strategies: rebuilt every step, once (chord), or when "
          "a solve took too long (max_its)") {
  SolverConfig config;
  config.krylov.rel_tol = 1e-3;
  auto none = cubic(4, 4);
  const auto a = none.solve(none.graphs(true), config);
  REQUIRE(a.converged.all().item<bool>());
  CHECK(none.setups == a.iterations); // one per Newton step

  auto chord = cubic(4, 4);
  config.krylov.cache_strategy = "chord";
  const auto b = chord.solve(chord.graphs(true), config);
  REQUIRE(b.converged.all().item<bool>());
  CHECK(chord.setups == 1);
  test::check_close(b.u[0], a.u[0], "chord solution", 1e-8);
  // A new solve builds it again: chord keeps it for one solve, not across calls.
  static_cast<void>(chord.solve(chord.graphs(true), config));
  CHECK(chord.setups == 2);

  // max_its: rebuilt after a linear solve of more than cache_max_its iterations. With a
  // bar no solve passes (0) it is rebuilt every step; with a bar none reaches, never.
  config.krylov.cache_strategy = "max_its";
  config.krylov.cache_max_its = 0;
  auto always = cubic(4, 4);
  const auto c = always.solve(always.graphs(true), config);
  CHECK(always.setups == c.iterations);
  config.krylov.cache_max_its = 1000;
  auto never = cubic(4, 4);
  static_cast<void>(never.solve(never.graphs(true), config));
  CHECK(never.setups == 1);
}

namespace {

Session session_at(const std::filesystem::path& root) {
  return {test::load_artifact(root), "cpu"};
}

constexpr const char* krylov_models[] = {"perzyna_gmres", "perzyna_gmres_bjac",
                                         "perzyna_gmres_chord"};
constexpr int steps = 5;

} // namespace

TEST_CASE("Krylov artifacts: the matvec and preconditioner graphs and the krylov block") {
  const auto a =
      read_artifact(resolve_artifact_root(test::stub("perzyna_gmres_chord", "model"), "model"));
  REQUIRE(a.segments.size() == 1);
  const auto& s = std::get<ImplicitSegment>(a.segments[0]);
  CHECK(s.matvec_package == "model_matvec.pt2");
  CHECK(s.precond_setup_package == "model_precond_setup.pt2");
  CHECK(s.precond_apply_package == "model_precond_apply.pt2");
  CHECK(s.solve_package.empty());
  CHECK(s.solve_ift_package == "model_solve_ift.pt2"); // the input sensitivity stays direct
  REQUIRE(a.solver_config);
  CHECK(a.solver_config->solver_kind == "krylov");
  const auto& k = a.solver_config->krylov;
  CHECK(k.method == "gmres");
  CHECK(k.restart == 40);
  CHECK(k.max_its == 1000);
  CHECK(k.abs_tol == 0);
  CHECK(k.rel_tol == 1e-4);
  CHECK(k.cache_strategy == "chord");
  CHECK(k.cache_max_its == 10);
  const auto plain =
      read_artifact(resolve_artifact_root(test::stub("perzyna_gmres", "model"), "model"));
  CHECK(std::get<ImplicitSegment>(plain.segments[0]).precond_setup_package.empty());
  CHECK(plain.solver_config->krylov.cache_strategy == "none");
}

// Newton's tolerances tightened so far that any two converged solutions agree to 1e-10:
// with the artifacts' rtol = 1e-8 an inexact (Krylov) Newton stops at another point inside
// the tolerance than a quadratically converging direct one (6e-5 apart relative, on the
// equivalent plastic strain, whose residual is small beside the stress's).
void tighten(Session& s) {
  auto config = s.solver_config();
  config.atol = 1e-13;
  config.rtol = 1e-14;
  config.miters = 60;
  config.krylov.rel_tol = 1e-10;
  s.set_solver_config(config);
}

// f(session, its eager reference, the direct-solve model tightened) for each Krylov model.
template <class F>
void each_krylov_model(F&& f) {
  auto direct = session("perzyna_viscoplasticity");
  tighten(direct);
  for (const std::string name : krylov_models) {
    CAPTURE(name);
    auto s = session(name);
    f(s, test::Reference(name), direct);
  }
}

TEST_CASE("every step of each Krylov model against eager NEML2 and against the direct solve") {
  each_krylov_model([](Session& s, const test::Reference& ref, const Session& direct) {
    for (int n = 0; n < steps; ++n)
      test::check_forward(s, ref, step_name(n), 1e-8);
    tighten(s);
    for (int n = 0; n < steps; ++n)
      test::check_close(s.forward(ref.group(step_name(n) + "/in")),
                        direct.forward(ref.group(step_name(n) + "/in")),
                        step_name(n) + " vs direct", 1e-10);
  });
}

TEST_CASE("Jacobians of Krylov models: eager NEML2 and the direct solve") {
  each_krylov_model([](Session& s, const test::Reference& ref, const Session& direct) {
    const auto check = [&](bool against_direct) {
      for (int n = 1; n < steps; ++n) {
        const auto inputs = ref.group(step_name(n) + "/in");
        const auto [out, J] = s.jacobian(inputs);
        const auto [direct_out, direct_J] = direct.jacobian(inputs);
        for (const auto& [o, blocks] : J)
          for (const auto& [i, block] : blocks) {
            const auto& expected =
                against_direct ? direct_J.at(o).at(i) : ref[step_name(n) + "/jac/" + o + "/" + i];
            const auto scale = std::max(expected.abs().max().item<double>(), 1e-6);
            const auto error = (block - expected).abs().max().item<double>() / scale;
            CHECK_MESSAGE(error <= (against_direct ? 1e-10 : 1e-8),
                          step_name(n) << " d" << o << "/d" << i
                                       << (against_direct ? " vs direct" : "") << ": " << error);
          }
      }
    };
    check(false);
    tighten(s);
    check(true);
  });
}

TEST_CASE("an iteration cap of 1 in the Krylov block fails the rows one step cannot solve") {
  // Linear rows: A = 2 I (one GMRES step is exact) beside the cyclic shift from e_1 (GMRES(1)
  // makes no progress at all, GMRES(5) solves it).
  constexpr std::int64_t rows = 6, n = 5;
  const auto shift_rows = at::arange(rows, at::kLong).remainder(2) == 1;
  Cubic m{at::where(shift_rows.reshape({rows, 1, 1}), cyclic_shift(n), 2 * at::eye(n, at::kDouble)),
          at::zeros({rows, 1}, at::kDouble),
          at::where(shift_rows.unsqueeze(1), e1(n), at::ones({rows, n}, at::kDouble))};
  SolverConfig config;
  config.miters = 8;
  const auto solved = m.solve(m.graphs(false), config);
  CHECK(solved.converged.all().item<bool>());
  config.krylov.restart = 1;
  config.krylov.max_its = 1;
  const auto capped = m.solve(m.graphs(false), config);
  CHECK(at::equal(capped.converged, ~shift_rows));
  test::check_close(capped.u[0].index({~shift_rows}), solved.u[0].index({~shift_rows}),
                    "rows that converge", 1e-14);
  CHECK(std::isfinite(capped.worst_residual));
  CHECK(capped.worst_residual == doctest::Approx(1.0)); // ||e_1||: no progress
}

TEST_CASE("per-row failure of a Krylov model: the mask and the rows that converged") {
  // The first step, every other row's strain cut to elastic; six Newton iterations are too
  // few for the plastic rows (they need up to nine), enough for the elastic ones.
  const test::Reference ref("perzyna_gmres");
  auto inputs = ref.group("s0/in");
  const auto elastic = test::every_other_row_elastic(inputs);
  auto s = session("perzyna_gmres");
  const auto converged = s.forward(inputs);
  auto config = s.solver_config();
  config.miters = 6;
  s.set_solver_config(config);
  try {
    static_cast<void>(s.forward(inputs));
    FAIL("expected a ConvergenceError");
  } catch (const ConvergenceError& e) {
    CHECK(at::equal(e.converged_mask(), elastic));
    for (const auto& [name, value] : converged) {
      test::check_close(e.outputs().at(name).index({elastic}), value.index({elastic}),
                        "elastic rows " + name, 1e-13);
      CHECK(at::isnan(e.outputs().at(name).index({~elastic})).all().item<bool>());
    }
  }
}

TEST_CASE("Krylov settings: changed at run time, checked, unknown ones refused") {
  auto s = session("perzyna_gmres");
  auto config = s.solver_config();
  config.krylov.method = "bicgstab";
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }),
                 "krylov.method is 'bicgstab'; the Krylov methods run here: gmres"));
  config.krylov.method = "gmres";
  config.krylov.cache_strategy = "sometimes";
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }),
                 "the cache strategies run here: none, chord, max_its"));
  config.krylov.cache_strategy = "none";
  config.krylov.restart = 0;
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }), "restart is 0"));
  config.krylov.restart = 40;
  config.solver_kind = "direct";
  CHECK(contains(test::fatal_message([&] { s.set_solver_config(config); }), "solver_kind"));

  test::Scratch scratch;
  const auto root = scratch.copy_root("perzyna_gmres", "model");
  const auto rewrite = test::metadata_rewriter(root);
  rewrite("\"method\": \"gmres\"", "\"method\": \"bicgstab\"");
  CHECK(contains(test::fatal_message([&] { static_cast<void>(read_artifact(root)); }),
                 "solver_config.krylov.method is 'bicgstab'; the Krylov methods run here: gmres"));
  rewrite("\"cache_strategy\": \"none\"", "\"cache_strategy\": \"lazy\"");
  CHECK(contains(test::fatal_message([&] { static_cast<void>(read_artifact(root)); }),
                 "cache_strategy is 'lazy'"));
  rewrite("\"solver_kind\": \"krylov\"", "\"solver_kind\": \"direct\"");
  CHECK(contains(test::fatal_message([&] { static_cast<void>(read_artifact(root)); }),
                 "a matvec_package (a Krylov solve) under a direct solver_kind"));
}

TEST_CASE("an iterative input sensitivity (no solve_ift graph): -A^{-1} B solved here") {
  test::Scratch scratch;
  const auto root = scratch.copy_root("perzyna_gmres", "model");
  auto meta = test::read(root / "metadata.json");
  const auto cut = [&](const std::string& from, const std::string& to) {
    const auto at = meta.find(from);
    REQUIRE(at != std::string::npos);
    meta.replace(at, from.size(), to);
  };
  cut("\"solve_ift_package\": \"model_solve_ift.pt2\",", "");
  cut("\"input_sensitivity\": {\n        \"kind\": \"direct\"",
      "\"input_sensitivity\": {\n        \"kind\": \"krylov\"");
  scratch.write("model/metadata.json", meta);
  const auto a = read_artifact(root);
  REQUIRE(std::get<ImplicitSegment>(a.segments[0]).iterative_input_sensitivity);
  const auto iterative = session_at(root);
  const auto baked = session("perzyna_gmres");
  const test::Reference ref("perzyna_gmres");
  const auto inputs = ref.group("s3/in");
  const auto [out, J] = iterative.jacobian(inputs);
  const auto [baked_out, baked_J] = baked.jacobian(inputs);
  for (const auto& [o, blocks] : baked_J)
    for (const auto& [i, block] : blocks)
      test::check_close(J.at(o).at(i), block, "d" + o + "/d" + i, 1e-10);
}
