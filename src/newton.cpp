// Newton per row with an active set: rows that converged are frozen, and once few rows
// are left the graphs run on those rows alone (gathered into a dense batch).

#include "newton.hpp"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

namespace neml2::detail {
namespace {

// Every value the loops below read back from their tensors passes through these two: on an
// accelerator each read is a host synchronization, which leaves the device idle for the
// launch latency of what follows. Counted per thread for tests (newton_host_reads()).
thread_local std::uint64_t host_reads = 0;

template <class T>
T to_host(const at::Tensor& t) {
  ++host_reads;
  return t.item<T>();
}

// The indices where `mask` (rows,) is true.
at::Tensor rows_where(const at::Tensor& mask) {
  ++host_reads;
  return mask.nonzero().squeeze(1);
}

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

// Flat `(rows, n)` <-> one tensor per group `(rows, width)`.
at::Tensor flatten(const std::vector<at::Tensor>& groups) {
  std::vector<at::Tensor> flat;
  for (const auto& g : groups)
    flat.push_back(g.reshape({g.size(0), -1}));
  return flat.size() == 1 ? flat.front() : at::cat(flat, 1);
}

std::vector<at::Tensor> split(const at::Tensor& flat, const std::vector<at::Tensor>& like) {
  std::vector<at::Tensor> groups;
  std::int64_t offset = 0;
  for (const auto& g : like) {
    const auto width = g.numel() / std::max<std::int64_t>(g.size(0), 1);
    groups.push_back(flat.narrow(1, offset, width).contiguous());
    offset += width;
  }
  return groups;
}

void select_rows(std::vector<at::Tensor>& tensors, const at::Tensor& keep) {
  for (auto& t : tensors)
    t = t.index_select(0, keep);
}

// The rows still being evaluated and their state; `index` maps them to the batch
// (undefined while the working set is the whole batch, in order).
struct WorkingSet {
  at::Tensor index;
  // jacobian: the last jacobian graph's outputs (a Krylov step: the residual graph's b)
  std::vector<at::Tensor> u, givens, jacobian;
  // A Krylov step's preconditioner state (per row) and each row's last GMRES iterations.
  std::vector<at::Tensor> precond;
  at::Tensor krylov_iterations;
  at::Tensor r0, norm, converged, failed, active;
  std::int64_t n_active = 0;

  [[nodiscard]] std::int64_t rows() const { return r0.size(0); }

