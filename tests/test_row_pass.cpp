// Newton's row pass on the CPU (src/implicit/newton_rows.cpp: each row's LU, update, norms,
// flags and compaction in plain C++) against the tensor path it replaces there (row_pass =
// false: the solve graphs and tensor operations, as on accelerators), on every implicit
// model in models/, every derivative, with failing rows, substepping and line searches; the
// working set through the graph-call observer; the row kernels against ATen's solve.
// (The rest of the suite runs the row pass against eager NEML2: it is the CPU's default.)

#include <algorithm>
#include <filesystem>
#include <functional>
#include <thread>

#include <ATen/Parallel.h>
#include <c10/util/ScopeExit.h>

#include "cube_root.hpp"
#include "graph/graph_calls.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "planned_newton.hpp"
#include "tiled.hpp"

using namespace neml2;
using test::tiled_times;

namespace {

Session session(const std::string& artifact, bool row_pass,
                const std::function<void(SolverConfig&)>& change = {}) {
  return test::session(artifact, [&](SolverConfig& config) {
    config.row_pass = row_pass;
    if (change)
      change(config);
  });
}

// What a call gave: its positional results (outputs, then derivatives), the scale group of
// each (its own, or for a Jacobian block every block of the same output), and the
// converged mask when some rows failed (undefined when none did).
struct Outcome {
  std::vector<at::Tensor> values;
  std::vector<std::string> groups;
  at::Tensor converged;
};

// A call's outputs, each its own group, then its derivative blocks grouped by output.
struct Positional {
  std::vector<at::Tensor> values;
  std::vector<std::string> groups;

  void outputs(const TensorMap& map) {
    for (const auto& [name, value] : map) {
      values.push_back(value);
      groups.push_back("value " + name);
    }
  }
  void blocks(const VariablePairJacobian& J) {
    for (const auto& [o, blocks] : J)
      for (const auto& [i, block] : blocks) {
        values.push_back(block);
        groups.push_back("d " + o);
      }
  }
};

// On a ConvergenceError, its positional results: the outputs, then the blocks in the
// artifact's order of `pairs` (each grouped by its output).
Outcome outcome(const std::function<Positional()>& call, std::size_t outputs,
                const std::vector<std::pair<std::string, std::string>>& pairs) {
  try {
    auto p = call();
    return {p.values, p.groups, {}};
  } catch (const ConvergenceError& e) {
    REQUIRE(e.per_row());
    std::vector<std::string> groups;
    for (std::size_t k = 0; k < e.results().size(); ++k)
      groups.push_back(k < outputs                  ? "value " + std::to_string(k)
                       : k - outputs < pairs.size() ? "d " + pairs[k - outputs].first
                                                    : "value " + std::to_string(k));
    return {e.results(), groups, e.converged_mask()};
  }
}

// Every call the session has, as positional results.
std::map<std::string, Outcome> every_call(const Session& s, const TensorMap& inputs) {
  const auto& artifact = s.artifact();
  const auto n = s.output_names().size();
  std::map<std::string, Outcome> calls;
  calls["forward"] = outcome(
      [&] {
        Positional p;
        p.outputs(s.forward(inputs));
        return p;
      },
      n, {});
  calls["jacobian"] = outcome(
      [&] {
        const auto [out, J] = s.jacobian(inputs);
        Positional p;
        p.outputs(out);
        p.blocks(J);
        return p;
      },
      n, artifact.derivatives);
  calls["jvp"] = outcome(
      [&] {
        TensorMap tangents;
        for (const auto& [name, value] : inputs)
          tangents.emplace(
              name, at::sin(at::arange(value.numel(), value.options())).reshape(value.sizes()));
        const auto [out, d] = s.jvp(inputs, tangents);
        Positional p;
        p.outputs(out);
        for (const auto& [name, value] : d) {
          p.values.push_back(value);
          p.groups.push_back("tangent " + name);
        }
        return p;
      },
      n, {});
  if (!s.named_parameters().empty()) {
    calls["param_jacobian"] = outcome(
        [&] {
          const auto [out, P] = s.param_jacobian(inputs);
          Positional p;
          p.outputs(out);
          p.blocks(P);
          return p;
        },
        n, artifact.parameter_derivatives);
    calls["param_vjp"] = outcome(
        [&] {
          TensorMap cotangents;
          for (const auto& name : s.output_names())
            cotangents.emplace(name, at::ones_like(s.forward(inputs).at(name)));
          Positional p;
          p.outputs(s.param_vjp(inputs, cotangents));
          return p;
        },
        0, {});
  }
  return calls;
}

// The two paths agree: the same rows fail, the same NaNs, and every other value to 1e-12
// of the largest in its scale group, a value's own tensor's (1e-6 at least). Derivatives
// (Jacobian blocks, tangents), through -A^{-1} B solved by our LU or by the solve_ift
// graph's LAPACK, to 1e-11 of the largest block of their output: norm-wise, as a solve's
// accuracy is stated (two backward-stable solves differ by up to cond(A) eps; Chaboche's
// plastic-strain rows come within 1e-11, every other block within 1e-12).
void check_same(const Outcome& rows, const Outcome& tensors, const std::string& what) {
  INFO(what);
  REQUIRE(rows.converged.defined() == tensors.converged.defined());
  if (rows.converged.defined())
    CHECK(at::equal(rows.converged, tensors.converged));
  REQUIRE(rows.values.size() == tensors.values.size());
  REQUIRE(rows.groups == tensors.groups);
  std::map<std::string, double> scale;
  for (std::size_t k = 0; k < tensors.values.size(); ++k) {
    const auto& b = tensors.values[k];
    const auto finite = at::isfinite(b);
    auto& s = scale.try_emplace(tensors.groups[k], 1e-6).first->second;
    if (finite.any().item<bool>())
      s = std::max(s, b.index({finite}).abs().max().item<double>());
  }
  for (std::size_t k = 0; k < rows.values.size(); ++k) {
    CAPTURE(k);
    CAPTURE(tensors.groups[k]);
    const auto& a = rows.values[k];
    const auto& b = tensors.values[k];
    // The row pass runs its graphs in inference mode; none of their tensors reaches the
    // caller, who may update a result in place (refused on an inference tensor).
    CHECK_FALSE(a.is_inference());
    REQUIRE(a.sizes() == b.sizes());
    REQUIRE(at::equal(at::isnan(a), at::isnan(b)));
    const auto finite = at::isfinite(b);
    if (!finite.any().item<bool>())
      continue;
    const auto error = (a.index({finite}) - b.index({finite})).abs().max().item<double>() /
                       scale.at(tensors.groups[k]);
    const auto through_solve = !tensors.groups[k].starts_with("value ");
    const auto tolerance = through_solve ? 1e-11 : 1e-12;
    CHECK_MESSAGE(error <= tolerance, "relative error " << error);
  }
}

// Both paths on `inputs`; returns the row pass's forward outcome.
Outcome compare(const std::string& model, const TensorMap& inputs,
                const std::function<void(SolverConfig&)>& change = {}) {
  const auto rows = every_call(session(model, true, change), inputs);
  const auto tensors = every_call(session(model, false, change), inputs);
  REQUIRE(rows.size() == tensors.size());
  for (const auto& [call, result] : rows)
    check_same(result, tensors.at(call), model + " " + call);
  return rows.at("forward");
}

// The implicit models in models/ with a load history, and how many steps it has.
const std::vector<std::pair<const char*, int>> histories = {
    {"scalar_backward_euler", 4},    {"j2_radial_return", 5},   {"perzyna_viscoplasticity", 5},
    {"chaboche_viscoplasticity", 5}, {"perzyna_gmres", 5},      {"perzyna_gmres_bjac", 5},
    {"perzyna_gmres_chord", 5},      {"gtn_viscoplasticity", 5}};

} // namespace

