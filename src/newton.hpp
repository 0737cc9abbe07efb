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

/// The graphs of one segment's Newton step and how many tensors each returns.
struct NewtonGraphs {
  GraphFn residual; ///< (u groups, g groups, params) -> b = -r per residual group
  GraphFn jacobian; ///< same -> A blocks (residual group x unknown group), then b
  GraphFn solve;    ///< (A blocks, b) -> du per unknown group
  std::size_t a_blocks = 0;
};

/// Where each row ended.
struct NewtonResult {
  std::vector<at::Tensor> u; ///< the unknown groups, `(B, n)`, converged rows solved
  at::Tensor converged;      ///< `(B,)` bool
  double worst_residual = 0; ///< max ||r|| over rows that failed (NaN if one was not finite)
  std::int64_t iterations = 0;
};

/// @brief Solves r(u; g) = 0 row by row from `u0`.
///
/// A row converges when ||r|| < atol or ||r|| / ||r0|| < rtol, and fails when it reaches
/// `miters` (N allows N - 1 updates) or its residual stops being finite. Converged rows
/// are never updated again, so each row's result depends on that row alone. Rows still
/// iterating are compacted into a dense batch once they are at most
/// `config.compact_below` of the working set; until then the others ride along, masked.
/// With `ls_max_iters > 1`, each row backtracks along its Newton step (BACKTRACKING).
[[nodiscard]] NewtonResult newton_solve(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                        const std::vector<at::Tensor>& givens,
                                        const std::vector<at::Tensor>& params,
                                        const SolverConfig& config);

} // namespace neml2::detail
