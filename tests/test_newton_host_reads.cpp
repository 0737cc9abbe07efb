// The Newton loop's reads back to the host, counted on the CPU: on a GPU each one is a
// host synchronization that idles the device for the next launch, so the loop's decisions
// (how many rows iterate, whether the working set shrinks) take one read per iteration, and
// a solve a couple more. Every read of src/newton.cpp goes through one counter.

#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include "cube_root.hpp"
#include "graph/graph_calls.hpp"
#include "internals.hpp" // the library's private parts
#include "model_checks.hpp"
#include "planned_newton.hpp"

using namespace neml2;

namespace {

// A solve's own reads beyond one per iteration: the first active count and the worst
// residual.
constexpr std::uint64_t per_solve = 2;

// test::cube_root(): u^3 = a per row from u = 1; the larger `a`, the more iterations, so
// the rows converge at different iterations and the working set shrinks several times.
using test::cube_root;

} // namespace

TEST_CASE("Newton reads the host once per iteration, however often the working set shrinks") {
  const auto a = at::tensor({1.0, 8.0, 1e3, 1e6, 1e9, 1e12}, at::kDouble).reshape({-1, 1});
  // 0: never compacting; 0.5: the default; 1: compacting at every convergence (the most
  // shrinking, each of which used to read the indices and the active count again).
  for (const double compact_below : {0.0, 0.5, 1.0})
    for (const bool gate_relative : {false, true}) {
      CAPTURE(compact_below);
      CAPTURE(gate_relative);
      SolverConfig config;
      config.row_pass = false; // the tensor path (accelerators'); the CPU's row pass reads none
      config.miters = 100;
      config.compact_below = compact_below;
      const auto before = neml2::detail::newton_host_reads();
      const auto result = test::newton_solve(cube_root(), {at::ones({a.size(0), 1}, at::kDouble)},
                                             {a}, {}, config, gate_relative);
      const auto reads = neml2::detail::newton_host_reads() - before;
      REQUIRE(result.converged.all().item<bool>());
      // Enough iterations that one more read each would break the bound several times over.
      REQUIRE(result.iterations >= 20);
      CHECK(reads <= static_cast<std::uint64_t>(result.iterations) + per_solve);
      CHECK(result.worst_residual == 0);
      // Converged by NEML2's criteria (||r|| < rtol ||r0||), so close, not exact.
      const auto expected = at::pow(a, 1.0 / 3);
      CHECK(((result.u[0] - expected).abs() / expected).max().item<double>() <= 1e-6);
    }
}

TEST_CASE("the worst residual of the failed rows costs one read and is what it was") {
  // Rows that cannot converge in 4 iterations fail; their worst residual is the largest
  // ||r|| among them, computed here from the loop's own norms.
  const auto a = at::tensor({1.0, 1e9, 1e12}, at::kDouble).reshape({-1, 1});
  SolverConfig config;
  config.row_pass = false;
  config.miters = 4;
  const auto before = neml2::detail::newton_host_reads();
  const auto result =
      test::newton_solve(cube_root(), {at::ones({3, 1}, at::kDouble)}, {a}, {}, config);
  const auto reads = neml2::detail::newton_host_reads() - before;
  CHECK(at::equal(result.converged, at::tensor({1, 0, 0}).to(at::kBool)));
  CHECK(result.worst_residual == result.norm.narrow(0, 1, 2).max().item<double>());
  CHECK(result.worst_residual > 1e6);
  CHECK(reads <= static_cast<std::uint64_t>(result.iterations) + per_solve);
}

TEST_CASE("J2 radial return and Perzyna: host reads per solve at most iterations + 2") {
  // Through the compiled models: each Newton iteration calls the solve graph once, so its
  // calls count the iterations; the results still match eager NEML2.
  for (const char* name : {"j2_radial_return", "perzyna_viscoplasticity"})
    for (const double compact_below : {0.5, 1.0}) {
      CAPTURE(name);
      CAPTURE(compact_below);
      const test::Reference ref(name);
      Session s(std::make_shared<const Artifact>(
                    read_artifact(resolve_artifact_root(test::stub(name, "model"), "model"))),
                "cpu");
      auto config = s.solver_config();
      config.row_pass = false;
      config.compact_below = compact_below;
      s.set_solver_config(config);
      for (const auto* c : {"s1", "s4"}) {
        CAPTURE(c);
        std::uint64_t solves = 0;
        neml2::detail::observe_graph_calls([&](const std::string& file, std::int64_t) {
          solves += std::filesystem::path(file).stem().string().ends_with("_solve");
        });
        const auto before = neml2::detail::newton_host_reads();
        const auto out = s.forward(ref.group(std::string(c) + "/in"));
        const auto reads = neml2::detail::newton_host_reads() - before;
        neml2::detail::observe_graph_calls({});
        CHECK(solves > 0);
        CHECK(reads <= solves + per_solve);
        test::check_close(out, ref.group(std::string(c) + "/out"), "forward");
      }
    }
}
