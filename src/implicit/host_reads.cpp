// The counted reads back to the host of the implicit solvers.

#include "implicit/host_reads.hpp"

#include <limits>

#include <ATen/ATen.h>

namespace neml2::detail {

thread_local std::uint64_t host_reads = 0;

at::Tensor rows_where(const at::Tensor& mask) {
  ++host_reads;
  return mask.nonzero().squeeze(1);
}

FailedRows failed_rows(const at::Tensor& converged, const at::Tensor& norm) {
  constexpr auto none = -std::numeric_limits<double>::infinity();
  if (norm.numel() == 0)
    return {};
  const auto failed = ~converged;
  const auto not_finite = (failed & ~at::isfinite(norm)).any();
  const auto worst = to_host<double>(at::where(not_finite, std::numeric_limits<double>::quiet_NaN(),
                                               at::where(failed, norm, none).max()));
  // -inf only when no row failed: a failed row's norm is >= 0, or NaN.
  return worst == none ? FailedRows{} : FailedRows{true, worst};
}

} // namespace neml2::detail