TEST_CASE("the row pass gives what the tensor path gives, on every implicit model") {
  for (const auto& [name, steps] : histories) {
    const std::string model = name;
    CAPTURE(model);
    const test::Reference ref(model);
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      const auto inputs = ref.group(test::step_name(step) + "/in");
      compare(model, inputs);                 // 20 rows: Newton starts from the jacobian graph
      compare(model, tiled_times(inputs, 5)); // 100 rows: from the residual graph
    }
  }
}

TEST_CASE("the row pass's parameter derivatives give the tensor path's") {
  // A parameter inside the residual: du/dp = -A^{-1} dr/dp through the row kernel.
  const test::Reference ref("scalar_backward_euler");
  compare("scalar_backward_euler_params", ref.group("s2/in"));
  compare("scalar_backward_euler_params", tiled_times(ref.group("s2/in"), 5));
}

TEST_CASE("the row pass with line searches, failing rows and substeps") {
  const test::Reference scalar("scalar_backward_euler");
  for (const std::string c :
       {"ls_none", "ls_backtracking", "ls_strong_wolfe", "ls_strong_wolfe_short"}) {
    CAPTURE(c);
    const auto settings = scalar[c + "/config"];
    const auto result =
        compare("scalar_backward_euler", scalar.group(c + "/in"), [&](SolverConfig& config) {
          config.miters = settings[0].item<std::int64_t>();
          config.ls_max_iters = settings[1].item<std::int64_t>();
          config.ls_cutback = settings[2].item<double>();
          config.ls_c = settings[3].item<double>();
          config.ls_type = test::contains(c, "strong_wolfe") ? "STRONG_WOLFE" : "BACKTRACKING";
        });
    CHECK(result.converged.defined()); // some rows fail in each case
  }
  // The multi-unknown models with a line search, and with too few iterations for some rows.
  for (const std::string model :
       {"j2_radial_return", "perzyna_viscoplasticity", "chaboche_viscoplasticity"}) {
    CAPTURE(model);
    const test::Reference ref(model);
    const auto inputs = tiled_times(ref.group("s4/in"), 4);
    for (const char* type : {"BACKTRACKING", "STRONG_WOLFE"})
      compare(model, inputs, [&](SolverConfig& config) {
        config.ls_type = type;
        config.ls_max_iters = 6;
        config.ls_c = 0.3;
      });
    const auto failing = compare(model, inputs, [](SolverConfig& config) { config.miters = 3; });
    REQUIRE(failing.converged.defined());
    CHECK(failing.converged.any().item<bool>()); // elastic rows still converge
  }
  // Substepping: rows that fail in one step take bisected spans.
  const test::Reference sub("scalar_substepping");
  compare("scalar_substepping", sub.group("sub/in"));
}

