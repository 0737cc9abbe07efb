#pragma once

// Whether a tensor's values are all finite, read in place where it can be.

#include <ATen/core/Tensor.h>

namespace neml2::detail {

/// Whether every value of `t` is finite (no NaN, no infinity). A dense CPU double tensor
/// (in any order of its axes) is read in place, the exponent bits of each value
/// (vectorized); any other through torch.
[[nodiscard]] bool all_finite(const at::Tensor& t);

} // namespace neml2::detail
