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
///
/// The chord (SolverConfig::chord, or `factors` given; not with a line search): a row
/// steps from the LU of the last A it took, and only the residual graph is called, until
/// chord_refactors says so (its ||r|| falls by less than `chord_rate` a step, or would not
/// reach its tolerance within miters at that rate): then it takes A where it is (the
/// jacobian graph on the rows that do, alone). A step from an A taken at an earlier iterate (or
/// call) that does not lower ||r|| is taken back, and A taken where it started. Rows converge by
/// NEML2's test. `factors`: `(B, chord_slot_width(n))` double, contiguous rows, a row's slot kept
/// from call to call (its first value 1 where it holds a factor); none: slots for this solve.
[[nodiscard]] NewtonResult newton_solve_rows(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                             const std::vector<at::Tensor>& givens,
                                             const std::vector<at::Tensor>& params,
                                             const SolverConfig& config, bool gate_relative,
                                             const at::Tensor& factors);

} // namespace neml2::detail