  // The iteration's one host read: how many rows iterate decides whether the loop goes
  // on and whether the working set shrinks.
  void update_active() {
    active = ~(converged | failed);
    n_active = to_host<std::int64_t>(active.sum());
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
  return (flatten(a) * flatten(b)).sum(1);
}

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
      trial.push_back(w.u[k] + alpha.unsqueeze(1) * du[k].reshape(w.u[k].sizes()));
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

// Up to this many rows, Newton starts from the jacobian graph (see newton_solve).
constexpr std::int64_t small_batch = 64;

// The largest ||r|| of a row that failed (NaN when one is not finite, 0 when none failed),
// in one read.
double worst_residual(const at::Tensor& converged, const at::Tensor& norm) {
  constexpr auto none = -std::numeric_limits<double>::infinity();
  if (norm.numel() == 0)
    return 0;
  const auto failed = ~converged;
  const auto not_finite = (failed & ~at::isfinite(norm)).any();
  const auto worst = to_host<double>(at::where(not_finite, std::numeric_limits<double>::quiet_NaN(),
                                               at::where(failed, norm, none).max()));
  return worst == none ? 0 : worst;
}

bool worth_compacting(const WorkingSet& w, double compact_below) {
  return w.n_active > 0 && w.n_active < w.rows() &&
         static_cast<double>(w.n_active) <= compact_below * static_cast<double>(w.rows());
}

// A Krylov Newton step du per unknown group: GMRES on the matvec graph at the working
// set's iterate, for its active rows, with the preconditioner kept as the cache strategy
// says (none: rebuilt every step; chord: built at the first step of the solve; max_its:
// rebuilt for the rows whose last linear solve took more than cache_max_its iterations).
std::vector<at::Tensor> krylov_step(const NewtonGraphs& graphs, WorkingSet& w,
                                    const std::vector<at::Tensor>& params,
                                    const SolverConfig::Krylov& config) {
  const auto args = graph_args(w.u, w.givens, params);
  KrylovOperators ops;
  ops.apply = [&](const at::Tensor& v) {
    auto with_v = args;
    for (auto& part : split(v, w.u))
      with_v.push_back(std::move(part));
    return flatten(graphs.matvec(with_v));
  };
  if (graphs.precond_setup) {
    const bool first = w.precond.empty();
    if (first || config.cache_strategy == "none")
      w.precond = graphs.precond_setup(args);
    else if (config.cache_strategy == "max_its") {
      const auto stale = w.krylov_iterations > config.cache_max_its;
      if (to_host<bool>(stale.any())) {
        auto fresh = graphs.precond_setup(args);
        for (std::size_t k = 0; k < fresh.size(); ++k) {
          auto shape = std::vector<std::int64_t>(static_cast<std::size_t>(fresh[k].dim()), 1);
          shape[0] = stale.size(0);
          w.precond[k] = at::where(stale.reshape(shape), fresh[k], w.precond[k]);
        }
      }
    }
    ops.precondition = [&](const at::Tensor& r) {
      auto state = w.precond;
      state.push_back(r.contiguous());
      return graphs.precond_apply(state).front();
    };
  }
  auto solved = gmres(ops, flatten(w.jacobian), config, w.active);
  w.krylov_iterations = solved.iterations;
  return split(solved.x, w.u);
}

// One restart cycle of GMRES per row: the Arnoldi basis `(k + 1, rows, n)` (vector j of
// every row contiguous, as the operators take it), the Hessenberg matrix `(rows, k + 1, k)`
// kept upper triangular by Givens rotations (cs, sn `(rows, k)`), the rotated residual
// estimates g `(rows, k + 1)`, the rows still extending their basis and how far each got.
// k starts small and grows up to `restart` as steps need it: at restart 40 and many rows,
// zeroing the full matrices costs more than the few steps a small system takes.
struct ArnoldiCycle {
  at::Tensor basis, h, g, cs, sn, open, used;

  ArnoldiCycle(const at::Tensor& z, const at::Tensor& beta, const at::Tensor& running,
               std::int64_t m) {
    const auto rows = z.size(0), k = std::min<std::int64_t>(m, 8);
    const auto options = z.options();
    basis = at::zeros({k + 1, rows, z.size(1)}, options);
    basis.select(0, 0).copy_(z / at::where(running, beta, 1).unsqueeze(1));
    h = at::zeros({rows, k + 1, k}, options);
    g = at::zeros({rows, k + 1}, options);
    g.select(1, 0).copy_(at::where(running, beta, 0));
    cs = at::zeros({rows, k}, options);
    sn = at::zeros({rows, k}, options);
    open = running.clone();
    used = at::zeros({rows}, options.dtype(at::kLong));
  }

