// Newton per row in tensor operations (tensor_newton.hpp): an active set, compacted as
// rows leave, each step the plan's.

#include "implicit/tensor_newton.hpp"

#include <algorithm>

#include <ATen/ATen.h>

#include "implicit/block_groups.hpp"
#include "implicit/host_reads.hpp"
#include "implicit/lapack_rows.hpp"
#include "implicit/row_failures.hpp"

namespace neml2::detail {

void WorkingSet::update_active() {
  active = ~(converged | failed);
  n_active = to_host<std::int64_t>(active.sum());
}

at::Tensor flatten_groups(const std::vector<at::Tensor>& groups) {
  std::vector<at::Tensor> flat;
  for (const auto& g : groups)
    flat.push_back(g.reshape({g.size(0), -1}));
  return flat.size() == 1 ? flat.front() : at::cat(flat, 1);
}

std::vector<at::Tensor> split_groups(const at::Tensor& flat, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> groups;
  std::int64_t offset = 0;
  for (const auto& g : like) {
    const auto width = g.numel() / std::max<std::int64_t>(g.size(0), 1);
    groups.push_back(flat.narrow(1, offset, width).contiguous());
    offset += width;
  }
  return groups;
}

namespace {

// ||r|| of each row over every residual group (tensors [first, end) of `b`).
at::Tensor row_norm(const std::vector<at::Tensor>& b, std::size_t first) {
  at::Tensor squares;
  for (auto i = first; i < b.size(); ++i) {
    const auto s = b[i].reshape({b[i].size(0), -1}).square().sum(1);
    squares = squares.defined() ? squares + s : s;
  }
  return squares.sqrt();
}

// `(rows,)` as `(rows, 1, ...)`: row by row against `like` (a block group in the graphs'
// layout has sub-batch axes).
at::Tensor per_row(const at::Tensor& v, const at::Tensor& like) {
  c10::DimVector sizes(static_cast<std::size_t>(like.dim()), 1);
  sizes[0] = v.size(0);
  return v.view(sizes);
}

void select_rows(std::vector<at::Tensor>& tensors, const at::Tensor& keep) {
  for (auto& t : tensors)
    t = t.index_select(0, keep);
}

// The batch-wide result, filled from the working set before it shrinks and at the end.
struct BatchState {
  std::vector<at::Tensor> u;
  at::Tensor norm, converged;

