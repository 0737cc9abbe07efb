#pragma once

// The Newton iteration of one implicit segment, per row, over the compiled residual,
// jacobian and solve graphs. Private to the library (src/).

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

namespace neml2::detail {

/// A compiled graph: flat tensor list in, flat tensor list out.
using GraphFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// The graphs of one segment's Newton step and how many tensors each returns. A direct
/// step solves A du = b with `solve`; a Krylov step (`matvec` set; `jacobian` and `solve`
/// unused, `a_blocks` 0) runs GMRES on the matvec graph, preconditioned when
/// `precond_setup` and `precond_apply` are set.
struct NewtonGraphs {
  GraphFn residual; ///< (u groups, g groups, params) -> b = -r per residual group
  GraphFn jacobian; ///< same -> A blocks (residual group x unknown group), then b
  GraphFn solve;    ///< (A blocks, b) -> du per unknown group
  std::size_t a_blocks = 0;
  GraphFn matvec; ///< (u groups, g groups, params, v per unknown group) -> A v per residual group
  GraphFn precond_setup; ///< (u groups, g groups, params) -> the preconditioner's state
  GraphFn precond_apply; ///< (state, r `(B, n)`) -> M^-1 r `(B, n)`
};

/// The linear operators of one batch of GMRES solves, on flat `(rows, n)` vectors.
struct KrylovOperators {
  std::function<at::Tensor(const at::Tensor&)> apply;        ///< v -> A v
  std::function<at::Tensor(const at::Tensor&)> precondition; ///< r -> M^-1 r; empty: none
};

/// Where each row's linear solve ended.
struct KrylovResult {
  at::Tensor x;          ///< `(rows, n)`
  at::Tensor iterations; ///< `(rows,)` int64: Arnoldi steps the row used
  at::Tensor converged;  ///< `(rows,)` bool: ||M^-1 (b - A x)|| <= max(abs_tol, rel_tol ||b||)
};

/// How gmres() does its per-row Arnoldi arithmetic: `automatic` in plain loops over the rows
/// for CPU tensors (float, double) and in tensor operations otherwise; `tensors` always in
/// tensor operations (the path of other devices, so that tests run it on CPU too).
enum class GmresKernel { automatic, tensors };

/// @brief Restarted, left-preconditioned GMRES per row, as NEML2 3.1's Krylov loop behaves
/// (see SolverConfig::Krylov): from x = 0, cycles of at most `restart` Arnoldi steps (a row
/// stops extending its basis once its residual estimate is within tolerance), each followed
/// by the update and, while below `max_its`, the true residual. Rows are solved in lock-step
/// but each row's result depends on that row alone (rows that stopped ride along unused).
/// Only the rows of `active` are solved (undefined: all); the others get x = 0.
[[nodiscard]] KrylovResult gmres(const KrylovOperators& ops, const at::Tensor& b,
                                 const SolverConfig::Krylov& config, const at::Tensor& active = {},
                                 GmresKernel kernel = GmresKernel::automatic);

/// Where each row ended.
struct NewtonResult {
  std::vector<at::Tensor> u; ///< the unknown groups, `(B, n)`, converged rows solved
  at::Tensor converged;      ///< `(B,)` bool
  at::Tensor norm;           ///< `(B,)` the last ||r|| of each row
  double worst_residual = 0; ///< max ||r|| over rows that failed (NaN if one was not finite)
  std::int64_t iterations = 0;
  /// Rows that converged in substeps (indices into the batch; undefined when none) and,
  /// when derivatives were asked for, d(u)/d(givens, extra columns) of each through its
  /// substeps, `(rows, n_u, n_g + extra)` (see DerivativeFn).
  at::Tensor substepped, substepped_du_dg;
};

/// d(u)/d(givens) at a solution of one step, `(B, n_u, n_g + extra)` over the flattened
/// unknown and given groups (the implicit function theorem, from the compiled graphs), then
/// any `extra` columns of quantities every span sees unchanged (the parameters).
using DerivativeFn = std::function<at::Tensor(const std::vector<at::Tensor>& u,
                                              const std::vector<at::Tensor>& givens)>;

/// A slice of a packed group: `size` values from column `offset` of group `group`.
struct GroupSlice {
  std::size_t group = 0;
  std::int64_t offset = 0, size = 0;
};

/// How the givens of a segment move when its step is cut into substeps (NEML2's roles):
/// a current force and its old force are interpolated linearly over the step, an old
/// state takes the previous substep's solution of its unknown, the rest stay.
struct SubstepPlan {
  std::int64_t max_level = 0; ///< up to 2^max_level substeps per row; 0 = off
  struct Ramp {
    GroupSlice current, old; ///< `f` and `f~1` among the givens
  };
  struct Chain {
    GroupSlice old_state, unknown; ///< `u~1` among the givens, `u` among the unknowns
  };
  std::vector<Ramp> ramps;
  std::vector<Chain> chains;
};

/// @brief Solves r(u; g) = 0 row by row from `u0`.
///
/// A row converges when ||r|| < atol or ||r|| / ||r0|| < rtol, and fails when it reaches
/// `miters` (N allows N - 1 updates) or its residual stops being finite. Converged rows
/// are never updated again, so each row's result depends on that row alone. Rows still
/// iterating are compacted into a dense batch once they are at most
/// `config.compact_below` of the working set; until then the others ride along, masked.
/// With `ls_max_iters > 2`, each row searches along its Newton step as NEML2 does
/// (BACKTRACKING or STRONG_WOLFE; see line_search in newton.cpp).
///
/// With `gate_relative` (NEML2's rule while substepping is on), the relative criterion
/// also needs the last update to be small: ||du|| < substep_del_tol (||u|| + atol).
[[nodiscard]] NewtonResult newton_solve(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                        const std::vector<at::Tensor>& givens,
                                        const std::vector<at::Tensor>& params,
                                        const SolverConfig& config, bool gate_relative = false);

/// How many values newton_solve, solve_with_substeps and gmres have read back to the host
/// on this thread so far (each one a host synchronization on an accelerator): at most one
/// per Newton iteration for its decisions, a few per solve, plus one per line-search trial
/// and GMRES step. For tests.
[[nodiscard]] std::uint64_t newton_host_reads() noexcept;

/// @brief newton_solve, then adaptive substepping of the rows that failed (when
/// `plan.max_level > 0`), as NEML2's runtime does it: a failed span of the step is
/// bisected, recursively, down to spans of 2^-max_level of the step; after a span
/// converges, the next one is the rest of its parent span (recursive bisection, so
/// [1/2, 1/4, 1/4] and not a restart in quarters). Each row's sequence of spans depends on
/// that row alone. Rows that converge in one step run exactly as without substepping
/// (apart from NEML2's gate on the relative criterion); rows still failing at the deepest
/// level fail. With `du_dg`, the derivatives of substepped rows are chained through their
/// substeps (interpolation weights, old states) into NewtonResult::substepped_du_dg.
[[nodiscard]] NewtonResult
solve_with_substeps(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                    const std::vector<at::Tensor>& givens, const std::vector<at::Tensor>& params,
                    const SolverConfig& config, const SubstepPlan& plan,
                    const DerivativeFn& du_dg = {}, std::int64_t extra_columns = 0);

} // namespace neml2::detail
