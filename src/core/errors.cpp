#include <limits>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <neml2/errors.hpp>

namespace neml2 {

struct ConvergenceError::Rows {
  at::Tensor converged;
  double worst_residual = std::numeric_limits<double>::quiet_NaN();
  std::vector<at::Tensor> results;
  std::map<std::string, at::Tensor> outputs;
  at::Tensor reasons, residual_norms;
};

namespace {
// `given` as `(B,)` of `dtype` on the mask's device; when not given, what a per-row error
// that was not told why says of each row: `failed` where it failed (not_converged, a NaN
// norm), `converged` where it converged (none, 0).
at::Tensor per_row_or(const at::Tensor& given, const at::Tensor& mask, at::ScalarType dtype,
                      const at::Scalar& failed, const at::Scalar& converged) {
  if (!mask.defined())
    return {};
  if (given.defined())
    return given.to(mask.device(), dtype);
  return at::full(mask.sizes(), failed, mask.options().dtype(dtype)).masked_fill_(mask, converged);
}
} // namespace

const ConvergenceError::Rows& ConvergenceError::rows() const noexcept {
  static const Rows none;
  return _rows ? *_rows : none;
}

ConvergenceError::ConvergenceError(const std::string& message)
    : Exception(message, true) {}

ConvergenceError::ConvergenceError(const std::string& message, at::Tensor converged,
                                   double worst_residual, std::vector<at::Tensor> results)
    : ConvergenceError(message, std::move(converged), worst_residual, std::move(results), {}) {}

ConvergenceError::ConvergenceError(const std::string& message, at::Tensor converged,
                                   double worst_residual, std::vector<at::Tensor> results,
                                   std::map<std::string, at::Tensor> outputs)
    : ConvergenceError(message, std::move(converged), worst_residual, std::move(results),
                       std::move(outputs), {}, {}) {}

ConvergenceError::ConvergenceError(const std::string& message, at::Tensor converged,
                                   double worst_residual, std::vector<at::Tensor> results,
                                   std::map<std::string, at::Tensor> outputs, at::Tensor reasons,
                                   at::Tensor residual_norms)
    : Exception(message, true) {
  auto rows_reasons =
      per_row_or(reasons, converged, at::kChar, static_cast<std::int8_t>(RowFailure::not_converged),
                 static_cast<std::int8_t>(RowFailure::none));
  auto rows_norms = per_row_or(residual_norms, converged, at::kDouble,
                               std::numeric_limits<double>::quiet_NaN(), 0.0);
  _rows = std::make_shared<const Rows>(Rows{std::move(converged), worst_residual,
                                            std::move(results), std::move(outputs),
                                            std::move(rows_reasons), std::move(rows_norms)});
}

bool ConvergenceError::per_row() const noexcept {
  return rows().converged.defined();
}

const at::Tensor& ConvergenceError::converged_mask() const noexcept {
  return rows().converged;
}

std::int64_t ConvergenceError::failed_rows() const {
  const auto& converged = rows().converged;
  return converged.defined() ? converged.numel() - converged.sum().item<std::int64_t>() : 0;
}

double ConvergenceError::worst_residual() const noexcept {
  return rows().worst_residual;
}

const at::Tensor& ConvergenceError::reasons() const noexcept {
  return rows().reasons;
}

RowFailure ConvergenceError::reason(std::int64_t row) const {
  const auto& reasons = rows().reasons;
  if (!reasons.defined())
    return RowFailure::none;
  if (row < 0 || row >= reasons.numel())
    throw FatalError(
        fmt::format("ConvergenceError::reason({}): the error has {} rows; ask for a row in [0, {})",
                    row, reasons.numel(), reasons.numel()));
  return static_cast<RowFailure>(reasons[row].item<std::int8_t>());
}

const at::Tensor& ConvergenceError::residual_norms() const noexcept {
  return rows().residual_norms;
}

const std::map<std::string, at::Tensor>& ConvergenceError::outputs() const noexcept {
  return rows().outputs;
}

const std::vector<at::Tensor>& ConvergenceError::results() const noexcept {
  return rows().results;
}

} // namespace neml2
