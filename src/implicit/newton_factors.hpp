#pragma once

// Where the chord's slots (newton_rows.hpp) are in a NewtonFactors row, and the engine's
// access to them. Private to the library.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include <neml2/artifact.hpp>
#include <neml2/newton_factors.hpp>

namespace neml2::detail {

/// Per implicit segment (in order), the first value of its slot in a row, or -1 where it
/// has none (has_factor_slot, newton_plan.hpp); the row's width (0: no segment has a slot).
struct FactorColumns {
  std::vector<std::int64_t> first;
  std::int64_t width = 0;
};
[[nodiscard]] FactorColumns factor_columns(const Artifact& artifact);

struct NewtonFactorsAccess {
  /// The slots of `points` points of `artifact`'s model, `(points, width)`: those held when
  /// they have that shape, else new ones holding no factor; undefined when no segment has
  /// a slot.
  [[nodiscard]] static at::Tensor slots(NewtonFactors& factors, const Artifact& artifact,
                                        std::int64_t points);
  /// The slots held (undefined before the first call), to be read or replaced.
  [[nodiscard]] static at::Tensor& held(NewtonFactors& factors);
};

} // namespace neml2::detail
