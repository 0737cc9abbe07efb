#pragma once

// Test support: Newton over graphs written in a test, planned from the unknowns it starts
// from (detail::plan_newton on their device, dtype and count), as a session plans a
// segment at load.

#include <utility>
#include <vector>

#include "internals.hpp"

namespace test {

inline neml2::detail::NewtonResult
newton_solve(const neml2::detail::NewtonGraphs& graphs, std::vector<at::Tensor> u0,
             const std::vector<at::Tensor>& givens, const std::vector<at::Tensor>& params,
             const neml2::SolverConfig& config, bool gate_relative = false,
             const at::Tensor& factors = {}) {
  const auto plan = neml2::detail::plan_newton(graphs, u0, config);
  return neml2::detail::newton_solve(graphs, plan, std::move(u0), givens, params, config,
                                     gate_relative, factors);
}

} // namespace test
