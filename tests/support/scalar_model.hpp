#pragma once

// Test support: the scalar model (models/scalar_backward_euler.i, x' = a - x^2 by backward
// Euler): its inputs, and its step solved in closed form, one step and bisected as NEML2
// substeps.

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include <neml2/dispatch.hpp>

namespace test {

// The scalar model's inputs: x' = a - x^2 from x~1 = 0.5 over dt = 0.1, one row per `a`.
inline neml2::TensorMap scalar_inputs(const std::vector<double>& a) {
  const auto rows = static_cast<std::int64_t>(a.size());
  const auto filled = [&](double v) { return at::full({rows}, v, at::kDouble); };
  return {{"a", at::tensor(a, at::kDouble)},
          {"x", filled(0.5)},
          {"x~1", filled(0.5)},
          {"t", filled(0.1)},
          {"t~1", filled(0.0)}};
}

// The scalar model's step x + h x^2 = x~1 + h a in closed form: the root Newton reaches
// from x~1, or none when the step has no real root.
inline std::optional<double> scalar_root(double x_old, double h, double a) {
  const double d = 1 + 4 * h * (x_old + h * a);
  if (d < 0)
    return std::nullopt;
  return (std::sqrt(d) - 1) / (2 * h);
}

// NEML2's adaptive bisection of one step in closed form: a span with no root is halved
// (down to 2^-levels of the step), after a span converges the next is the rest of its
// parent span. Counts the spans taken.
inline std::optional<double> scalar_bisected(double x_old, double dt, double a, int levels,
                                             int& spans) {
  const std::int64_t units = std::int64_t{1} << levels;
  std::int64_t pos = 0, size = units;
  int depth = 0;
  spans = 0;
  while (pos < units) {
    const auto x = scalar_root(x_old, dt * static_cast<double>(size) / units, a);
    if (!x) {
      if (depth == levels)
        return std::nullopt;
      size /= 2;
      ++depth;
      continue;
    }
    x_old = *x;
    pos += size;
    ++spans;
    while (depth > 0 && pos % (2 * size) == 0) {
      size *= 2;
      --depth;
    }
  }
  return x_old;
}

} // namespace test
