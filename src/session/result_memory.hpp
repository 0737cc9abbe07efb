#pragma once

// Result tensors from memory the library keeps (see neml2/memory.hpp).

#include <ATen/Tensor.h>

#include "graph/landing.hpp"

namespace neml2::detail {

/// An uninitialized, contiguous CPU tensor whose memory is reused once it is released.
[[nodiscard]] at::Tensor empty_result(c10::IntArrayRef sizes, c10::ScalarType dtype);

} // namespace neml2::detail
