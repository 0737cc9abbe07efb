#pragma once

// Newton on the CPU as one pass over the rows between two graph calls: each row's norm,
// convergence and failure flags, its LU solve (in place of the solve graph), its update
// and its place in the compacted working set, in plain C++ over the graphs' results, with
// no tensor operation per iteration (the row systems: row_system.hpp).
// Private to src/implicit/.

#include <cstddef>
#include <span>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton.hpp"

namespace neml2::detail {

/// The most unknowns per row the row pass solves. Its LU (row_lu.hpp, several rows in
/// SIMD lanes) beats batched LAPACK up to about 64 unknowns and loses beyond (1.5x at 128,
/// 4x at 300: docs/performance.md); larger systems take the tensor path, their solves
/// LAPACK's, row by row on the CPU (lapack_rows.hpp).
inline constexpr std::int64_t row_pass_max_unknowns = 64;

/// The unknowns per row of the unknown groups `u` (`(B, ...)` each): every group's sizes
/// after the batch axis, multiplied, summed.
[[nodiscard]] std::int64_t unknowns_per_row(std::span<const at::Tensor> u);

/// Whether the unknown groups `u` (`(B, n)` each) are solved on rows: on the CPU, in double
/// (the precision NEML2 compiles implicit models in), at most row_pass_max_unknowns over
/// every group, with `config.row_pass`.
[[nodiscard]] bool runs_on_rows(std::span<const at::Tensor> u, const SolverConfig& config);
/// ... and a Newton step by a direct solve (no matvec graph).
[[nodiscard]] bool runs_on_rows(const NewtonGraphs& graphs, std::span<const at::Tensor> u,
                                const SolverConfig& config);

/// newton_solve's contract, on rows (runs_on_rows). Every row that iterates is in the
/// working set of each graph call, and no other: rows leave it as soon as they converge or
/// fail. A row whose A has a zero or non-finite pivot fails, with its last residual norm.
[[nodiscard]] NewtonResult newton_solve_rows(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                             const std::vector<at::Tensor>& givens,
                                             const std::vector<at::Tensor>& params,
                                             const SolverConfig& config, bool gate_relative);

} // namespace neml2::detail
