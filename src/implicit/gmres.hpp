#pragma once

// Restarted, left-preconditioned GMRES per row over linear operators given as functions
// (the linear solve of a Krylov Newton step). Private to the library (src/).

#include <functional>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

namespace neml2::detail {

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
/// stops extending its basis once its residual estimate is within tolerance, at `max_its` steps
/// in all, or at a breakdown: a new column that is not finite or a zero pivot, left out), each
/// followed by the update and, while below `max_its`, the true residual. Rows are solved in
/// lock-step but each row's result depends on that row alone (rows that stopped ride along unused).
/// Only the rows of `active` are solved (undefined: all); the others get x = 0.
[[nodiscard]] KrylovResult gmres(const KrylovOperators& ops, const at::Tensor& b,
                                 const SolverConfig::Krylov& config, const at::Tensor& active = {},
                                 GmresKernel kernel = GmresKernel::automatic);

} // namespace neml2::detail