TEST_CASE("the row pass over many rows, on the intra-op threads, gives the tensor path's") {
  const test::Reference ref("chaboche_viscoplasticity");
  // 6000 rows, tasks of 256
  compare("chaboche_viscoplasticity", tiled_times(ref.group("s3/in"), 300));
}

TEST_CASE("the row pass evaluates only the rows still iterating, and no solve graph") {
  // x + h x^2 = x~1 + h a from x~1 = 0.5, h = 0.1: a = 0.25 is at equilibrium (converged at
  // the first residual), larger a iterate longer. Each row alone tells how many updates it
  // takes (its first jacobian call, then one per update); in a batch the jacobian graph after
  // update k must receive exactly the rows that take at least k.
  std::vector<double> a;
  for (int r = 0; r < 80; ++r) // 80 rows: the residual graph first
    a.push_back(r % 4 == 0 ? 1.25 + r : 0.25);
  const auto rows = static_cast<std::int64_t>(a.size());
  const TensorMap all{{"a", at::tensor(a, at::kDouble)},
                      {"x", at::full({rows}, 0.5, at::kDouble)},
                      {"x~1", at::full({rows}, 0.5, at::kDouble)},
                      {"t", at::full({rows}, 0.1, at::kDouble)},
                      {"t~1", at::zeros({rows}, at::kDouble)}};
  const auto s = session("scalar_backward_euler", true);
  std::map<std::string, std::vector<std::int64_t>> calls; // rows per call, per graph
  neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
    calls[std::filesystem::path(file).stem().string()].push_back(n);
  });
  std::vector<std::int64_t> updates;
  std::vector<at::Tensor> alone;
  for (std::int64_t r = 0; r < rows; ++r) {
    calls.clear();
    TensorMap one;
    for (const auto& [name, value] : all)
      one.emplace(name, value.narrow(0, r, 1));
    alone.push_back(s.forward(one).at("x"));
    updates.push_back(static_cast<std::int64_t>(calls["model_jacobian"].size()) - 1);
  }
  calls.clear();
  const auto out = s.forward(all).at("x");
  neml2::detail::observe_graph_calls({});
  CHECK(calls.count("model_solve") == 0);
  CHECK(calls["model_residual"] == std::vector<std::int64_t>{rows});
  const auto at_least = [&](std::int64_t k) {
    return std::count_if(updates.begin(), updates.end(), [&](auto u) { return u >= k; });
  };
  const auto most = *std::max_element(updates.begin(), updates.end());
  REQUIRE(most >= 3);
  REQUIRE(at_least(1) == rows / 4); // the rows at equilibrium leave at the first residual
  REQUIRE(at_least(most) < at_least(1));
  std::vector<std::int64_t> expected{at_least(1)}; // A for the rows that iterate
  for (std::int64_t k = 1; k <= most; ++k)
    expected.push_back(at_least(k));
  CHECK(calls["model_jacobian"] == expected);
  CHECK(at::equal(out, at::cat(alone)));
}

TEST_CASE("a row whose A is singular fails alone, with its residual; the others converge") {
  // r(u) = u^3 - a from u = 1, 0, 1: the middle row's A = 3 u^2 is 0, a zero pivot.
  const auto graphs = test::cube_root();
  const auto a = at::tensor({8.0, 8.0, 27.0}, at::kDouble).reshape({-1, 1});
  const auto u0 = at::tensor({1.0, 0.0, 1.0}, at::kDouble).reshape({-1, 1});
  for (const bool row_pass : {true, false}) {
    CAPTURE(row_pass);
    SolverConfig config;
    config.row_pass = row_pass;
    const auto result = test::newton_solve(graphs, {u0}, {a}, {}, config);
    CHECK(at::equal(result.converged, at::tensor({1, 0, 1}).to(at::kBool)));
    CHECK(result.u[0][0].item<double>() == doctest::Approx(2).epsilon(1e-9));
    CHECK(result.u[0][2].item<double>() == doctest::Approx(3).epsilon(1e-9));
    if (row_pass) { // the tensor path divides by the zero pivot: NaN
      CHECK(result.norm[1].item<double>() == 8);
      CHECK(result.worst_residual == 8);
    }
  }
}

TEST_CASE("LU with partial pivoting solves as ATen does, and refuses a singular A") {
  at::manual_seed(3);
  for (const std::int64_t n : {1, 2, 6, 19}) {
    CAPTURE(n);
    auto a = at::randn({n, n}, at::kDouble) + n * at::eye(n, at::kDouble);
    a[0][0] = 0; // the first column needs a pivot from below (n > 1)
    if (n == 1)
      a[0][0] = 0.5;
    const auto c = at::randn({n, 3}, at::kDouble);
    auto lu = a.clone();
    auto x = c.clone();
    std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
    REQUIRE(neml2::detail::lu_factor(lu.data_ptr<double>(), n, pivot.data()));
    neml2::detail::lu_solve(lu.data_ptr<double>(), pivot.data(), n, x.data_ptr<double>(), 3);
    test::check_close(x, at::linalg_solve(a, c), "x", 1e-12);
  }
  std::vector<std::int64_t> pivot(3);
  auto zero_column = at::randn({3, 3}, at::kDouble);
  zero_column.select(1, 1).zero_();
  CHECK_FALSE(neml2::detail::lu_factor(zero_column.data_ptr<double>(), 3, pivot.data()));
  auto not_finite = at::eye(3, at::kDouble);
  not_finite[2][2] = std::numeric_limits<double>::infinity();
  CHECK_FALSE(neml2::detail::lu_factor(not_finite.data_ptr<double>(), 3, pivot.data()));
}

