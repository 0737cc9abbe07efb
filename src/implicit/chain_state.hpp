#pragma once

// What the files of SegmentChain share (private to src/implicit/): the state of named
// tensors a chunk runs over, and the row helpers both the run and the derivatives use.

#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include <ATen/Tensor.h>
#include <fmt/format.h>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>

#include "core/row_shape.hpp"
#include "implicit/segment_chain.hpp"
#include "implicit/substepping.hpp"

namespace neml2::detail {

// Where each variable sits in its packed group.
[[nodiscard]] std::map<std::string, GroupSlice>
slices(const std::vector<VariableGroup>& groups, const std::vector<ImplicitVariable>& variables);

// addend + a . b per row, `a` `(rows or 1, n, k)`, `b` `(rows or 1, k, m)`, `addend`
// undefined or `(rows, n, m)`.
[[nodiscard]] at::Tensor rows_matmul(const at::Tensor& a, const at::Tensor& b,
                                     const at::Tensor& addend = {});

// d(target)/d(inputs) += block . d(source)/d(inputs); `block` is `(rows or 1, n_t, n_s)`.
void accumulate(std::vector<at::Tensor>& target, const at::Tensor& block,
                const std::vector<at::Tensor>& source);

// What a solve_ift graph returns from the dense du/dg = -A^{-1} B `(rows, n_u, n_g)`: its
// blocks at each pair's offsets.
[[nodiscard]] std::vector<at::Tensor> ift_pairs(const ImplicitSegment& seg,
                                                const at::Tensor& du_dg);

struct SegmentChain::State {
  std::int64_t rows = 0;
  bool track = false;  // chain the derivatives with respect to the model's inputs
  bool params = false; // ... and its parameters (columns after the inputs')
  std::size_t columns = 0;
  std::map<std::string, at::Tensor> values;
  std::map<std::string, std::vector<at::Tensor>> derivatives; // (rows, n_var, n_input)
  at::Tensor converged;                                       // (rows,) once a solve ran
  double worst_residual = 0;
  // Once a solve ran: each row's RowFailure (int8, undefined while none failed) and ||r||,
  // a failed row's from the solve it first failed in, another's from the last solve.
  at::Tensor reasons, norms;
  // The chord's slots of these rows (SegmentChain::run's), or undefined.
  at::Tensor newton_factors;

  const at::Tensor& value(const std::string& name, const std::string& needed_by) const {
    const auto it = values.find(name);
    if (it == values.end())
      throw FatalError(fmt::format("{} needs '{}', which no model input or earlier segment "
                                   "provides; the artifact is inconsistent: recompile it with "
                                   "neml2-compile",
                                   needed_by, name));
    return it->second;
  }

  // (rows, n) view of a variable, for packing and contracting.
  at::Tensor flat(const std::string& name, const std::string& needed_by) const {
    return value(name, needed_by).reshape({rows, -1});
  }

  std::vector<at::Tensor>& derivative(const std::string& name, std::size_t n_inputs) {
    auto& d = derivatives[name];
    d.resize(n_inputs);
    return d;
  }
};

} // namespace neml2::detail
