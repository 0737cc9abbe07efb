#pragma once

// Newton per row in tensor operations, for every plan but the row pass (newton_plan.hpp):
// rows that converged are frozen, and once few rows are left the graphs run on those rows
// alone (gathered into a dense batch). Each step is the plan's strategy: the solve graph,
// LAPACK's rows (lapack_rows.hpp) or GMRES (krylov_step.cpp). Private to src/implicit/.

#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton_graphs.hpp"
#include "implicit/newton_plan.hpp"

namespace neml2::detail {

/// The rows still being evaluated and their state; `index` maps them to the batch
/// (undefined while the working set is the whole batch, in order).
struct WorkingSet {
  at::Tensor index;
  /// The last jacobian graph's outputs (a Krylov step: the residual graph's b).
  std::vector<at::Tensor> u, givens, jacobian;
  /// A Krylov step's preconditioner state (per row) and each row's last GMRES iterations.
  std::vector<at::Tensor> precond;
  at::Tensor krylov_iterations;
  at::Tensor r0, norm, converged, failed, active;
  std::int64_t n_active = 0;

  [[nodiscard]] std::int64_t rows() const { return r0.size(0); }
  /// The iteration's one host read: how many rows iterate decides whether the loop goes
  /// on and whether the working set shrinks.
  void update_active();
};

/// Flat `(rows, n)` from one tensor per group, and back (`like`: the groups' shapes).
[[nodiscard]] at::Tensor flatten_groups(const std::vector<at::Tensor>& groups);
[[nodiscard]] std::vector<at::Tensor> split_groups(const at::Tensor& flat,
                                                   const std::vector<at::Tensor>& like);

/// NEML2's line search along the step `du` (per unknown group) of the working set's rows
/// that iterate (`w.active`), from its jacobian graph's b: each row's alpha, `(rows,)`.
[[nodiscard]] at::Tensor line_search(const NewtonGraphs& graphs, const WorkingSet& w,
                                     const std::vector<at::Tensor>& du,
                                     const std::vector<at::Tensor>& params,
                                     const SolverConfig& config);

/// A Krylov Newton step du per unknown group (krylov_step.cpp).
[[nodiscard]] std::vector<at::Tensor> krylov_step(const NewtonGraphs& graphs, WorkingSet& w,
                                                  const std::vector<at::Tensor>& params,
                                                  const SolverConfig::Krylov& config);

/// The chord on the tensor path (CPU, double: block groups, LAPACK-sized systems): each row
/// steps from the LU of the last A it took, kept in its slot of `factors` (`(B,
/// chord_slot_width(n))`, rows contiguous; none: this solve's own), calling the residual
/// graph alone, until chord_refactors says it takes A again (the jacobian graph on such rows
/// alone). A step from an older factor that does not lower ||r|| (with a line search: by its
/// sufficient decrease at alpha = 1) is taken back, and A taken where it started; a step
/// from a new A takes the line search when there is one. Rows converge by NEML2's test.
[[nodiscard]] NewtonResult
newton_solve_tensor_chord(const NewtonGraphs& graphs, const NewtonPlan& plan,
                          const std::vector<at::Tensor>& u0, const std::vector<at::Tensor>& givens,
                          const std::vector<at::Tensor>& params, const SolverConfig& config,
                          bool gate_relative, const at::Tensor& factors);

/// newton_solve's contract (newton.hpp) in tensor operations.
[[nodiscard]] NewtonResult newton_solve_tensors(const NewtonGraphs& graphs, const NewtonPlan& plan,
                                                std::vector<at::Tensor> u0,
                                                const std::vector<at::Tensor>& givens,
                                                const std::vector<at::Tensor>& params,
                                                const SolverConfig& config, bool gate_relative);

} // namespace neml2::detail