TEST_CASE("LU's solve skipping zeros: lu_solve's x, bit for bit, on a block-structured A") {
  // NEML2's per-grain blocks in the graphs' order: 2 x 2 blocks on the diagonal, bordered
  // by one row and column that couple them (an arrowhead), most of it zero through its LU.
  at::manual_seed(5);
  const std::int64_t grains = 12, n = 2 * grains + 1;
  auto a = at::zeros({n, n}, at::kDouble);
  for (std::int64_t g = 0; g < grains; ++g)
    a.narrow(0, 2 * g, 2).narrow(1, 2 * g, 2).copy_(at::randn({2, 2}, at::kDouble) +
                                                     3 * at::eye(2, at::kDouble));
  a.select(0, n - 1).copy_(at::randn({n}, at::kDouble));
  a.select(1, n - 1).copy_(at::randn({n}, at::kDouble));
  a[n - 1][n - 1] = 0.01; // small: the last column's pivot comes from above
  const auto b = at::randn({n}, at::kDouble);
  auto lu = a.clone();
  std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
  REQUIRE(neml2::detail::lu_factor(lu.data_ptr<double>(), n, pivot.data()));
  REQUIRE((lu == 0).sum().item<std::int64_t>() > n * n / 2);
  auto full = b.clone(), skipping = b.clone();
  neml2::detail::lu_solve(lu.data_ptr<double>(), pivot.data(), n, full.data_ptr<double>(), 1);
  neml2::detail::lu_solve_skipping_zeros(lu.data_ptr<double>(), pivot.data(), n,
                                         skipping.data_ptr<double>());
  CHECK(at::equal(skipping, full));
  test::check_close(skipping, at::linalg_solve(a, b), "x", 1e-12);
}

TEST_CASE("rows solved side by side in SIMD lanes: each lane exactly its row's own LU") {
  at::manual_seed(4);
  const auto machine = neml2::detail::lu_lanes();
  CHECK((machine == 1 || machine == 4 || machine == 8));
  for (const int lanes : {1, 4, 8})
    for (const std::int64_t n : {1, 2, 6, 19})
      for (const std::int64_t columns : {1, 3}) {
        if (lanes > machine) // an AVX-512 machine has AVX2
          continue;
        CAPTURE(lanes);
        CAPTURE(n);
        CAPTURE(columns);
        // Lane 0 pivots from below; with several lanes, lane 1 has a zero column and the last
        // an infinite entry: both fail, and no other lane notices.
        auto a = at::randn({lanes, n, n}, at::kDouble) + n * at::eye(n, at::kDouble);
        a[0][0][0] = n == 1 ? 0.5 : 0;
        if (lanes > 1) {
          a[1].select(1, n - 1).zero_();
          a[lanes - 1][n - 1][0] = std::numeric_limits<double>::infinity();
        }
        const auto b = at::randn({lanes, n, columns}, at::kDouble);
        // Interleaved: lane l's (r, c) at (r * n + c) * lanes + l, (r * columns + c) * lanes + l.
        auto a_lanes = a.permute({1, 2, 0}).clone(at::MemoryFormat::Contiguous);
        auto x_lanes = b.permute({1, 2, 0}).clone(at::MemoryFormat::Contiguous);
        const auto failed = neml2::detail::lu_solve_lanes(
            a_lanes.data_ptr<double>(), x_lanes.data_ptr<double>(), n, columns, lanes);
        for (int l = 0; l < lanes; ++l) {
          CAPTURE(l);
          auto lu = a[l].clone();
          auto x = b[l].clone();
          std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
          const bool solved = neml2::detail::lu_factor(lu.data_ptr<double>(), n, pivot.data());
          CHECK(((failed >> l & 1U) == 0) == solved);
          CHECK(solved == (lanes == 1 || (l != 1 && l != lanes - 1)));
          if (!solved)
            continue;
          neml2::detail::lu_solve(lu.data_ptr<double>(), pivot.data(), n, x.data_ptr<double>(),
                                  columns);
          CHECK(at::equal(x_lanes.select(2, l), x));
          test::check_close(x, at::linalg_solve(a[l], b[l]), "x", 1e-12);
        }
      }
}

