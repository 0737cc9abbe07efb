#pragma once

// Shapes in error messages.

#include <string>

#include <c10/util/ArrayRef.h>

namespace neml2::detail {

/// "[2, 6]"
inline std::string shape_text(c10::IntArrayRef shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

} // namespace neml2::detail
