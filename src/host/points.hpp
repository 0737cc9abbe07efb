#pragma once

// A variable's shape over a state's points. Private to src/host/.

#include <cstdint>

#include <neml2/artifact.hpp>

namespace neml2::detail {

/// (points, *shape).
inline Shape with_points(std::int64_t points, const Shape& shape) {
  Shape s{points};
  s.insert(s.end(), shape.begin(), shape.end());
  return s;
}

} // namespace neml2::detail