  void take(const WorkingSet& w) {
    if (!w.index.defined()) {
      u = w.u;
      norm = w.norm;
      converged = w.converged;
      return;
    }
    for (std::size_t k = 0; k < u.size(); ++k)
      u[k].index_copy_(0, w.index, w.u[k]);
    norm.index_copy_(0, w.index, w.norm);
    converged.index_copy_(0, w.index, w.converged);
  }
};

void compact(WorkingSet& w, BatchState& batch) {
  if (w.index.defined())
    batch.take(w);
  else { // the first cut: batch-wide copies of our own, to write rows into later
    batch.u.clear();
    for (const auto& t : w.u)
      batch.u.push_back(t.clone());
    batch.norm = w.norm.clone();
    batch.converged = w.converged.clone();
  }
  // n_active rows are active: their indices without a read back (nonzero's size is unknown).
  const auto keep = at::nonzero_static(w.active, w.n_active).squeeze(1);
  w.index = w.index.defined() ? w.index.index_select(0, keep) : keep;
  select_rows(w.u, keep);
  select_rows(w.givens, keep);
  select_rows(w.jacobian, keep);
  select_rows(w.precond, keep);
  if (w.krylov_iterations.defined())
    w.krylov_iterations = w.krylov_iterations.index_select(0, keep);
  w.r0 = w.r0.index_select(0, keep);
  w.norm = w.norm.index_select(0, keep);
  w.converged = w.converged.index_select(0, keep);
  w.failed = w.failed.index_select(0, keep);
  w.active = ~(w.converged | w.failed); // every row kept iterates: n_active stays
}

// Per-row inner product of two lists of `(rows, ...)` tensors, flattened and joined.
at::Tensor row_dot(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  return (flatten_groups(a) * flatten_groups(b)).sum(1);
}

// The plan's Newton step du per unknown group: A du = b by the solve graph (block groups:
// NEML2's per-entry blocks, eliminated entry by entry) or LAPACK's rows (lapack_rows.hpp:
// torch's batched LU in the graph goes wrong there on several intra-op threads), or GMRES.
std::vector<at::Tensor> newton_step(const NewtonGraphs& graphs, const NewtonPlan& plan,
                                    WorkingSet& w, const std::vector<at::Tensor>& params,
                                    const SolverConfig& config) {
  switch (plan.strategy) {
  case NewtonStrategy::krylov:
    return krylov_step(graphs, w, params, config.krylov);
  case NewtonStrategy::lapack_rows:
    return lapack_rows_step(w.jacobian, graphs.a_blocks, w.u);
  default:
    return graphs.solve(w.jacobian);
  }
}

bool worth_compacting(const WorkingSet& w, double compact_below) {
  return w.n_active > 0 && w.n_active < w.rows() &&
         static_cast<double>(w.n_active) <= compact_below * static_cast<double>(w.rows());
}

} // namespace

// The line search of NEML2's Newton (as its runtime behaves, measured: see
// docs/architecture.md), per row: alpha = 1, 1/cutback, ... for at most ls_max_iters - 1
// residual evaluations; a row stops at the first alpha with ||b(u + alpha du)||^2 <= crit
// or <= atol^2, where crit is
//   BACKTRACKING:  ||b0||^2 - 2 c alpha <b0, du>
//   STRONG_WOLFE:  (1 - c alpha) ||b0||^2
// (b = -r; NEML2's "strong Wolfe" is this sufficient-decrease test, with no curvature
// condition). A row that never stops takes the last alpha evaluated. Rows that are not
// iterating keep alpha = 1.
at::Tensor line_search(const NewtonGraphs& graphs, const WorkingSet& w,
                       const std::vector<at::Tensor>& du, const std::vector<at::Tensor>& params,
                       const SolverConfig& config) {
  auto alpha = at::ones({w.rows()}, w.norm.options());
  const auto nb0 = w.norm.square();
  const bool strong_wolfe = config.ls_type == "STRONG_WOLFE";
  at::Tensor slope; // <b0, du>
  if (!strong_wolfe)
    slope = row_dot(
        std::vector<at::Tensor>(w.jacobian.begin() + static_cast<std::ptrdiff_t>(graphs.a_blocks),
                                w.jacobian.end()),
        du);
  auto settled = ~w.active;
  for (std::int64_t i = 1; i < config.ls_max_iters; ++i) {
    std::vector<at::Tensor> trial;
    for (std::size_t k = 0; k < w.u.size(); ++k)
      trial.push_back(w.u[k] + per_row(alpha, w.u[k]) * du[k].reshape(w.u[k].sizes()));
    const auto nb = row_norm(graphs.residual(graph_args(trial, w.givens, params)), 0).square();
    const auto crit =
        strong_wolfe ? (1 - config.ls_c * alpha) * nb0 : nb0 - 2 * config.ls_c * alpha * slope;
    settled = settled | (nb <= crit) | (nb <= config.atol * config.atol);
    if (i + 1 == config.ls_max_iters || to_host<bool>(settled.all()))
      break;
    alpha = at::where(settled, alpha, alpha / config.ls_cutback);
  }
  return alpha;
}

NewtonResult newton_solve_tensors(const NewtonGraphs& graphs, const NewtonPlan& plan,
                                  std::vector<at::Tensor> u0, const std::vector<at::Tensor>& givens,
                                  const std::vector<at::Tensor>& params, const SolverConfig& config,
                                  bool gate_relative) {
  // Block groups by the solve graph: the graphs' layout throughout, converted here alone.
  if (plan.strategy == NewtonStrategy::solve_graph && graphs.in_graph_layout)
    return solve_in_graph_layout(*graphs.in_graph_layout, u0, givens,
                                 [&](const NewtonGraphs& in_graph, auto u, const auto& g) {
                                   return newton_solve_tensors(in_graph, plan, std::move(u), g,
                                                               params, config, gate_relative);
                                 });
  WorkingSet w;
  w.u = u0; // the guesses kept: row_failures reads them when a row fails
  w.givens = givens;
  // The first residual: from the jacobian graph on small batches (first_from_jacobian).
  const auto rows = w.u.front().size(0);
  const bool krylov = plan.strategy == NewtonStrategy::krylov;
  // What a step starts from: A and b (direct), or b alone (Krylov: A only through matvec).
  const auto& operands = krylov ? graphs.residual : graphs.jacobian;
  if (rows <= first_from_jacobian || krylov) {
    w.jacobian = operands(graph_args(w.u, w.givens, params));
    w.norm = row_norm(w.jacobian, graphs.a_blocks);
  } else
    w.norm = row_norm(graphs.residual(graph_args(w.u, w.givens, params)), 0);
  w.r0 = w.norm;
  w.converged = w.norm < config.atol;
  w.failed = ~at::isfinite(w.norm);
  w.update_active();

  BatchState batch;
  NewtonResult result;
  if (w.n_active > 0) {
    if (worth_compacting(w, config.compact_below))
      compact(w, batch);
    if (w.jacobian.empty())
      w.jacobian = operands(graph_args(w.u, w.givens, params));
  }
  for (std::int64_t it = 1; it < config.miters && w.n_active > 0; ++it) {
    auto du = newton_step(graphs, plan, w, params, config);
    // ls_max_iters = 2 evaluates alpha = 1 only and takes it: the full step, as with 1.
    if (config.ls_max_iters > 2) {
      const auto alpha = line_search(graphs, w, du, params, config).unsqueeze(1);
      for (auto& d : du)
        d = alpha * d.reshape({d.size(0), -1});
    }
    // Every row of the working set iterating (the common case at small batches): no masks.
    const bool all_active = w.n_active == w.rows();
    for (std::size_t k = 0; k < w.u.size(); ++k) {
      const auto next = w.u[k] + du[k].reshape(w.u[k].sizes());
      w.u[k] = all_active ? next : at::where(per_row(w.active, w.u[k]), next, w.u[k]);
    }
    // The jacobian graph also returns b = -r at the new iterate: one call checks
    // convergence and prepares the next step.
    w.jacobian = operands(graph_args(w.u, w.givens, params));
    const auto norm = row_norm(w.jacobian, graphs.a_blocks);
    const auto absolute = norm < config.atol;
    auto relative = norm < config.rtol * w.r0;
    // The update must be small too. Only rows the relative test alone passes can tell, so
    // asking it of every row gives the same rows, without reading back whether there are any.
    if (gate_relative)
      relative =
          relative & (row_norm(du, 0) < config.substep_del_tol * (row_norm(w.u, 0) + config.atol));
    const auto converged = absolute | relative;
    if (all_active) {
      w.norm = norm;
      w.converged = converged;
      w.failed = ~at::isfinite(norm);
    } else {
      w.norm = at::where(w.active, norm, w.norm);
      w.converged = w.converged | (w.active & converged);
      w.failed = w.failed | (w.active & ~at::isfinite(norm));
    }
    w.update_active();
    result.iterations = it;
    if (worth_compacting(w, config.compact_below))
      compact(w, batch);
  }
  batch.take(w);

  result.u = std::move(batch.u);
  result.converged = std::move(batch.converged);
  result.norm = std::move(batch.norm);
  const auto failed = failed_rows(result.converged, result.norm);
  result.worst_residual = failed.worst_residual;
  if (failed.any)
    result.reasons = row_failures(result.converged, result.norm, result.u, u0, givens);
  return result;
}

} // namespace neml2::detail