TEST_CASE("a lane buffer takes the storage one let go before on its thread, never one in use") {
  using neml2::detail::LaneBuffer;
  std::thread([] { // a thread of its own: nothing let go before
    const double* first = nullptr;
    const double* second = nullptr;
    {
      LaneBuffer a(19 * 19 * 8);
      first = a.data();
      CHECK(reinterpret_cast<std::uintptr_t>(first) % 64 == 0);
      LaneBuffer b(19 * 8); // while `a` lives: storage of its own
      second = b.data();
      CHECK(second != first);
    }                              // b let go, then a
    LaneBuffer again(19 * 19 * 8); // a's storage, let go last
    CHECK(again.data() == first);
    LaneBuffer next(19 * 19 * 8); // then b's, grown to the size asked for
    CHECK(next.data() != first);
    next.data()[19 * 19 * 8 - 1] = 1; // (ASan: within it)
    std::thread([&] {                 // another thread's buffers are its own
      LaneBuffer there(19 * 19 * 8);
      CHECK(there.data() != first);
      CHECK(there.data() != next.data());
    })
        .join();
  })
      .join();
}

TEST_CASE("-A^{-1} C per row from blocks, by the row pass's LU and by LAPACK's: groups, a "
          "batch of one, column-major blocks") {
  // Residual groups of 3 and 2 rows, unknown groups of 2 and 3, column groups of 1 and 4.
  at::manual_seed(5);
  const std::int64_t rows = 6;
  const auto a = at::randn({rows, 5, 5}, at::kDouble) + 5 * at::eye(5, at::kDouble);
  auto c = at::randn({rows, 5, 5}, at::kDouble);
  c.narrow(1, 3, 2).narrow(2, 1, 4).copy_(c.narrow(0, 0, 1).narrow(1, 3, 2).narrow(2, 1, 4));
  const std::vector<std::pair<std::int64_t, std::int64_t>> r{{0, 3}, {3, 2}}, u{{0, 2}, {2, 3}},
      g{{0, 1}, {1, 4}};
  std::vector<at::Tensor> a_blocks, c_blocks;
  for (const auto& [r0, rn] : r) {
    for (const auto& [u0, un] : u)
      a_blocks.push_back(a.narrow(1, r0, rn).narrow(2, u0, un));
    for (const auto& [g0, gn] : g)
      c_blocks.push_back(c.narrow(1, r0, rn).narrow(2, g0, gn));
  }
  a_blocks[1] = a_blocks[1].transpose(1, 2).contiguous().transpose(1, 2); // column-major
  c_blocks[3] = c_blocks[3].narrow(0, 0, 1);                              // one for every row
  auto expected = -at::linalg_solve(a, c);
  auto singular_blocks = a_blocks;
  singular_blocks[0] = singular_blocks[0].clone();
  singular_blocks[2] = singular_blocks[2].clone();
  singular_blocks[0][4].zero_(); // row 4's first two columns are zero: singular
  singular_blocks[2][4].zero_();
  for (const auto& [name, minus_solve] :
       {std::pair{"the row pass's LU", &neml2::detail::minus_solve_rows},
        std::pair{"LAPACK's", &neml2::detail::minus_solve_lapack_rows}}) {
    CAPTURE(name);
    test::check_close(minus_solve(a_blocks, c_blocks, 2), expected, "-A^-1 C", 1e-12);
    const auto singular = minus_solve(singular_blocks, c_blocks, 2);
    CHECK(at::isnan(singular[4]).all().item<bool>());
    const auto others = at::tensor({0, 1, 2, 3, 5}, at::kLong);
    test::check_close(singular.index_select(0, others), expected.index_select(0, others),
                      "the other rows", 1e-12);
  }
}

TEST_CASE("LAPACK's rows: 300 unknowns, the same bits at 1, 2 and 3 intra-op threads") {
  // The size of NEML2's KWN example, where MKL's LU opens threads of its own.
  at::manual_seed(6);
  const auto a = at::randn({3, 300, 300}, at::kDouble) + 30 * at::eye(300, at::kDouble);
  const auto c = at::randn({3, 300, 2}, at::kDouble);
  const auto restore =
      c10::make_scope_exit([threads = at::get_num_threads()] { at::set_num_threads(threads); });
  at::Tensor at_one_thread;
  for (const int n : {1, 2, 3}) {
    CAPTURE(n);
    at::set_num_threads(n);
    const auto x = neml2::detail::minus_solve_lapack_rows({a}, {c}, 1);
    test::check_close(at::matmul(a, x), -c, "A x = -c", 1e-12);
    if (n == 1)
      at_one_thread = x;
    else
      CHECK(test::identical(x, at_one_thread));
  }
}

