// NEML2's Newton on the row pass (newton_rows.hpp): A at every iterate that steps, each
// row's step from its own LU.

#include <algorithm>
#include <cmath>
#include <optional>

#include <ATen/ATen.h>

#include "implicit/newton_rows.hpp"
#include "implicit/row_system.hpp"

namespace neml2::detail {

// NEML2's Newton: A at every iterate that steps.
std::int64_t RowNewton::newton_iterations() {
  // Which graph checks the rows: A along for small sets (a second call costs more than A),
  // after a step of a line search (it reads A at the trial point), or where the schedule
  // expects most rows to stay; else the residual alone, and A for the rows that stay.
  const auto take_a = [&](std::int64_t check) {
    return size() <= first_from_jacobian || (check > 0 && _search) ||
           (_graphs.schedule ? _graphs.schedule->with_a(check) : check > 0);
  };
  std::int64_t iterations = 0;
  bool has_a = take_a(0);
  auto results = call(has_a ? _graphs.jacobian : _graphs.residual, _u);
  for (std::int64_t it = 0;; ++it) {
    const auto checked = size();
    auto staying = pass(results, has_a, it, true);
    if (_graphs.schedule)
      _graphs.schedule->record(it, checked, staying);
    if (staying == 0)
      break;
    if (!has_a) { // the first residual came without A: A for the rows that stay
      advance(false);
      results = call(_graphs.jacobian, _u);
      has_a = true;
      if (pass(results, true, it, false) == 0)
        break;
    }
    advance(!_search);
    if (_search)
      line_search();
    iterations = it + 1;
    has_a = take_a(it + 1);
    results = call(has_a ? _graphs.jacobian : _graphs.residual, _u);
  }
  return iterations;
}

// One pass over the working set at a graph's results. With `check`: each row's ||r||
// and whether it leaves (converged, failed, or at the iteration cap). With A (`has_a`):
// each staying row's step du = A^{-1} b and <b, du>; a singular A fails the row.
// Returns how many rows stay (`_keep`).
std::int64_t RowNewton::pass(const std::vector<at::Tensor>& results, bool has_a, std::int64_t it,
                             bool check) {
  const auto a_blocks = has_a ? _graphs.a_blocks : 0;
  const Residual b(results, a_blocks);
  const auto residual_groups = results.size() - a_blocks;
  const bool last = it + 1 >= _config.miters;
  const Groups u(_u);
  const auto n = _n;
  _keep.assign(_index.size(), 0);
  if (has_a) {
    _du.resize(static_cast<std::size_t>(size() * n));
    _slope.resize(_index.size());
  }
  // Whether row i leaves at ||r|| = `norm` (finished into the result if so). The residual
  // graph alone leaves a row within a factor 2 of its tolerance undecided: the jacobian
  // graph's residual, which may differ from it in the last bits, decides (so the schedule
  // does not change which iterate a row ends at).
  const auto leaves = [&](std::int64_t i, double norm) {
    const auto row = static_cast<std::size_t>(i);
    _norm[row] = norm;
    if (it == 0)
      _r0[row] = norm;
    const bool converged = converged_at(row, norm, it);
    _undecided[row] = !has_a && converged_at(row, norm / 2, it) != converged_at(row, norm * 2, it);
    if (_undecided[row] != 0)
      return false;
    if (converged || !std::isfinite(norm) || last) {
      finish(u, i, converged);
      return true;
    }
    return false;
  };
  std::optional<Blocks> blocks;
  if (has_a)
    blocks.emplace(results, 0, a_blocks, residual_groups);
  if (n == 1 && b.groups.size() == 1) { // one unknown (radial return): du = b / A
    const auto& r = b.groups.front();
    for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
      for (auto i = begin; i < end; ++i) {
        const double bi = r(i, 0);
        if ((check || _undecided[static_cast<std::size_t>(i)] != 0) &&
            leaves(i, std::sqrt(bi * bi)))
          continue;
        if (has_a) {
          const double a = blocks->blocks.front()(i, 0, 0);
          if (!(std::abs(a) > 0) || !std::isfinite(a)) { // lu_factor's test
            finish_singular(u, i);
            continue;
          }
          _du[static_cast<std::size_t>(i)] = bi / a;
          _slope[static_cast<std::size_t>(i)] = bi * (bi / a);
        }
        _keep[static_cast<std::size_t>(i)] = 1;
      }
    });
    return std::count(_keep.begin(), _keep.end(), 1);
  }
  const auto lanes = lanes_for(size());
  // Row i's step du = A^{-1} b from its solve (and <b, du>), or its failure.
  const auto stepped = [&](std::int64_t i, const double* x, std::int64_t stride, bool solved) {
    if (!solved) {
      finish_singular(u, i);
      return;
    }
    double* du = _du.data() + i * n;
    for (std::int64_t k = 0; k < n; ++k)
      du[k] = x[k * stride];
    if (_search) {
      double dot = 0;
      std::int64_t k = 0;
      for (const auto& g : b.groups)
        for (std::int64_t r = 0; r < g.size1; ++r)
          dot += g(i, r) * du[k++];
      _slope[static_cast<std::size_t>(i)] = dot;
    }
    _keep[static_cast<std::size_t>(i)] = 1;
  };
  for_rows(size(), [&](std::int64_t begin, std::int64_t end) {
    std::optional<LaneBatch> batch;
    if (has_a)
      batch.emplace(n, 1, lanes);
    for (auto i = begin; i < end; ++i) {
      if ((check || _undecided[static_cast<std::size_t>(i)] != 0) && leaves(i, b.norm(i)))
        continue;
      if (!has_a) {
        _keep[static_cast<std::size_t>(i)] = 1;
        continue;
      }
      blocks->fill(i, batch->a(), lanes);
      b.copy(i, batch->x(), lanes);
      batch->add(i, stepped);
    }
    if (batch)
      batch->solve(stepped);
  });
  return std::count(_keep.begin(), _keep.end(), 1);
}

} // namespace neml2::detail
