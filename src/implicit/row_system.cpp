// A row's linear system (row_system.hpp): the helpers' bodies and the IFT's -A^{-1} C.

#include "implicit/row_system.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

namespace neml2::detail {

at::Tensor typed(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? t : t.to(at::kDouble);
}

double norm(const double* x, std::int64_t n) {
  double squares = 0;
  for (std::int64_t k = 0; k < n; ++k)
    squares += x[k] * x[k];
  return std::sqrt(squares);
}

std::vector<at::Tensor> empty_like_rows(const std::vector<at::Tensor>& like, std::int64_t rows) {
  std::vector<at::Tensor> out;
  for (const auto& t : like)
    out.push_back(at::empty({rows, t.size(1)}, t.options()));
  return out;
}

std::int64_t lanes_for(std::int64_t rows) {
  return rows == 1 ? 1 : static_cast<std::int64_t>(lu_lanes());
}

std::vector<at::Tensor> call_for_rows(const GraphFn& graph, const std::vector<at::Tensor>& args) {
  const c10::InferenceMode inference;
  return graph(args);
}

at::Tensor minus_solve_rows(const std::vector<at::Tensor>& a_blocks,
                            const std::vector<at::Tensor>& c_blocks, std::size_t residual_groups) {
  const BlockSystems systems(a_blocks, c_blocks, residual_groups);
  const auto &a = systems.a, &c = systems.c;
  const auto rows = systems.rows, n = a.height, m = c.width;
  auto out = at::empty({rows, n, m}, a.blocks.front().tensor.options());
  double* x = out.data_ptr<double>();
  const auto lanes = lanes_for(rows);
  const auto solved_row = [&](std::int64_t i, const double* solution, std::int64_t stride,
                              bool solved) {
    double* row = x + i * n * m;
    for (std::int64_t k = 0; k < n * m; ++k)
      row[k] = solved ? -solution[k * stride] : std::numeric_limits<double>::quiet_NaN();
  };
  for_rows(rows, [&](std::int64_t begin, std::int64_t end) {
    LaneBatch batch(n, m, lanes);
    for (auto i = begin; i < end; ++i) {
      a.fill(i, batch.a(), lanes);
      c.fill(i, batch.x(), lanes);
      batch.add(i, solved_row);
    }
    batch.solve(solved_row);
  });
  return out;
}

} // namespace neml2::detail
