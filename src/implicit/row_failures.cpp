// Why the rows of a Newton solve failed (row_failures.hpp).

#include "implicit/row_failures.hpp"

#include <cstdint>

#include <ATen/ATen.h>

#include <neml2/errors.hpp>

namespace neml2::detail {
namespace {

// `(B,)` bool: whether every value of row r of each tensor is finite.
at::Tensor finite_rows(const std::vector<at::Tensor>& tensors, const at::Tensor& like) {
  auto finite = at::ones_like(like, like.options().dtype(at::kBool));
  for (const auto& t : tensors)
    if (t.defined() && t.dim() > 0)
      finite &= at::isfinite(t.reshape({like.size(0), -1})).all(1).to(like.device());
  return finite;
}

constexpr std::int8_t code(RowFailure reason) {
  return static_cast<std::int8_t>(reason);
}

} // namespace

at::Tensor row_failures(const at::Tensor& converged, const at::Tensor& norm,
                        const std::vector<at::Tensor>& u, const std::vector<at::Tensor>& u0,
                        const std::vector<at::Tensor>& givens, const at::Tensor& singular) {
  // Filled from the least to the most telling: each later fill wins.
  auto reasons = at::full(converged.sizes(), code(RowFailure::not_converged),
                          converged.options().dtype(at::kChar));
  reasons.masked_fill_(~at::isfinite(norm), code(RowFailure::non_finite));
  auto no_step = ~finite_rows(u, converged);
  if (singular.defined())
    no_step |= singular.to(converged.device());
  reasons.masked_fill_(no_step, code(RowFailure::singular));
  reasons.masked_fill_(~(finite_rows(u0, converged) & finite_rows(givens, converged)),
                       code(RowFailure::non_finite));
  return reasons.masked_fill_(converged, code(RowFailure::none));
}

} // namespace neml2::detail
