#pragma once

// Newton on the CPU as one pass over the rows between two graph calls: each row's norm,
// convergence and failure flags, its LU solve (in place of the solve graph), its update
// and its place in the compacted working set, in plain C++ over the graphs' results, with
// no tensor operation per iteration. The IFT solves of the Jacobians the same way.
// Private to src/implicit/.

#include <cstddef>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton.hpp"

namespace neml2::detail {

/// Whether tensors like `like` are solved on rows: on the CPU, in double (the precision
/// NEML2 compiles implicit models in), with `config.row_pass`.
[[nodiscard]] bool runs_on_rows(const at::Tensor& like, const SolverConfig& config);
/// ... and a Newton step by a direct solve (no matvec graph).
[[nodiscard]] bool runs_on_rows(const NewtonGraphs& graphs, const at::Tensor& like,
                                const SolverConfig& config);

/// `graph` on `args`, its results for the row pass alone (read in place, never returned to
/// a caller): made in inference mode, without a version counter for each of the hundreds
/// of tensors an AOTI call makes (a third of its allocations at small batches).
[[nodiscard]] std::vector<at::Tensor> call_for_rows(const GraphFn& graph,
                                                    const std::vector<at::Tensor>& args);

/// newton_solve's contract, on rows (runs_on_rows). Every row that iterates is in the
/// working set of each graph call, and no other: rows leave it as soon as they converge or
/// fail. A row whose A has a zero or non-finite pivot fails, with its last residual norm.
[[nodiscard]] NewtonResult newton_solve_rows(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                             const std::vector<at::Tensor>& givens,
                                             const std::vector<at::Tensor>& params,
                                             const SolverConfig& config, bool gate_relative);

/// -A^{-1} C per row, `(rows, n, m)`: A from its blocks `(rows or 1, n_r, n_u)` (residual
/// groups outer, unknown groups inner), C from its `(rows or 1, n_r, n_c)` blocks (residual
/// groups outer, column groups inner), `residual_groups` of them. A row whose A is
/// singular gets NaN, as the solve graphs give.
[[nodiscard]] at::Tensor minus_solve_rows(const std::vector<at::Tensor>& a_blocks,
                                          const std::vector<at::Tensor>& c_blocks,
                                          std::size_t residual_groups);

} // namespace neml2::detail
