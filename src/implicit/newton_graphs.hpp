#pragma once

// What every Newton strategy of src/implicit/ shares: a segment's graphs, how they are
// called, and what a solve returns. Includes no other Newton header. Private to the library.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/Tensor.h>

#include "implicit/newton_schedule.hpp"

namespace neml2::detail {

struct InGraphLayout;

/// A compiled graph: flat tensor list in, flat tensor list out.
using GraphFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// The graphs of one segment's Newton step and how many tensors each returns. A direct
/// step solves A du = b with `solve`; a Krylov step (`matvec` set; `jacobian` and `solve`
/// unused, `a_blocks` 0) runs GMRES on the matvec graph, preconditioned when
/// `precond_setup` and `precond_apply` are set. Which of them a solve calls is its
/// NewtonPlan's (newton_plan.hpp).
struct NewtonGraphs {
  GraphFn residual; ///< (u groups, g groups, params) -> b = -r per residual group
  GraphFn jacobian; ///< same -> A blocks (residual group x unknown group), then b
  GraphFn solve;    ///< (A blocks, b) -> du per unknown group
  std::size_t a_blocks = 0;
  /// Whether A's blocks are `(B, r, u)` per residual and unknown group, as the row pass
  /// reads them (not so for block-structured groups: NEML2's per-entry blocks).
  bool dense_blocks = true;
  /// (A's blocks) -> {A `(B, n_r, n_u)` in Newton's layout}, for the chord off the row pass;
  /// empty where the blocks are dense (dense_blocks): side by side.
  GraphFn dense_a;
  GraphFn matvec; ///< (u groups, g groups, params, v per unknown group) -> A v per residual group
  GraphFn precond_setup; ///< (u groups, g groups, params) -> the preconditioner's state
  GraphFn precond_apply; ///< (state, r `(B, n)`) -> M^-1 r `(B, n)`
  /// The row pass's choice of graph per check, learned across solves (none: the default).
  std::shared_ptr<NewtonSchedule> schedule;
  /// Where each value of one row of A's blocks goes in that row's n x n A, row-major (-1:
  /// nowhere), per block: found by the chord off the row pass at its first A
  /// (tensor_chord.cpp), then kept for every solve of the segment.
  struct BlockPositions {
    std::once_flag found;
    std::vector<std::vector<std::int64_t>> of_block;
  };
  std::shared_ptr<BlockPositions> block_positions = std::make_shared<BlockPositions>();
  /// Block-structured groups: these graphs without the conversion to Newton's layout at
  /// each call, for a solve by the solve graph (block_groups.hpp); none otherwise.
  std::shared_ptr<const InGraphLayout> in_graph_layout;
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

/// The values of one row's slot for the chord of `n` unknowns: whether it holds a factor,
/// its LU, its pivots.
[[nodiscard]] constexpr std::int64_t chord_slot_width(std::int64_t n) {
  return 1 + n * n + n;
}

} // namespace neml2::detail