TEST_CASE("LAPACK's rows: subnormal entries flushed, the solution as unflushed, the caller's "
          "control word kept") {
  // KWN's A: a few rows whose off-diagonal entries are subnormal (bins whose densities
  // have underflowed), which the LU takes through microcode assists unless flushed.
  at::manual_seed(7);
  auto a = at::randn({2, 300, 300}, at::kDouble) + 30 * at::eye(300, at::kDouble);
  const auto tails = at::randn({2, 7, 300}, at::kDouble) * 1e-310;
  a.narrow(1, 234, 7).copy_(tails +
                            a.narrow(1, 234, 7) * at::eye(300, at::kDouble).narrow(0, 234, 7));
  REQUIRE(((a != 0) & (a.abs() < 2.2250738585072014e-308)).sum().item<std::int64_t>() > 4000);
  const auto c = at::randn({2, 300, 2}, at::kDouble);
  const auto before = neml2::detail::FlushSubnormals::control();
  const auto x = neml2::detail::minus_solve_lapack_rows({a}, {c}, 1);
  CHECK(neml2::detail::FlushSubnormals::control() == before);
  // ATen's LU unflushed, a matrix at a time (batched, MKL's threads in torch's team hang).
  const auto unflushed = at::stack({at::linalg_solve(a[0], c[0]), at::linalg_solve(a[1], c[1])});
  test::check_close(x, -unflushed, "-A^-1 C (ATen's, unflushed)", 1e-12);

  // A solution entry that would be subnormal is zero, the others exact.
  const auto twice = 2 * at::eye(300, at::kDouble).unsqueeze(0);
  auto small = at::ones({1, 300, 1}, at::kDouble);
  small[0][5][0] = 5e-310;
  const auto halved = neml2::detail::minus_solve_lapack_rows({twice}, {small}, 1);
  CHECK(halved[0][4][0].item<double>() == -0.5);
  if (neml2::detail::FlushSubnormals::supported)
    CHECK(halved[0][5][0].item<double>() == 0.0);

  // Under a caller's own flush, the caller's word is what it finds after.
  const neml2::detail::FlushSubnormals callers;
  const auto flushed_word = neml2::detail::FlushSubnormals::control();
  (void)neml2::detail::minus_solve_lapack_rows({a}, {c}, 1);
  CHECK(neml2::detail::FlushSubnormals::control() == flushed_word);
}

TEST_CASE("each session plans its segments' Newton once, at load and when its config changes") {
  // Each plan as "strategy slot": its NewtonStrategy and its NewtonFactors column.
  const auto plans = [](const neml2::Session& s) {
    std::vector<std::string> found;
    for (const auto& plan : neml2::detail::CallProtocol::newton_plans(s))
      found.push_back(neml2::detail::to_string(plan.strategy) + " " +
                      std::to_string(plan.factor_column));
    return found;
  };
  using Found = std::vector<std::string>;
  const neml2::Session elasticity(test::load_artifact(neml2::resolve_artifact_root(
                                      test::stub("elasticity", "elasticity"), "elasticity")),
                                  "cpu");
  CHECK(plans(elasticity).empty());
  auto j2 = test::session("j2_radial_return");
  CHECK(plans(j2) == Found{"rows 0"});
  // Block groups (grains on a sub-batch axis): the solve graph, a slot for the chord.
  CHECK(plans(test::session("grains")) == Found{"solve_graph 0"});
  // 300 bins a point: LAPACK's rows, a slot too.
  CHECK(plans(test::session("binned_precipitation_300")) == Found{"lapack_rows 0"});
  CHECK(plans(test::session("perzyna_gmres")) == Found{"krylov -1"});
  // The row pass asked off: planned again, the slot kept (the layout is the artifact's).
  auto config = j2.solver_config();
  config.row_pass = false;
  j2.set_solver_config(config);
  CHECK(plans(j2) == Found{"solve_graph 0"});
  config.row_pass = true;
  j2.set_solver_config(config);
  CHECK(plans(j2) == Found{"rows 0"});
}

