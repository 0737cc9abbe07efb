#pragma once

/// @file tensor_map.hpp
/// @brief The vocabulary of a call: its operations, tensors by name, Jacobian blocks by pair.

#include <map>
#include <string>

namespace at {
class Tensor; // declared only: the maps hold tensors made with ATen's operators
}

namespace neml2 {

/// The operations a compiled model offers.
enum class Operation { forward, jvp, jacobian, param_jacobian, param_vjp };

/// Tensors keyed by variable (or parameter) name.
using TensorMap = std::map<std::string, at::Tensor>;
/// `J[out][in]`: the Jacobian block of output `out` with respect to `in`.
using VariablePairJacobian = std::map<std::string, TensorMap>;

} // namespace neml2