  /// Room for Arnoldi step j (at most m steps in all).
  void reserve(std::int64_t j, std::int64_t m) {
    const auto k = h.size(2);
    if (j < k)
      return;
    const auto grown = std::min(2 * k, m);
    const auto larger = [](const at::Tensor& t, std::vector<std::int64_t> sizes) {
      auto out = at::zeros(sizes, t.options());
      auto part = out;
      for (std::int64_t d = 0; d < t.dim(); ++d)
        part = part.narrow(d, 0, t.size(d));
      part.copy_(t);
      return out;
    };
    const auto rows = h.size(0);
    basis = larger(basis, {grown + 1, rows, basis.size(2)});
    h = larger(h, {rows, grown + 1, grown});
    g = larger(g, {rows, grown + 1});
    cs = larger(cs, {rows, grown});
    sn = larger(sn, {rows, grown});
  }
};

// Arnoldi step j with tensor operations (any device): modified Gram-Schmidt of w against
// the basis, the previous rotations applied to H's new column, a new rotation zeroing its
// subdiagonal, g rotated with it.
void arnoldi_step_tensors(ArnoldiCycle& c, at::Tensor w, std::int64_t j, const at::Tensor& tol) {
  for (std::int64_t i = 0; i <= j; ++i) {
    const auto vi = c.basis.select(0, i);
    const auto hij = (w * vi).sum(1);
    c.h.select(2, j).select(1, i).copy_(hij);
    w = w - hij.unsqueeze(1) * vi;
  }
  const auto next = w.norm(2, 1);
  c.h.select(2, j).select(1, j + 1).copy_(next);
  c.basis.select(0, j + 1).copy_(w / at::where(next > 0, next, 1).unsqueeze(1));
  auto column = c.h.select(2, j);
  for (std::int64_t i = 0; i < j; ++i) {
    const auto top = column.select(1, i).clone(), bottom = column.select(1, i + 1).clone();
    const auto ci = c.cs.select(1, i), si = c.sn.select(1, i);
    column.select(1, i).copy_(ci * top + si * bottom);
    column.select(1, i + 1).copy_(-si * top + ci * bottom);
  }
  const auto diag = column.select(1, j).clone(), below = column.select(1, j + 1).clone();
  const auto radius = at::hypot(diag, below);
  const auto safe = at::where(radius > 0, radius, 1);
  const auto cj = at::where(radius > 0, diag / safe, 1),
             sj = at::where(radius > 0, below / safe, 0);
  c.cs.select(1, j).copy_(cj);
  c.sn.select(1, j).copy_(sj);
  column.select(1, j).copy_(radius);
  column.select(1, j + 1).zero_();
  const auto gj = c.g.select(1, j).clone();
  c.g.select(1, j + 1).copy_(-sj * gj);
  c.g.select(1, j).copy_(cj * gj);
  c.used = at::where(c.open, j + 1, c.used);
  c.open = c.open & (c.g.select(1, j + 1).abs() > tol) & (next > 0);
}

// x = V y with R y = g over each row's own `used` columns (identity beyond them).
at::Tensor cycle_step_tensors(const ArnoldiCycle& c, std::int64_t k) {
  const auto rows = c.h.size(0);
  const auto options = c.h.options();
  const auto in_use = at::arange(k, options.dtype(at::kLong)).unsqueeze(0) < c.used.unsqueeze(1);
  const auto square = in_use.unsqueeze(2) & in_use.unsqueeze(1);
  const auto eye = at::eye(k, options).expand({rows, k, k});
  const auto r = at::where(square, c.h.narrow(1, 0, k).narrow(2, 0, k), eye);
  const auto rhs = at::where(in_use, c.g.narrow(1, 0, k), 0).unsqueeze(2);
  const auto y = at::linalg_solve_triangular(r, rhs, /*upper=*/true).squeeze(2);
  return at::einsum("rk,krn->rn", {y, c.basis.narrow(0, 0, k)});
}

// The same two on CPU tensors, in plain arithmetic per row: at the few unknowns of a
// material point the tensor form is a stream of tiny operations, each costing more than
// its arithmetic. Same operations in the same order per row as the tensor form.
template <typename T>
void arnoldi_step_rows(ArnoldiCycle& c, at::Tensor w, std::int64_t j, const at::Tensor& tol) {
  w = w.contiguous();
  const auto rows = c.h.size(0), n = w.size(1), m = c.h.size(2);
  T* const wp = w.data_ptr<T>();
  T* const v = c.basis.data_ptr<T>();
  T* const h = c.h.data_ptr<T>();
  T* const g = c.g.data_ptr<T>();
  T* const cs = c.cs.data_ptr<T>();
  T* const sn = c.sn.data_ptr<T>();
  bool* const open = c.open.data_ptr<bool>();
  std::int64_t* const used = c.used.data_ptr<std::int64_t>();
  const T* const tolp = tol.data_ptr<T>();
  for (std::int64_t r = 0; r < rows; ++r) {
    if (!open[r])
      continue;
    T* const wr = wp + r * n;
    T* const hr = h + r * (m + 1) * m; // H(i, j) = hr[i * m + j]
    T* const gr = g + r * (m + 1);
    T* const cr = cs + r * m;
    T* const sr = sn + r * m;
    const auto vector = [&](std::int64_t i) { return v + (i * rows + r) * n; };
    for (std::int64_t i = 0; i <= j; ++i) {
      const T* const vi = vector(i);
      T hij = 0;
      for (std::int64_t l = 0; l < n; ++l)
        hij += wr[l] * vi[l];
      hr[i * m + j] = hij;
      for (std::int64_t l = 0; l < n; ++l)
        wr[l] -= hij * vi[l];
    }
    T squares = 0;
    for (std::int64_t l = 0; l < n; ++l)
      squares += wr[l] * wr[l];
    const T next = std::sqrt(squares);
    T* const vj = vector(j + 1);
    for (std::int64_t l = 0; l < n; ++l)
      vj[l] = wr[l] / (next > 0 ? next : 1);
    hr[(j + 1) * m + j] = next;
    for (std::int64_t i = 0; i < j; ++i) {
      const T top = hr[i * m + j], bottom = hr[(i + 1) * m + j];
      hr[i * m + j] = cr[i] * top + sr[i] * bottom;
      hr[(i + 1) * m + j] = -sr[i] * top + cr[i] * bottom;
    }
    const T diag = hr[j * m + j], below = hr[(j + 1) * m + j];
    const T radius = std::hypot(diag, below);
    cr[j] = radius > 0 ? diag / radius : 1;
    sr[j] = radius > 0 ? below / radius : 0;
    hr[j * m + j] = radius;
    hr[(j + 1) * m + j] = 0;
    const T gj = gr[j];
    gr[j + 1] = -sr[j] * gj;
    gr[j] = cr[j] * gj;
    used[r] = j + 1;
    open[r] = std::abs(gr[j + 1]) > tolp[r] && next > 0;
  }
}

template <typename T>
at::Tensor cycle_step_rows(const ArnoldiCycle& c) {
  const auto rows = c.h.size(0), n = c.basis.size(2), m = c.h.size(2);
  auto x = at::zeros({rows, n}, c.h.options());
  T* const xp = x.data_ptr<T>();
  const T* const v = c.basis.data_ptr<T>();
  const T* const h = c.h.data_ptr<T>();
  const T* const g = c.g.data_ptr<T>();
  const std::int64_t* const used = c.used.data_ptr<std::int64_t>();
  std::vector<T> y(static_cast<std::size_t>(m));
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* const hr = h + r * (m + 1) * m;
    for (auto i = used[r] - 1; i >= 0; --i) { // back substitution
      T yi = g[r * (m + 1) + i];
      for (auto l = i + 1; l < used[r]; ++l)
        yi -= hr[i * m + l] * y[static_cast<std::size_t>(l)];
      y[static_cast<std::size_t>(i)] = yi / hr[i * m + i];
    }
    for (std::int64_t i = 0; i < used[r]; ++i)
      for (std::int64_t l = 0; l < n; ++l)
        xp[r * n + l] += y[static_cast<std::size_t>(i)] * v[(i * rows + r) * n + l];
  }
  return x;
}

} // namespace

KrylovResult gmres(const KrylovOperators& ops, const at::Tensor& b,
                   const SolverConfig::Krylov& config, const at::Tensor& active,
                   GmresKernel kernel) {
  const auto precondition = [&](const at::Tensor& r) {
    return ops.precondition ? ops.precondition(r) : r;
  };
  const auto rows = b.size(0);
  const auto m = config.restart;
  const auto options = b.options();
  const bool per_row = kernel == GmresKernel::automatic && b.device().is_cpu() &&
                       (b.scalar_type() == at::kDouble || b.scalar_type() == at::kFloat);
  const auto arnoldi_step = [&](ArnoldiCycle& c, const at::Tensor& w, std::int64_t j,
                                const at::Tensor& tol) {
    if (!per_row)
      return arnoldi_step_tensors(c, w, j, tol);
    AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "gmres",
                               [&] { arnoldi_step_rows<scalar_t>(c, w, j, tol); });
  };
  const auto cycle_step = [&](const ArnoldiCycle& c, std::int64_t k) {
    if (!per_row)
      return cycle_step_tensors(c, k);
    return AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "gmres",
                                      [&] { return cycle_step_rows<scalar_t>(c); });
  };
  auto x = at::zeros_like(b);
  // Left preconditioning: the residual tested is M^-1 (b - A x), against rel_tol ||b||
  // (NEML2's test: with M^-1 scaled by 1e-6 it stops before any step, by 1e6 it iterates).
  auto z = precondition(b);
  auto beta = z.norm(2, 1);
  const auto tol = at::clamp_min(config.rel_tol * b.norm(2, 1), config.abs_tol).contiguous();
  auto converged = beta <= tol;
  auto iterations = at::zeros({rows}, options.dtype(at::kLong));
  // Rows still solving (a row with a residual that is not finite has failed in Newton).
  auto running = ~converged & at::isfinite(beta);
  if (active.defined())
    running = running & active;
  while (to_host<bool>(running.any())) {
    ArnoldiCycle cycle(z, beta, running, m);
    std::int64_t steps = 0;
    for (; steps < m && to_host<bool>(cycle.open.any()); ++steps) {
      iterations = iterations + cycle.open.to(at::kLong);
      cycle.reserve(steps, m);
      arnoldi_step(cycle, precondition(ops.apply(cycle.basis.select(0, steps))), steps, tol);
    }
    x = x + at::where(running.unsqueeze(1), cycle_step(cycle, steps), 0);
    // NEML2 checks the iteration cap between cycles: a cycle always runs to its end.
    running = running & (iterations < config.max_its);
    if (!to_host<bool>(running.any()))
      break;
    z = precondition(b - ops.apply(x));
    beta = z.norm(2, 1);
    const auto now = running & (beta <= tol);
    converged = converged | now;
    running = running & ~now;
  }
  return {x, iterations, converged};
}

