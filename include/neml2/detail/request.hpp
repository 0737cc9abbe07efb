#pragma once

/// @file detail/request.hpp
/// @brief One call on its way into the engine: what the synchronous call, the asynchronous
/// engine and every dispatcher's run() take.

#include <vector>

#include <ATen/core/Tensor.h>

#include <neml2/detail/destinations.hpp>
#include <neml2/newton_factors.hpp>
#include <neml2/tensor_map.hpp>

namespace neml2::detail {

/// One call on its way into the engine.
struct Request {
  Operation op = Operation::forward;
  std::vector<at::Tensor> inputs;     ///< in input_names() order
  const TensorMap* extras = nullptr;  ///< the tangents (jvp) or cotangents (param_vjp)
  const Destinations* into = nullptr; ///< the caller's tensors for the results (`_into`)
  NewtonFactors* factors = nullptr;   ///< the chord's, kept from call to call
};

} // namespace neml2::detail
