#pragma once

// The shape of a batched value: its rows, then its parts' shapes.

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace neml2::detail {

/// (rows, *parts[0], *parts[1], ...).
inline std::vector<std::int64_t>
with_rows(std::int64_t rows, std::initializer_list<const std::vector<std::int64_t>*> parts) {
  std::vector<std::int64_t> s{rows};
  for (const auto* p : parts)
    s.insert(s.end(), p->begin(), p->end());
  return s;
}

} // namespace neml2::detail
