#include "core/finite_values.hpp"

#include <cstdint>

#include <ATen/ATen.h>

namespace neml2::detail {

bool all_finite(const at::Tensor& t) {
  if (!t.is_cpu() || t.scalar_type() != at::kDouble || !t.is_non_overlapping_and_dense())
    return at::isfinite(t).all().item<bool>();
  const auto* bits = static_cast<const std::uint64_t*>(t.data_ptr());
  const auto count = t.numel();
  // The exponent field plus one carries into the sign bit only when it is all ones.
  constexpr std::uint64_t exponent = 0x7ffULL << 52, one = 1ULL << 52;
  std::uint64_t carries = 0;
  for (std::int64_t k = 0; k < count; ++k)
    carries |= (bits[k] & exponent) + one;
  return (carries >> 63) == 0;
}

} // namespace neml2::detail
