// The chord on the row pass (newton_rows.hpp): the residual graph at every iterate, a
// step from the row's kept factor; A only for the rows that have none or refactor.

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "implicit/newton_rows.hpp"
#include "implicit/row_system.hpp"

namespace neml2::detail {

// The chord (newton_rows.hpp): the residual graph at every iterate, a step from the row's
// kept factor; A (the jacobian graph) only for the rows that have none or refactor.
std::int64_t RowNewton::chord_iterations() {
  std::int64_t iterations = 0;
  auto results = call(_graphs.residual, _u);
  for (std::int64_t it = 0;; ++it) {
    if (chord_pass(results, it) == 0 || refactor() == 0)
      break;
    advance(true);
    iterations = it + 1;
    results = call(_graphs.residual, _u);
  }
  return iterations;
}

// Row `batch_row`'s slot: whether it holds a factor, its LU (n x n), its pivots; nullptr
// while a solve without a store has not given the row one.
double* RowNewton::slot(std::int64_t batch_row) {
  if (_store.defined())
    return _store.data_ptr<double>() + batch_row * _store.stride(0);
  const auto at = _slot_of[static_cast<std::size_t>(batch_row)];
  return at < 0 ? nullptr : _pool.data() + at * _slot_width;
}

// Whether row i, at ||r|| = `norm` after a step from ||r|| = _step_norm, should take A
// (chord_refactors).
bool RowNewton::too_slow(std::size_t row, double norm, std::int64_t it) const {
  return chord_refactors(norm / _step_norm[row],
                         norm / std::max(_config.atol, _config.rtol * _r0[row]),
                         _config.miters - it - 1, _config.chord_rate);
}

// The chord's check of every row of the working set at the residual graph's `results`:
// leaves (as NEML2's Newton) or stays, stepping from its factor (`_du`) or marked to take
// A (`_need_a`). A step from an older factor that did not lower ||r|| is taken back first.
// Returns how many rows stay.
std::int64_t RowNewton::chord_pass(const std::vector<at::Tensor>& results, std::int64_t it) {
  const Residual b(results, 0);
  const bool last = it + 1 >= _config.miters;
  const Groups u(_u);
  const auto n = _n;
  _keep.assign(_index.size(), 0);
  _need_a.assign(_index.size(), 0);
  _du.resize(static_cast<std::size_t>(size() * n));
  _step_norm.resize(_index.size());
  _chorded.resize(_index.size());
  for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
    std::vector<double> x(static_cast<std::size_t>(n));
    std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
    for (auto i = begin; i < end; ++i) {
      const auto row = static_cast<std::size_t>(i);
      double* du = _du.data() + i * n;
      double norm = b.norm(i);
      if (it > 0 && _chorded[row] != 0 && !(norm < _step_norm[row])) {
        u.read(i, x.data());
        for (std::int64_t k = 0; k < n; ++k)
          x[static_cast<std::size_t>(k)] -= du[k];
        u.write(i, x.data());
        norm = _step_norm[row];
        _chorded[row] = 0;
        slot(_index[row])[0] = 0;
        _norm[row] = norm;
        if (last)
          finish(u, i, false);
        else
          _keep[row] = _need_a[row] = 1;
        continue;
      }
      _norm[row] = norm;
      if (it == 0)
        _r0[row] = norm;
      const bool converged = converged_at(row, norm, it);
      if (converged || !std::isfinite(norm) || last) {
        finish(u, i, converged);
        continue;
      }
      _keep[row] = 1;
      const double* factor = slot(_index[row]);
      if (factor == nullptr || factor[0] != 1 || (it > 0 && too_slow(row, norm, it))) {
        _need_a[row] = 1;
        continue;
      }
      b.copy(i, du);
      for (std::int64_t k = 0; k < n; ++k)
        pivot[static_cast<std::size_t>(k)] = static_cast<std::int64_t>(factor[1 + n * n + k]);
      lu_solve(factor + 1, pivot.data(), n, du, 1);
      _chorded[row] = 1;
      _step_norm[row] = norm;
    }
  });
  return std::count(_keep.begin(), _keep.end(), 1);
}

// A at the rows marked `_need_a` (the jacobian graph on them alone): each row's factor
// into its slot and its Newton step; a singular A fails the row. Returns how many rows
// stay.
std::int64_t RowNewton::refactor() {
  std::vector<std::int64_t> rows;
  for (std::int64_t i = 0; i < size(); ++i)
    if (_need_a[static_cast<std::size_t>(i)] != 0)
      rows.push_back(i);
  if (!rows.empty()) {
    if (!_store.defined()) // slots for rows that have none
      for (auto i : rows)
        if (auto& at = _slot_of[static_cast<std::size_t>(_index[static_cast<std::size_t>(i)])];
            at < 0) {
          at = static_cast<std::int64_t>(_pool.size()) / _slot_width;
          _pool.resize(_pool.size() + static_cast<std::size_t>(_slot_width));
        }
    const auto m = static_cast<std::int64_t>(rows.size());
    std::vector<at::Tensor> results;
    if (m == size())
      results = call(_graphs.jacobian, _u);
    else {
      auto u = empty_like_rows(_u, m), g = empty_like_rows(_g, m);
      const Groups from_u(_u), to_u(u), from_g(_g), to_g(g);
      for (std::int64_t j = 0; j < m; ++j) {
        to_u.copy_row(j, from_u, rows[static_cast<std::size_t>(j)]);
        to_g.copy_row(j, from_g, rows[static_cast<std::size_t>(j)]);
      }
      results = call(_graphs.jacobian, u, g);
    }
    const auto a_blocks = _graphs.a_blocks;
    const Blocks blocks(results, 0, a_blocks, results.size() - a_blocks);
    const Residual b(results, a_blocks);
    const Groups u(_u);
    const auto n = _n;
    for_rows(m, [&](std::int64_t begin, std::int64_t end) {
      std::vector<std::int64_t> pivot(static_cast<std::size_t>(n));
      for (auto j = begin; j < end; ++j) {
        const auto i = rows[static_cast<std::size_t>(j)];
        const auto row = static_cast<std::size_t>(i);
        double* factor = slot(_index[row]);
        blocks.fill(j, factor + 1);
        if (!lu_factor(factor + 1, n, pivot.data())) {
          factor[0] = 0;
          _keep[row] = 0;
          finish_singular(u, i);
          continue;
        }
        for (std::int64_t k = 0; k < n; ++k)
          factor[1 + n * n + k] = static_cast<double>(pivot[static_cast<std::size_t>(k)]);
        factor[0] = 1;
        double* du = _du.data() + i * n;
        b.copy(j, du);
        lu_solve(factor + 1, pivot.data(), n, du, 1);
        _chorded[row] = 0;
        _step_norm[row] = _norm[row];
      }
    });
  }
  return std::count(_keep.begin(), _keep.end(), 1);
}

} // namespace neml2::detail
