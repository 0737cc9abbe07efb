#pragma once

// Why the rows of a Newton solve that did not converge failed (RowFailure), decided from
// what the solve ended with; asked only when some row failed. Private to src/implicit/.

#include <vector>

#include <ATen/Tensor.h>

namespace neml2::detail {

/// `(B,)` int8 RowFailure per row of a solve: none where `converged`; else, first that
/// applies: non_finite where the row's inputs (`u0`, `givens`) are not all finite;
/// singular where `singular` (a zero or non-finite LU pivot: the row pass's) or where its
/// last iterate `u` is not finite (a step that was not: the solve graph's or LAPACK's
/// answer to a singular A, from a finite iterate and residual); non_finite where its last
/// residual norm `norm` is not; else not_converged (the iteration cap). Tensors `(B, ...)`;
/// `singular` `(B,)` bool or undefined.
[[nodiscard]] at::Tensor row_failures(const at::Tensor& converged, const at::Tensor& norm,
                                      const std::vector<at::Tensor>& u,
                                      const std::vector<at::Tensor>& u0,
                                      const std::vector<at::Tensor>& givens,
                                      const at::Tensor& singular = {});

} // namespace neml2::detail
