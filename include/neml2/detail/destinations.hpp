#pragma once

/// @file detail/destinations.hpp
/// @brief The caller's tensors for a call's results (`_into` calls).

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace neml2::detail {

/// The caller's tensors for an operation's results, in slot order, each with what it is
/// ("output 'stress'", "J['stress']['strain']") for errors.
struct Destinations {
  std::vector<at::Tensor> tensors;
  std::vector<std::string> labels;
};

} // namespace neml2::detail
