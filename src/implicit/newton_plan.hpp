#pragma once

// Which Newton an implicit segment runs, decided once when its session loads (and again
// when its solver config changes): the one place that says which strategy solves a
// segment's steps, where its derivatives' solves run, and whether it keeps the chord's
// factors. Every solver of src/implicit/ reads its segment's plan; none decides again.
// Private to the library.

#include <cstdint>
#include <span>
#include <string>

#include <ATen/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <neml2/artifact.hpp>

#include "implicit/newton_graphs.hpp"

namespace neml2::detail {

/// The most unknowns per row the row pass solves. Its LU (row_lu.hpp, several rows in
/// SIMD lanes) beats batched LAPACK up to about 64 unknowns and loses beyond (1.5x at 128,
/// 4x at 300: docs/performance.md); larger systems take the tensor path, their solves
/// LAPACK's, row by row on the CPU (lapack_rows.hpp).
inline constexpr std::int64_t row_pass_max_unknowns = 64;

/// How a segment's Newton steps are taken.
enum class NewtonStrategy {
  /// The row pass (newton_rows.hpp): every step between graph calls one pass over the
  /// rows, each row's LU ours; the dense Newton, its line search and the chord there.
  rows,
  /// The tensor path (tensor_newton.hpp), each step solved by LAPACK row by row
  /// (lapack_rows.hpp): dense systems beyond row_pass_max_unknowns on the CPU.
  lapack_rows,
  /// The tensor path, each step by the solve graph: block-structured groups (the graph
  /// eliminates NEML2's per-entry blocks), accelerators, single precision, or the row pass
  /// turned off (SolverConfig::row_pass).
  solve_graph,
  /// The tensor path, each step by GMRES on the matvec graph (krylov_step.cpp).
  krylov,
};

/// Where the implicit function theorem's solves -A^{-1} C run (chain_derivatives.cpp).
enum class DerivativeSolve { rows, lapack_rows, graphs };

/// What a plan is decided from: the segment's shape, device, dtype and solver config.
struct NewtonShape {
  std::int64_t unknowns = 0; ///< per row, over every unknown group
  bool krylov = false;       ///< a matvec graph in place of A
  bool block_groups = false; ///< a block-structured variable group
};

struct NewtonPlan {
  NewtonStrategy strategy = NewtonStrategy::solve_graph;
  DerivativeSolve derivatives = DerivativeSolve::graphs;
  std::int64_t unknowns = 0;
  /// The first value of the segment's slot in a NewtonFactors row, or -1 where the layout
  /// has none (has_factor_slot).
  std::int64_t factor_column = -1;
  c10::Device device = c10::kCPU; ///< what it was made for
  c10::ScalarType dtype = c10::kDouble;

  /// Whether a solve keeps each row's factor (the chord, when asked for): every direct
  /// strategy on the CPU in double (the row pass's own; the others', tensor_chord.cpp).
  [[nodiscard]] bool keeps_factors() const noexcept {
    return strategy == NewtonStrategy::rows ||
           (strategy != NewtonStrategy::krylov && device.is_cpu() && dtype == c10::kDouble);
  }
};

/// The shape of `segment`'s Newton: its unknowns (the widths its groups hold) and kind.
[[nodiscard]] NewtonShape newton_shape(const ImplicitSegment& segment);

/// Whether a NewtonFactors row holds a slot for a segment of this shape: whatever the
/// device, every segment with direct steps (dense or block groups, any size; not Krylov).
[[nodiscard]] bool has_factor_slot(const NewtonShape& shape);

/// The plan of a segment of `shape` on `device` in `dtype` under `config`.
[[nodiscard]] NewtonPlan plan_newton(const NewtonShape& shape, c10::Device device,
                                     c10::ScalarType dtype, const SolverConfig& config);

/// The plan of graphs written by hand (tests, benchmarks): their shape read from the
/// unknown groups `u` (`(B, ...)` each), their device and dtype from `u`'s.
[[nodiscard]] NewtonPlan plan_newton(const NewtonGraphs& graphs, std::span<const at::Tensor> u,
                                     const SolverConfig& config);

/// The unknowns per row of the unknown groups `u` (`(B, ...)` each): every group's sizes
/// after the batch axis, multiplied, summed.
[[nodiscard]] std::int64_t unknowns_per_row(std::span<const at::Tensor> u);

/// Refuses (FatalError: a bug of the library) unknowns `u` that `plan` was not made for:
/// another count per row, device or, on the row pass, dtype.
void check_plan(const NewtonPlan& plan, std::span<const at::Tensor> u);

/// The strategy's name, for messages and tests.
[[nodiscard]] std::string to_string(NewtonStrategy strategy);

} // namespace neml2::detail
