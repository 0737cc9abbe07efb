#pragma once

// Test support: Newton's graphs for u^3 = a per row, written in the test (r = u^3 - a,
// b = -r, A = 3 u^2, the step b / A), for detail::newton_solve.

#include <vector>

#include <ATen/ATen.h>

#include "internals.hpp"

namespace test {

inline neml2::detail::NewtonGraphs cube_root() {
  neml2::detail::NewtonGraphs graphs;
  const auto b = [](const std::vector<at::Tensor>& args) { return args[1] - args[0].pow(3); };
  graphs.residual = [b](const std::vector<at::Tensor>& args) {
    return std::vector<at::Tensor>{b(args)};
  };
  graphs.jacobian = [b](const std::vector<at::Tensor>& args) {
    return std::vector<at::Tensor>{(3 * args[0].square()).reshape({-1, 1, 1}), b(args)};
  };
  graphs.solve = [](const std::vector<at::Tensor>& ops) {
    return std::vector<at::Tensor>{ops[1] / ops[0].reshape({-1, 1})};
  };
  graphs.a_blocks = 1;
  return graphs;
}

} // namespace test
