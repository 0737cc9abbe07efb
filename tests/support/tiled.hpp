#pragma once

// Test support: a batch made from a few reference rows, each row repeated and every copy
// perturbed by a few percent (so that the rows of an implicit model converge in different
// numbers of iterations).

#include <cstdint>
#include <vector>

#include <neml2/dispatch.hpp>

namespace test {

/// Every row of `value` `times` times, each copy scaled by 1 + 0.03 cos(its row).
inline at::Tensor tiled_times(const at::Tensor& value, std::int64_t times) {
  auto sizes = std::vector<std::int64_t>(static_cast<std::size_t>(value.dim()), 1);
  sizes[0] = times;
  const auto copies = value.repeat(sizes);
  const auto scale =
      1 + 0.03 * at::cos(at::arange(copies.size(0), value.options())).reshape({-1, 1});
  return (copies.reshape({copies.size(0), -1}) * scale).reshape(copies.sizes());
}

/// Every row of each of `inputs` `times` times, each copy perturbed (tiled_times()).
inline neml2::TensorMap tiled_times(const neml2::TensorMap& inputs, std::int64_t times) {
  neml2::TensorMap out;
  for (const auto& [name, value] : inputs)
    out.emplace(name, tiled_times(value, times));
  return out;
}

/// Every row of each of `inputs` repeated until there are at least `rows`, each copy
/// perturbed (tiled_times()).
inline neml2::TensorMap tiled_to_rows(const neml2::TensorMap& inputs, std::int64_t rows) {
  neml2::TensorMap out;
  for (const auto& [name, value] : inputs)
    out.emplace(name, tiled_times(value, (rows + value.size(0) - 1) / value.size(0)));
  return out;
}

} // namespace test
