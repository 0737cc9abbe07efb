// Newton per row with an active set: rows that converged are frozen, and once few rows
// are left the graphs run on those rows alone (gathered into a dense batch).

#include "newton.hpp"

#include <limits>

#include <ATen/ATen.h>

namespace neml2::detail {
namespace {

std::vector<at::Tensor> graph_args(const std::vector<at::Tensor>& u,
                                   const std::vector<at::Tensor>& givens,
                                   const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> args;
  args.reserve(u.size() + givens.size() + params.size());
  args.insert(args.end(), u.begin(), u.end());
  args.insert(args.end(), givens.begin(), givens.end());
  args.insert(args.end(), params.begin(), params.end());
  return args;
}

// ||r|| of each row over every residual group (tensors [first, end) of `b`).
at::Tensor row_norm(const std::vector<at::Tensor>& b, std::size_t first) {
  at::Tensor squares;
  for (auto i = first; i < b.size(); ++i) {
    const auto s = b[i].reshape({b[i].size(0), -1}).square().sum(1);
    squares = squares.defined() ? squares + s : s;
  }
  return squares.sqrt();
}

void select_rows(std::vector<at::Tensor>& tensors, const at::Tensor& keep) {
  for (auto& t : tensors)
    t = t.index_select(0, keep);
}

// The rows still being evaluated and their state; `index` maps them to the batch
// (undefined while the working set is the whole batch, in order).
struct WorkingSet {
  at::Tensor index;
  std::vector<at::Tensor> u, givens, jacobian; // jacobian: the last jacobian graph's outputs
  at::Tensor r0, norm, converged, failed, active;
  std::int64_t n_active = 0;

  [[nodiscard]] std::int64_t rows() const { return r0.size(0); }

  void update_active() {
    active = ~(converged | failed);
    n_active = active.sum().item<std::int64_t>();
  }
};

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
  const auto keep = w.active.nonzero().squeeze(1);
  w.index = w.index.defined() ? w.index.index_select(0, keep) : keep;
  select_rows(w.u, keep);
  select_rows(w.givens, keep);
  select_rows(w.jacobian, keep);
  w.r0 = w.r0.index_select(0, keep);
  w.norm = w.norm.index_select(0, keep);
  w.converged = w.converged.index_select(0, keep);
  w.failed = w.failed.index_select(0, keep);
  w.update_active();
}

// Backtracking per row: the largest alpha in 1, 1/cutback, ... (at most ls_max_iters
// tries) with ||r(u + alpha du)||^2 <= (1 - 2 c alpha) ||r(u)||^2, the sufficient decrease
// of ||r||^2 / 2 along the Newton direction (whose slope there is -||r||^2). A row that
// never meets it takes the last alpha tried. Rows that are not iterating keep alpha = 1.
at::Tensor backtrack(const NewtonGraphs& graphs, const WorkingSet& w,
                     const std::vector<at::Tensor>& du, const std::vector<at::Tensor>& params,
                     const SolverConfig& config) {
  auto alpha = at::ones({w.rows()}, w.norm.options());
  const auto r2 = w.norm.square();
  auto settled = ~w.active;
  for (std::int64_t i = 0; i < config.ls_max_iters; ++i) {
    std::vector<at::Tensor> trial;
    for (std::size_t k = 0; k < w.u.size(); ++k)
      trial.push_back(w.u[k] + alpha.unsqueeze(1) * du[k].reshape(w.u[k].sizes()));
    const auto norm = row_norm(graphs.residual(graph_args(trial, w.givens, params)), 0);
    settled = settled | (norm.square() <= (1 - 2 * config.ls_c * alpha) * r2);
    if (settled.all().item<bool>() || i + 1 == config.ls_max_iters)
      break;
    alpha = at::where(settled, alpha, alpha / config.ls_cutback);
  }
  return alpha;
}

// Up to this many rows, Newton starts from the jacobian graph (see newton_solve).
constexpr std::int64_t small_batch = 64;

bool worth_compacting(const WorkingSet& w, double compact_below) {
  return w.n_active > 0 && w.n_active < w.rows() &&
         static_cast<double>(w.n_active) <= compact_below * static_cast<double>(w.rows());
}

} // namespace

NewtonResult newton_solve(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                          const std::vector<at::Tensor>& givens,
                          const std::vector<at::Tensor>& params, const SolverConfig& config) {
  WorkingSet w;
  w.u = std::move(u0);
  w.givens = givens;
  // The first residual: from the residual graph on large batches (converged rows never
  // need A, and the rest may be compacted first); on small ones from the jacobian graph,
  // one call instead of two when a row iterates.
  const auto rows = w.u.front().size(0);
  if (rows <= small_batch) {
    w.jacobian = graphs.jacobian(graph_args(w.u, w.givens, params));
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
      w.jacobian = graphs.jacobian(graph_args(w.u, w.givens, params));
  }
  for (std::int64_t it = 1; it < config.miters && w.n_active > 0; ++it) {
    auto du = graphs.solve(w.jacobian);
    if (config.ls_max_iters > 1) {
      const auto alpha = backtrack(graphs, w, du, params, config).unsqueeze(1);
      for (auto& d : du)
        d = alpha * d.reshape({d.size(0), -1});
    }
    // Every row of the working set iterating (the common case at small batches): no masks.
    const bool all_active = w.n_active == w.rows();
    const auto moving = w.active.unsqueeze(1);
    for (std::size_t k = 0; k < w.u.size(); ++k) {
      const auto next = w.u[k] + du[k].reshape(w.u[k].sizes());
      w.u[k] = all_active ? next : at::where(moving, next, w.u[k]);
    }
    // The jacobian graph also returns b = -r at the new iterate: one call checks
    // convergence and prepares the next step.
    w.jacobian = graphs.jacobian(graph_args(w.u, w.givens, params));
    const auto norm = row_norm(w.jacobian, graphs.a_blocks);
    const auto converged = (norm < config.atol) | (norm < config.rtol * w.r0);
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
  const auto unconverged = ~result.converged;
  if (unconverged.any().item<bool>()) {
    const auto norms = batch.norm.masked_select(unconverged);
    result.worst_residual = at::isfinite(norms).all().item<bool>()
                                ? norms.max().item<double>()
                                : std::numeric_limits<double>::quiet_NaN();
  }
  return result;
}

} // namespace neml2::detail