TEST_CASE("a segment's plan: the row pass up to row_pass_max_unknowns, LAPACK's rows above, "
          "the solve graph or GMRES elsewhere") {
  using neml2::detail::DerivativeSolve;
  using neml2::detail::NewtonShape;
  using neml2::detail::NewtonStrategy;
  using neml2::detail::plan_newton;
  SolverConfig config;
  const auto max = neml2::detail::row_pass_max_unknowns;
  const auto plan = [&](NewtonShape shape, c10::Device device = c10::kCPU,
                        c10::ScalarType dtype = c10::kDouble) {
    return plan_newton(shape, device, dtype, config);
  };
  CHECK(plan({.unknowns = max}).strategy == NewtonStrategy::rows);
  CHECK(plan({.unknowns = max}).keeps_factors());
  CHECK(plan({.unknowns = max}).derivatives == DerivativeSolve::rows);
  CHECK(plan({.unknowns = max + 1}).strategy == NewtonStrategy::lapack_rows);
  CHECK(plan({.unknowns = max + 1}).keeps_factors()); // the tensor path's chord
  CHECK(plan({.unknowns = max + 1}).derivatives == DerivativeSolve::lapack_rows);
  // Block groups: the solve graph eliminates NEML2's per-entry blocks; Krylov: GMRES.
  CHECK(plan({.unknowns = 8, .block_groups = true}).strategy == NewtonStrategy::solve_graph);
  CHECK(plan({.unknowns = 8, .block_groups = true}).keeps_factors());
  CHECK_FALSE(plan({.unknowns = 8, .krylov = true}).keeps_factors());
  // Off the CPU's double the graphs' strategies keep no factor (NewtonFactors are the CPU's).
  CHECK_FALSE(plan({.unknowns = 8, .block_groups = true}, c10::kCPU, c10::kFloat).keeps_factors());
  CHECK_FALSE(
      plan({.unknowns = 8, .block_groups = true}, c10::Device("cuda:0")).keeps_factors());
  CHECK(plan({.unknowns = 8, .krylov = true}).strategy == NewtonStrategy::krylov);
  CHECK(plan({.unknowns = 8, .krylov = true}).derivatives == DerivativeSolve::rows);
  // Off the CPU's double, or asked off, whatever the size: the graphs.
  CHECK(plan({.unknowns = 1}, c10::kCPU, c10::kFloat).strategy == NewtonStrategy::solve_graph);
  CHECK(plan({.unknowns = 1}, c10::kCPU, c10::kFloat).derivatives == DerivativeSolve::graphs);
  CHECK(plan({.unknowns = 1}, c10::Device("cuda:0")).strategy == NewtonStrategy::solve_graph);
  CHECK(plan({.unknowns = max + 1}, c10::Device("cuda:0")).strategy == NewtonStrategy::solve_graph);
  config.row_pass = false;
  CHECK(plan({.unknowns = 1}).strategy == NewtonStrategy::solve_graph);
  CHECK(plan({.unknowns = 1}).derivatives == DerivativeSolve::graphs);
  // Above it, LAPACK's rows on the CPU, with the row pass asked off too.
  CHECK(plan({.unknowns = max + 1}).strategy == NewtonStrategy::lapack_rows);
  // A NewtonFactors row holds a slot for every segment of direct steps, on any device.
  CHECK(neml2::detail::has_factor_slot({.unknowns = max}));
  CHECK(neml2::detail::has_factor_slot({.unknowns = max + 1}));
  CHECK_FALSE(neml2::detail::has_factor_slot({.unknowns = 8, .krylov = true}));
  CHECK(neml2::detail::has_factor_slot({.unknowns = 8, .block_groups = true}));

  // Graphs written by hand: counted per row from the sizes after the batch axis, over
  // every group (a sub-batched group, an empty batch).
  const neml2::detail::NewtonGraphs direct;
  const auto groups = [](std::vector<std::int64_t> widths) {
    std::vector<at::Tensor> u;
    for (auto w : widths)
      u.push_back(at::zeros({3, w}, at::kDouble));
    return u;
  };
  config.row_pass = true;
  CHECK(plan_newton(direct, groups({max - 24, 24}), config).strategy == NewtonStrategy::rows);
  CHECK(plan_newton(direct, groups({max - 24, 25}), config).strategy ==
        NewtonStrategy::lapack_rows);
  CHECK(plan_newton(direct, std::vector{at::zeros({3, 8, 9}, at::kDouble)}, config).unknowns == 72);
  CHECK(plan_newton(direct, std::vector{at::zeros({0, max + 1}, at::kDouble)}, config).strategy ==
        NewtonStrategy::lapack_rows);
  // A solve refuses unknowns its plan was not made for.
  const auto small = groups({2});
  const auto wrong = plan_newton(direct, groups({3}), config);
  CHECK_THROWS_AS((void)neml2::detail::newton_solve(direct, wrong, small, {}, {}, config),
                  neml2::FatalError);
}

TEST_CASE("which graph checks the rows changes the calls, never the bits, on every implicit "
          "model") {
  // The residual graph's residuals are the jacobian graph's, bit for bit: the schedule
  // (implicit/newton_schedule.hpp) may pick either at any check.
  struct Forced {
    ~Forced() { neml2::detail::forced_newton_schedule = -1; }
  } restore;
  for (const auto& [name, steps] : histories) {
    const std::string model = name;
    CAPTURE(model);
    const test::Reference ref(model);
    const auto s = session(model, true);
    for (int step = 0; step < steps; ++step) {
      CAPTURE(step);
      const auto inputs = tiled_times(ref.group(test::step_name(step) + "/in"), 5);
      std::map<int, std::int64_t> residual_rows; // per forced choice
      std::map<int, TensorMap> outputs;
      for (int forced : {1, 0, -1}) {
        neml2::detail::forced_newton_schedule = forced;
        neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t n) {
          residual_rows[forced] += file.ends_with("_residual.pt2") ? n : 0;
        });
        outputs[forced] = s.jacobian(inputs).first;
        neml2::detail::observe_graph_calls({});
      }
      CHECK(test::identical(outputs[0], outputs[1]));
      CHECK(test::identical(outputs[-1], outputs[1]));
      if (model.find("gmres") == std::string::npos) { // GMRES takes matvecs, not A
        CHECK(residual_rows[1] == 0);
        CHECK(residual_rows[0] > 0);
      }
    }
  }
}

