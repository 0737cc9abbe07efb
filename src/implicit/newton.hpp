#pragma once

// The Newton iteration of one implicit segment, per row, over the compiled residual,
// jacobian and solve graphs, by the strategy its NewtonPlan names (newton_plan.hpp).
// Private to the library (src/).

#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton_graphs.hpp"
#include "implicit/newton_plan.hpp"

namespace neml2::detail {

/// @brief Solves r(u; g) = 0 row by row from `u0`, by `plan`'s strategy.
///
/// A row converges when ||r|| < atol or ||r|| / ||r0|| < rtol, and fails when it reaches
/// `miters` (N allows N - 1 updates) or its residual stops being finite. Converged rows
/// are never updated again, so each row's result depends on that row alone. Rows still
/// iterating are compacted into a dense batch once they are at most
/// `config.compact_below` of the working set; until then the others ride along, masked.
/// With `ls_max_iters > 2`, each row searches along its Newton step as NEML2 does
/// (BACKTRACKING or STRONG_WOLFE).
///
/// With `gate_relative` (NEML2's rule while substepping is on), the relative criterion
/// also needs the last update to be small: ||du|| < substep_del_tol (||u|| + atol).
///
/// With `config.chord` or `factors` (each row's factor kept from call to call), the chord
/// where the plan keeps factors (NewtonPlan::keeps_factors): the row pass's
/// (newton_rows.hpp), or the tensor path's (newton_solve_tensor_chord: block groups, more
/// than 64 unknowns, or a line search); where it keeps none both are ignored.
[[nodiscard]] NewtonResult newton_solve(const NewtonGraphs& graphs, const NewtonPlan& plan,
                                        std::vector<at::Tensor> u0,
                                        const std::vector<at::Tensor>& givens,
                                        const std::vector<at::Tensor>& params,
                                        const SolverConfig& config, bool gate_relative = false,
                                        const at::Tensor& factors = {});

/// How many values newton_solve, solve_with_substeps and gmres have read back to the host
/// on this thread so far (each one a host synchronization on an accelerator): at most one
/// per Newton iteration for its decisions, a few per solve, plus one per line-search trial
/// and GMRES step. For tests.
[[nodiscard]] std::uint64_t newton_host_reads() noexcept;

} // namespace neml2::detail
