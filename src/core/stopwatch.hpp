#pragma once

// Seconds on the steady clock, as the policy hooks, the observer and the tuner take them.

#include <chrono>

namespace neml2::detail {

using steady_clock = std::chrono::steady_clock;

/// Seconds from `start` to now.
inline double seconds_since(steady_clock::time_point start) {
  return std::chrono::duration<double>(steady_clock::now() - start).count();
}

} // namespace neml2::detail
