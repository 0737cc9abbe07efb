#pragma once

// The Newton iteration of one implicit segment, per row, over the compiled residual,
// jacobian and solve graphs. Private to the library (src/).

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/gmres.hpp"
#include "implicit/newton_schedule.hpp"

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
  /// Whether A's blocks are `(B, r, u)` per residual and unknown group, as the row pass
  /// reads them (not so for block-structured groups: NEML2's per-entry blocks).
  bool dense_blocks = true;
  GraphFn matvec; ///< (u groups, g groups, params, v per unknown group) -> A v per residual group
  GraphFn precond_setup; ///< (u groups, g groups, params) -> the preconditioner's state
  GraphFn precond_apply; ///< (state, r `(B, n)`) -> M^-1 r `(B, n)`
  /// The row pass's choice of graph per check, learned across solves (none: the default).
  std::shared_ptr<NewtonSchedule> schedule;
};

/// Up to this many rows, Newton starts from the jacobian graph (one call instead of two
/// when a row iterates); above, from the residual graph (rows that converge at once never
/// need A, and the rest may be compacted first).
inline constexpr std::int64_t first_from_jacobian = 64;

/// What the residual, jacobian and matvec graphs take: the unknown groups, the given
/// groups, then the parameters.
[[nodiscard]] std::vector<at::Tensor> graph_args(const std::vector<at::Tensor>& u,
                                                 const std::vector<at::Tensor>& givens,
                                                 const std::vector<at::Tensor>& params);

/// Where each row ended.
struct NewtonResult {
  std::vector<at::Tensor> u; ///< the unknown groups, `(B, n)`, converged rows solved
  at::Tensor converged;      ///< `(B,)` bool
  at::Tensor norm;           ///< `(B,)` the last ||r|| of each row
  double worst_residual = 0; ///< max ||r|| over rows that failed (NaN if one was not finite)
  /// `(B,)` int8 RowFailure per row (row_failures.hpp); undefined when every row converged.
  at::Tensor reasons;
  std::int64_t iterations = 0;
  /// Rows that converged in substeps (indices into the batch; undefined when none) and,
  /// when derivatives were asked for, d(u)/d(givens, extra columns) of each through its
  /// substeps, `(rows, n_u, n_g + extra)` (see DerivativeFn).
  at::Tensor substepped, substepped_du_dg;
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
///
/// On the CPU (double, a direct step, `config.row_pass`), everything between two
/// graph calls is one pass over the rows (newton_rows.hpp): the solve graph is not called.
/// There, with `config.chord` or `factors` (each row's factor kept from call to call), the
/// chord (newton_solve_rows); elsewhere both are ignored.
[[nodiscard]] NewtonResult newton_solve(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                        const std::vector<at::Tensor>& givens,
                                        const std::vector<at::Tensor>& params,
                                        const SolverConfig& config, bool gate_relative = false,
                                        const at::Tensor& factors = {});

/// The values of one row's slot for the chord of `n` unknowns: whether it holds a factor,
/// its LU, its pivots.
[[nodiscard]] constexpr std::int64_t chord_slot_width(std::int64_t n) {
  return 1 + n * n + n;
}

/// How many values newton_solve, solve_with_substeps and gmres have read back to the host
/// on this thread so far (each one a host synchronization on an accelerator): at most one
/// per Newton iteration for its decisions, a few per solve, plus one per line-search trial
/// and GMRES step. For tests.
[[nodiscard]] std::uint64_t newton_host_reads() noexcept;

} // namespace neml2::detail
