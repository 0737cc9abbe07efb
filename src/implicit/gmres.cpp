// Restarted, left-preconditioned GMRES per row: Arnoldi cycles in lock-step over the rows,
// in plain loops per row on CPU and in tensor operations elsewhere.

#include "implicit/gmres.hpp"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include "implicit/host_reads.hpp"

namespace neml2::detail {
namespace {

// One restart cycle of GMRES per row: the Arnoldi basis `(k + 1, rows, n)` (vector j of
// every row contiguous, as the operators take it), the Hessenberg matrix `(rows, k + 1, k)`
// kept upper triangular by Givens rotations (cs, sn `(rows, k)`), the rotated residual
// estimates g `(rows, k + 1)`, the rows still extending their basis and how far each got.
// k starts small and grows up to `restart` as steps need it: at restart 40 and many rows,
// zeroing the full matrices costs more than the few steps a small system takes.
struct ArnoldiCycle {
  at::Tensor basis, h, g, cs, sn, open, used, broken;

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
    broken = at::zeros_like(running);
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
// subdiagonal, g rotated with it. A row whose new column breaks down (not finite, or a zero
// pivot: A is singular on the row's Krylov space) stops without the column (`broken`).
void arnoldi_step_tensors(ArnoldiCycle& c, at::Tensor w, std::int64_t j, const at::Tensor& tol) {
  for (std::int64_t i = 0; i <= j; ++i) {
    const auto vi = c.basis.select(0, i);
    const auto hij = (w * vi).sum(1);
    c.h.select(2, j).select(1, i).copy_(hij);
    w = w - hij.unsqueeze(1) * vi;
  }
  const auto next = w.norm(2, 1);
  c.h.select(2, j).select(1, j + 1).copy_(next);
  auto column = c.h.select(2, j);
  for (std::int64_t i = 0; i < j; ++i) {
    const auto top = column.select(1, i).clone(), bottom = column.select(1, i + 1).clone();
    const auto ci = c.cs.select(1, i), si = c.sn.select(1, i);
    column.select(1, i).copy_(ci * top + si * bottom);
    column.select(1, i + 1).copy_(-si * top + ci * bottom);
  }
  const auto diag = column.select(1, j).clone(), below = column.select(1, j + 1).clone();
  const auto radius = at::hypot(diag, below);
  // A column that is not finite or leaves R singular ends the row's cycle without it.
  const auto broke = c.open & (~at::isfinite(column.narrow(1, 0, j + 2)).all(1) | (radius == 0));
  c.broken = c.broken | broke;
  c.open = c.open & ~broke;
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
  // Only rows still extending their basis get the next vector: a zero one for the others
  // keeps what their closed columns hold (NaN of a broken row) out of the update.
  c.basis.select(0, j + 1).copy_(
      at::where(c.open.unsqueeze(1), w / at::where(next > 0, next, 1).unsqueeze(1), 0));
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
  bool* const broken = c.broken.data_ptr<bool>();
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
    hr[(j + 1) * m + j] = next;
    bool finite = std::isfinite(next);
    for (std::int64_t i = 0; i < j; ++i) {
      const T top = hr[i * m + j], bottom = hr[(i + 1) * m + j];
      hr[i * m + j] = cr[i] * top + sr[i] * bottom;
      hr[(i + 1) * m + j] = -sr[i] * top + cr[i] * bottom;
      finite = finite && std::isfinite(hr[i * m + j]);
    }
    const T diag = hr[j * m + j], below = hr[(j + 1) * m + j];
    const T radius = std::hypot(diag, below);
    if (!finite || !std::isfinite(radius) || radius == 0) {
      open[r] = false;
      broken[r] = true;
      continue;
    }
    T* const vj = vector(j + 1);
    for (std::int64_t l = 0; l < n; ++l)
      vj[l] = wr[l] / (next > 0 ? next : 1);
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
    // The cap holds inside a cycle too (NEML2 checks it only between cycles, so that
    // max_its below restart does not bound its steps).
    const auto below_cap = [&] {
      cycle.open = cycle.open & (iterations < config.max_its);
      return to_host<bool>(cycle.open.any());
    };
    for (; steps < m && below_cap(); ++steps) {
      iterations = iterations + cycle.open.to(at::kLong);
      cycle.reserve(steps, m);
      arnoldi_step(cycle, precondition(ops.apply(cycle.basis.select(0, steps))), steps, tol);
    }
    x = x + at::where(running.unsqueeze(1), cycle_step(cycle, steps), 0);
    // A row that broke down would break again from where it stopped: it leaves unconverged.
    running = running & ~cycle.broken & (iterations < config.max_its);
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

} // namespace neml2::detail
