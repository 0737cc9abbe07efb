// NEML2's line search on the row pass (newton_rows.hpp): every row of the working set
// searches along its Newton step.

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "implicit/newton_rows.hpp"
#include "implicit/row_system.hpp"

namespace neml2::detail {

// The line search of NEML2's Newton (newton.cpp's line_search, per row): every row of
// the working set searches along its du, then takes u += alpha du.
void RowNewton::line_search() {
  const auto m = size();
  const auto n = _n;
  const bool strong_wolfe = _config.ls_type == "STRONG_WOLFE";
  std::vector<double> alpha(_index.size(), 1);
  std::vector<std::uint8_t> settled(_index.size(), 0);
  const Groups u(_u);
  for (std::int64_t trial = 1; trial < _config.ls_max_iters; ++trial) {
    auto moved = empty_like_rows(_u, m);
    const Groups to(moved);
    for_rows(m, [&](std::int64_t begin, std::int64_t end) {
      std::vector<double> x(static_cast<std::size_t>(n));
      for (auto j = begin; j < end; ++j) {
        u.read(j, x.data());
        for (std::int64_t k = 0; k < n; ++k)
          x[static_cast<std::size_t>(k)] += alpha[static_cast<std::size_t>(j)] * _du[j * n + k];
        to.write(j, x.data());
      }
    });
    const Residual b(call(_graphs.residual, moved), 0);
    for_rows(m, [&](std::int64_t begin, std::int64_t end) {
      for (auto j = begin; j < end; ++j) {
        const auto row = static_cast<std::size_t>(j);
        const double nb = std::pow(b.norm(j), 2), nb0 = _norm[row] * _norm[row];
        const double crit = strong_wolfe ? (1 - _config.ls_c * alpha[row]) * nb0
                                         : nb0 - 2 * _config.ls_c * alpha[row] * _slope[row];
        settled[row] = settled[row] != 0 || nb <= crit || nb <= _config.atol * _config.atol ? 1 : 0;
      }
    });
    if (trial + 1 == _config.ls_max_iters ||
        std::all_of(settled.begin(), settled.end(), [](auto s) { return s != 0; }))
      break;
    for (std::size_t j = 0; j < settled.size(); ++j)
      if (settled[j] == 0)
        alpha[j] /= _config.ls_cutback;
  }
  for_rows(m, [&](std::int64_t begin, std::int64_t end) {
    std::vector<double> x(static_cast<std::size_t>(n)), step(static_cast<std::size_t>(n));
    for (auto j = begin; j < end; ++j) {
      const auto row = static_cast<std::size_t>(j);
      u.read(j, x.data());
      for (std::int64_t k = 0; k < n; ++k) {
        step[static_cast<std::size_t>(k)] = alpha[row] * _du[j * n + k];
        x[static_cast<std::size_t>(k)] += step[static_cast<std::size_t>(k)];
      }
      u.write(j, x.data());
      _gate_ok[row] = gate(step.data(), x.data());
    }
  });
}

} // namespace neml2::detail
