#pragma once

// Adaptive substepping of one implicit segment: the rows newton_solve fails on retry their
// step in bisected spans. Private to the library (src/).

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/artifact.hpp>

#include "implicit/newton.hpp"

namespace neml2::detail {

/// d(u)/d(givens) at a solution of one step, `(B, n_u, n_g + extra)` over the flattened
/// unknown and given groups (the implicit function theorem, from the compiled graphs), then
/// any `extra` columns of quantities every span sees unchanged (the parameters).
using DerivativeFn = std::function<at::Tensor(const std::vector<at::Tensor>& u,
                                              const std::vector<at::Tensor>& givens)>;

/// A slice of a packed group: `size` values from column `offset` of group `group`.
struct GroupSlice {
  std::size_t group = 0;
  std::int64_t offset = 0, size = 0;
};

/// How the givens of a segment move when its step is cut into substeps (NEML2's roles):
/// a current force and its old force are interpolated linearly over the step, an old
/// state takes the previous substep's solution of its unknown, the rest stay.
struct SubstepPlan {
  std::int64_t max_level = 0; ///< up to 2^max_level substeps per row; 0 = off
  struct Ramp {
    GroupSlice current, old; ///< `f` and `f~1` among the givens
  };
  struct Chain {
    GroupSlice old_state, unknown; ///< `u~1` among the givens, `u` among the unknowns
  };
  std::vector<Ramp> ramps;
  std::vector<Chain> chains;
};

/// @brief newton_solve, then adaptive substepping of the rows that failed (when
/// `plan.max_level > 0`), as NEML2's runtime does it: a failed span of the step is
/// bisected, recursively, down to spans of 2^-max_level of the step; after a span
/// converges, the next one is the rest of its parent span (recursive bisection, so
/// [1/2, 1/4, 1/4] and not a restart in quarters). Each row's sequence of spans depends on
/// that row alone. Rows that converge in one step run exactly as without substepping
/// (apart from NEML2's gate on the relative criterion); rows still failing at the deepest
/// level fail. With `du_dg`, the derivatives of substepped rows are chained through their
/// substeps (interpolation weights, old states) into NewtonResult::substepped_du_dg.
/// `newton`: the segment's plan; `factors`: the chord's (newton_solve), for the whole step only.
[[nodiscard]] NewtonResult
solve_with_substeps(const NewtonGraphs& graphs, const NewtonPlan& newton,
                    std::vector<at::Tensor> u0, const std::vector<at::Tensor>& givens,
                    const std::vector<at::Tensor>& params, const SolverConfig& config,
                    const SubstepPlan& plan, const DerivativeFn& du_dg = {},
                    std::int64_t extra_columns = 0, const at::Tensor& factors = {});

} // namespace neml2::detail
