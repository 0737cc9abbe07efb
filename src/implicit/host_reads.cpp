// The counted reads back to the host of the implicit solvers.

#include "implicit/host_reads.hpp"

#include <algorithm>
#include <cmath>
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
  if (norm.is_cpu() && norm.scalar_type() == at::kDouble && converged.is_cpu() &&
      converged.scalar_type() == at::kBool) { // the same, as a loop: a tenth of the ATen calls
    ++host_reads;
    const auto n = norm.contiguous(), c = converged.contiguous();
    const double* r = n.const_data_ptr<double>();
    const bool* ok = c.const_data_ptr<bool>();
    double worst = none;
    for (std::int64_t k = 0; k < n.numel(); ++k)
      if (!ok[k])
        worst = std::isfinite(r[k]) && !std::isnan(worst) ? std::max(worst, r[k])
                                                          : std::numeric_limits<double>::quiet_NaN();
    return worst == none ? FailedRows{} : FailedRows{true, worst};
  }
  const auto failed = ~converged;
  const auto not_finite = (failed & ~at::isfinite(norm)).any();
  const auto worst = to_host<double>(at::where(not_finite, std::numeric_limits<double>::quiet_NaN(),
                                               at::where(failed, norm, none).max()));
  // -inf only when no row failed: a failed row's norm is >= 0, or NaN.
  return worst == none ? FailedRows{} : FailedRows{true, worst};
}

} // namespace neml2::detail
