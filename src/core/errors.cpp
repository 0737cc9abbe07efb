#include <limits>

#include <ATen/ATen.h>

#include <neml2/errors.hpp>

namespace neml2 {

struct ConvergenceError::Rows {
  at::Tensor converged;
  double worst_residual = std::numeric_limits<double>::quiet_NaN();
  std::vector<at::Tensor> results;
  std::map<std::string, at::Tensor> outputs;
};

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
    : Exception(message, true)
    , _rows(std::make_shared<const Rows>(
          Rows{std::move(converged), worst_residual, std::move(results), std::move(outputs)})) {}

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

const std::map<std::string, at::Tensor>& ConvergenceError::outputs() const noexcept {
  return rows().outputs;
}

const std::vector<at::Tensor>& ConvergenceError::results() const noexcept {
  return rows().results;
}

} // namespace neml2