TEST_CASE("a history's steps: the schedule learns to check converging rows by the residual "
          "alone, and rows that stay with A") {
  // Perzyna over a strain ramp: after the first steps every row takes one update, so a
  // step costs one jacobian call (A at the old state) and one residual call (converged),
  // per row: no row is evaluated again after it converged.
  const auto model = load_model(test::stub("perzyna_viscoplasticity", "model"), "model");
  const std::int64_t points = 256;
  const auto opts = at::TensorOptions(at::kDouble);
  const auto direction = at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, opts);
  const auto amplitude = (2e-2 * at::linspace(0.5, 1.5, points, opts)).unsqueeze(1) * direction;
  MaterialState state(model, points);
  std::map<std::string, std::int64_t> rows;
  for (int n = 1; n <= 30; ++n) {
    rows.clear();
    neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t r) {
      rows[std::filesystem::path(file).stem().string()] += r;
    });
    state.step({{"E", amplitude * (n / 100.0)}}, at::full({points}, 0.1 * n, opts));
    neml2::detail::observe_graph_calls({});
    state.accept();
  }
  CHECK(rows["model_jacobian"] == points);
  CHECK(rows["model_residual"] == points);

  // The schedule itself: a quarter of each solve's share of rows that stay, per check.
  neml2::detail::NewtonSchedule learned;
  CHECK_FALSE(learned.with_a(0));
  CHECK(learned.with_a(1));
  for (int solve = 0; solve < 20; ++solve) {
    learned.record(0, 100, 100); // every row stays at the guess
    learned.record(1, 100, 0);   // and leaves at the first update
  }
  CHECK(learned.with_a(0));
  CHECK_FALSE(learned.with_a(1));
  CHECK(learned.with_a(2)); // not seen: the default
  for (int solve = 0; solve < 20; ++solve)
    learned.record(9, 10, 1);
  CHECK_FALSE(learned.with_a(20)); // checks past the tracked ones share the last slot
}

TEST_CASE("StepOptions::extrapolate: Newton's guess from the step before, scaled by the time "
          "increments; the same results, fewer updates") {
  const auto opts = at::TensorOptions(at::kDouble);
  // Rows of graph calls per graph in one step, and in all ("all").
  const auto calls = [](MaterialState& state, const TensorMap& forces, const at::Tensor& t,
                        bool extrapolate) {
    std::map<std::string, std::int64_t> rows;
    neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t r) {
      rows[std::filesystem::path(file).stem().string()] += r;
      rows["all"] += r;
    });
    const auto& r = state.step(forces, t, {.extrapolate = extrapolate});
    neml2::detail::observe_graph_calls({});
    CHECK(r.failed == 0);
    return rows;
  };

  SUBCASE("an elastic ramp in uneven steps: the guess is the solution") {
    // Perzyna below yield: the stress is linear in time, so from the third step on the
    // guess (the last increment scaled by dt / dt before) solves the step: one evaluation
    // a point, no update. A guess that ignored the time increments would be off by half an
    // increment at every step.
    const auto model = load_model(test::stub("perzyna_viscoplasticity", "model"), "model");
    const std::int64_t points = 64;
    const auto amplitude = (1e-5 * at::linspace(0.5, 1.5, points, opts)).unsqueeze(1) *
                           at::tensor({1.0, -0.5, -0.5, 0.2, 0.0, 0.0}, opts);
    MaterialState guessed(model, points), plain(model, points);
    const double times[] = {0.1, 0.3, 0.4, 0.7, 0.8, 1.0};
    for (std::size_t n = 0; n < std::size(times); ++n) {
      CAPTURE(n);
      const TensorMap forces{{"E", amplitude * times[n]}};
      const auto t = at::full({points}, times[n], opts);
      const auto rows = calls(guessed, forces, t, true);
      const auto plain_rows = calls(plain, forces, t, false);
      CHECK(plain_rows.at("all") == 2 * points); // the guess, one update
      if (n >= 2)
        CHECK(rows.at("all") == points);
      test::check_close(guessed.step(forces, t, {.extrapolate = true}).outputs,
                        plain.step(forces, t).outputs, "extrapolated", 1e-12);
      guessed.accept();
      plain.accept();
    }
  }

  SUBCASE("GTN's history: results within Newton's tolerance, one update a step fewer") {
    // Three updates a step from the start, two from the extrapolated guess (late in the
    // history). Newton's relative test (||r|| < rtol ||r0||) asks the same reduction of a
    // better guess, so the guess saves an update, not more.
    const auto model = load_model(test::stub("gtn_viscoplasticity", "model"), "model");
    const std::int64_t points = 128;
    const auto amplitude = (0.1 * at::linspace(0.5, 1.5, points, opts)).unsqueeze(1) *
                           at::tensor({1.0, 0.0, 0.0, 0.2, 0.0, 0.0}, opts);
    const TensorMap voids{{"void_fraction", at::full({points}, 0.01, opts)}};
    MaterialState guessed(model, points, voids), plain(model, points, voids);
    // Every check by the residual graph: the jacobian graph's rows are the updates.
    struct Forced {
      Forced() { neml2::detail::forced_newton_schedule = 0; }
      ~Forced() { neml2::detail::forced_newton_schedule = -1; }
    } forced;
    std::int64_t updates_guessed = 0, updates_plain = 0;
    for (int n = 1; n <= 40; ++n) {
      const TensorMap forces{{"E", amplitude * (n / 100.0)}};
      const auto t = at::full({points}, 0.1 * n, opts);
      const auto g = calls(guessed, forces, t, true);
      const auto p = calls(plain, forces, t, false);
      if (n > 30) {
        updates_guessed += g.at("model_jacobian");
        updates_plain += p.at("model_jacobian");
      }
      guessed.accept();
      plain.accept();
    }
    test::check_close(guessed.start(), plain.start(), "40 steps", 1e-8);
    CHECK(updates_plain == 10 * 3 * points);
    CHECK(updates_guessed == 10 * 2 * points);
  }
}