NewtonResult newton_solve(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                          const std::vector<at::Tensor>& givens,
                          const std::vector<at::Tensor>& params, const SolverConfig& config,
                          bool gate_relative) {
  WorkingSet w;
  w.u = std::move(u0);
  w.givens = givens;
  // The first residual: from the residual graph on large batches (converged rows never
  // need A, and the rest may be compacted first); on small ones from the jacobian graph,
  // one call instead of two when a row iterates.
  const auto rows = w.u.front().size(0);
  const bool krylov = static_cast<bool>(graphs.matvec);
  // What a step starts from: A and b (direct), or b alone (Krylov: A only through matvec).
  const auto& operands = krylov ? graphs.residual : graphs.jacobian;
  if (rows <= small_batch || krylov) {
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
    auto du = krylov ? krylov_step(graphs, w, params, config.krylov) : graphs.solve(w.jacobian);
    // ls_max_iters = 2 evaluates alpha = 1 only and takes it: the full step, as with 1.
    if (config.ls_max_iters > 2) {
      const auto alpha = line_search(graphs, w, du, params, config).unsqueeze(1);
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
  result.worst_residual = worst_residual(result.converged, result.norm);
  return result;
}

std::uint64_t newton_host_reads() noexcept {
  return host_reads;
}

} // namespace neml2::detail

namespace neml2::detail {
namespace {

at::Tensor slice(const std::vector<at::Tensor>& groups, const GroupSlice& s) {
  return groups[s.group].narrow(1, s.offset, s.size);
}

// Column of a slice in the flattened groups (sizes: each group's width).
std::int64_t column(const std::vector<std::int64_t>& offsets, const GroupSlice& s) {
  return offsets[s.group] + s.offset;
}

std::vector<std::int64_t> group_offsets(const std::vector<at::Tensor>& groups) {
  std::vector<std::int64_t> offsets{0};
  for (const auto& g : groups)
    offsets.push_back(offsets.back() + g.size(1));
  return offsets;
}

std::vector<at::Tensor> rows_of(const std::vector<at::Tensor>& groups, const at::Tensor& index) {
  std::vector<at::Tensor> out;
  for (const auto& g : groups)
    out.push_back(g.index_select(0, index));
  return out;
}

// d(span givens)/d(step givens), `(rows, n_g, n_g)`: identity for what stays, the
// interpolation weights of [begin, end] `(rows, 1)` for forces, the derivative carried from
// the previous span for old states (`chained_dg`, per chain `(rows, size, n_g)`).
at::Tensor span_weights(const SubstepPlan& plan, const std::vector<std::int64_t>& given_offsets,
                        std::int64_t n_g, const at::Tensor& begin, const at::Tensor& end,
                        const std::vector<at::Tensor>& chained_dg) {
  const auto rows = begin.size(0);
  const auto options = begin.options();
  auto weights = at::eye(n_g, options).expand({rows, n_g, n_g}).clone();
  const auto b = begin.unsqueeze(2), e = end.unsqueeze(2);
  for (const auto& r : plan.ramps) {
    const auto cur = column(given_offsets, r.current), old = column(given_offsets, r.old);
    const auto len = r.current.size;
    const auto eye = at::eye(len, options).expand({rows, len, len});
    auto cur_rows = weights.narrow(1, cur, len);
    auto old_rows = weights.narrow(1, old, len);
    cur_rows.zero_();
    old_rows.zero_();
    cur_rows.narrow(2, cur, len).copy_(e * eye);
    cur_rows.narrow(2, old, len).copy_((1 - e) * eye);
    old_rows.narrow(2, cur, len).copy_(b * eye);
    old_rows.narrow(2, old, len).copy_((1 - b) * eye);
  }
  for (std::size_t c = 0; c < plan.chains.size(); ++c)
    weights
        .narrow(1, column(given_offsets, plan.chains[c].old_state), plan.chains[c].old_state.size)
        .copy_(chained_dg[c]);
  return weights;
}

// The substepping state of the rows that failed in one step (all tensors over those rows).
// A row works through its step in spans [pos, pos + size) of 2^max_level units: the span
// it tries next, the depth of that span in the bisection tree, and what it carries from
// its last converged span (the solution, also the next initial guess, and the old states).
struct Substeps {
  at::Tensor rows;                    // indices into the batch
  std::vector<at::Tensor> full;       // the step's given groups
  std::vector<at::Tensor> u;          // last converged solution (or the initial guess)
  std::vector<at::Tensor> chained;    // per SubstepPlan::Chain: the old state
  at::Tensor pos, size, depth;        // int64
  at::Tensor done, dead, norm;        // converged through the step; failed at the bottom
  at::Tensor du_dg;                   // d(u)/d(full givens, extra) (rows, n_u, n_g), tracked
  std::vector<at::Tensor> chained_dg; // per chain: d(old state)/d(full givens)
};

} // namespace

NewtonResult solve_with_substeps(const NewtonGraphs& graphs, std::vector<at::Tensor> u0,
                                 const std::vector<at::Tensor>& givens,
                                 const std::vector<at::Tensor>& params, const SolverConfig& config,
                                 const SubstepPlan& plan, const DerivativeFn& du_dg,
                                 std::int64_t extra_columns) {
  if (plan.max_level <= 0)
    return newton_solve(graphs, std::move(u0), givens, params, config);
  const auto guesses = u0;
  auto result = newton_solve(graphs, std::move(u0), givens, params, config, true);
  const auto failed = rows_where(~result.converged);
  if (failed.numel() == 0)
    return result;

  const std::int64_t units = std::int64_t{1} << plan.max_level;
  const auto index_options = failed.options();
  Substeps s;
  s.rows = failed;
  const auto n = failed.numel();
  s.full = rows_of(givens, failed);
  s.u = rows_of(guesses, failed);
  for (auto& t : s.u) // a row of the guess may be a view of the caller's input
    t = t.contiguous();
  for (const auto& c : plan.chains)
    s.chained.push_back(slice(s.full, c.old_state).clone());
  s.pos = at::zeros({n}, index_options);
  s.size = at::full({n}, units / 2, index_options);
  s.depth = at::ones({n}, index_options);
  s.done = at::zeros({n}, index_options.dtype(at::kBool));
  s.dead = s.done.clone();
  s.norm = result.norm.index_select(0, failed);

  const auto given_offsets = group_offsets(s.full);
  const auto n_g = given_offsets.back() + extra_columns; // extra columns: static
  const auto unknown_offsets = group_offsets(s.u);
  const auto n_u = unknown_offsets.back();
  const bool track = static_cast<bool>(du_dg);
  if (track) {
    const auto eye = at::eye(n_g, s.full.front().options());
    s.du_dg = at::zeros({n, n_u, n_g}, eye.options());
    for (const auto& c : plan.chains)
      s.chained_dg.push_back(
          eye.narrow(0, column(given_offsets, c.old_state), c.old_state.size).expand({n, -1, -1}));
  }

  while (true) {
    const auto active = rows_where(~(s.done | s.dead));
    if (active.numel() == 0)
      break;
    const auto pos = s.pos.index_select(0, active);
    const auto size = s.size.index_select(0, active);
    const auto begin = (pos.to(s.norm.scalar_type()) / static_cast<double>(units)).unsqueeze(1);
    const auto end =
        ((pos + size).to(s.norm.scalar_type()) / static_cast<double>(units)).unsqueeze(1);

    // The span's givens: forces interpolated, old states chained, the rest as in the step.
    const auto full = rows_of(s.full, active);
    std::vector<at::Tensor> span;
    for (const auto& g : full)
      span.push_back(g.clone());
    for (const auto& r : plan.ramps) {
      const auto old = slice(full, r.old), current = slice(full, r.current);
      slice(span, r.current).copy_(at::lerp(old, current, end));
      slice(span, r.old).copy_(at::lerp(old, current, begin));
    }
    for (std::size_t c = 0; c < plan.chains.size(); ++c)
      slice(span, plan.chains[c].old_state).copy_(s.chained[c].index_select(0, active));

    auto solved = newton_solve(graphs, rows_of(s.u, active), span, params, config, true);
    const auto ok = solved.converged;
    const auto ok_index = rows_where(ok), bad_index = rows_where(~ok);
    const auto ok_rows = active.index_select(0, ok_index);
    const auto bad_rows = active.index_select(0, bad_index);

    // Converged spans: carry the solution, move on, climb back up the tree.
    if (ok_rows.numel() > 0) {
      const auto solution = rows_of(solved.u, ok_index);
      if (track) {
        std::vector<at::Tensor> chained_dg;
        for (const auto& c : s.chained_dg)
          chained_dg.push_back(c.index_select(0, ok_rows));
        const auto weights = span_weights(plan, given_offsets, n_g, begin.index_select(0, ok_index),
                                          end.index_select(0, ok_index), chained_dg);
        const auto d = at::matmul(du_dg(solution, rows_of(span, ok_index)), weights);
        s.du_dg.index_copy_(0, ok_rows, d);
        for (std::size_t c = 0; c < plan.chains.size(); ++c) {
          const auto& u = plan.chains[c].unknown;
          s.chained_dg[c] = s.chained_dg[c].index_copy(
              0, ok_rows, d.narrow(1, column(unknown_offsets, u), u.size));
        }
      }
      for (std::size_t k = 0; k < s.u.size(); ++k)
        s.u[k].index_copy_(0, ok_rows, solution[k]);
      for (std::size_t c = 0; c < plan.chains.size(); ++c)
        s.chained[c].index_copy_(0, ok_rows, slice(solution, plan.chains[c].unknown));
      s.norm.index_copy_(0, ok_rows, solved.norm.index_select(0, ok_index));
      auto p = s.pos.index_select(0, ok_rows) + s.size.index_select(0, ok_rows);
      auto z = s.size.index_select(0, ok_rows);
      auto d = s.depth.index_select(0, ok_rows);
      for (std::int64_t level = 0; level < plan.max_level; ++level) {
        const auto up = (d > 0) & (p.remainder(2 * z) == 0);
        z = at::where(up, 2 * z, z);
        d = at::where(up, d - 1, d);
      }
      s.pos.index_copy_(0, ok_rows, p);
      s.size.index_copy_(0, ok_rows, z);
      s.depth.index_copy_(0, ok_rows, d);
      s.done.index_copy_(0, ok_rows, p == units);
    }
    // Failed spans: bisect, or fail the row at the deepest level.
    if (bad_rows.numel() > 0) {
      s.norm.index_copy_(0, bad_rows, solved.norm.index_select(0, bad_index));
      const auto d = s.depth.index_select(0, bad_rows);
      const auto bottom = d >= plan.max_level;
      s.dead.index_copy_(0, bad_rows, bottom);
      s.size.index_copy_(0, bad_rows,
                         at::where(bottom, s.size.index_select(0, bad_rows),
                                   s.size.index_select(0, bad_rows).div(2, "floor")));
      s.depth.index_copy_(0, bad_rows, at::where(bottom, d, d + 1));
    }
  }

  // Back into the batch; the caller's tensors are never written.
  for (std::size_t k = 0; k < result.u.size(); ++k)
    result.u[k] = result.u[k].index_copy(0, s.rows, s.u[k]);
  result.converged = result.converged.index_copy(0, s.rows, s.done);
  result.norm = result.norm.index_copy(0, s.rows, s.norm);
  result.worst_residual = worst_residual(result.converged, result.norm);
  const auto settled = rows_where(s.done);
  if (settled.numel() > 0) {
    result.substepped = s.rows.index_select(0, settled);
    if (track)
      result.substepped_du_dg = s.du_dg.index_select(0, settled);
  }
  return result;
}

} // namespace neml2::detail
