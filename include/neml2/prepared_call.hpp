#pragma once

/// @file prepared_call.hpp
/// @brief PreparedCall: a model's call bound once to input names, for hosts that call with
/// the same inputs over and over (AnyDispatchedModel::prepare). at::Tensor is only declared.

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include <neml2/dispatch_fwd.hpp>

namespace neml2 {

namespace detail {
class Dispatcher; // the sessions, the policy and how calls run (<neml2/detail/dispatcher.hpp>)
} // namespace detail

/// @brief A call bound once to input names (see AnyDispatchedModel::prepare).
/// @code
/// const auto step = model.prepare({"strain"});
/// const std::vector<at::Tensor> in{strain}, out{at::empty({batch, 6}, at::kDouble)};
/// for (...) step.forward_into(in, out);   // the same results as forward()
/// @endcode
///
/// Thread safety: as the model it refers to; it must not outlive the model's engine (a
/// model moved elsewhere keeps it valid).
class PreparedCall {
public:
  /// The outputs, in the model's output_names() order.
  [[nodiscard]] std::vector<at::Tensor> forward(std::span<const at::Tensor> inputs) const;
  /// Into the caller's tensors, one per output in output_names() order.
  void forward_into(std::span<const at::Tensor> inputs, std::span<const at::Tensor> outputs) const;
  /// The input names this call takes, in order.
  [[nodiscard]] const std::vector<std::string>& input_names() const noexcept { return _names; }

private:
  friend class AnyDispatchedModel;
  PreparedCall(const detail::Dispatcher& dispatcher, std::vector<std::string> names);

  const detail::Dispatcher* _dispatcher;
  std::vector<std::string> _names;
  std::vector<std::size_t> _positions; // the k-th tensor given is input _positions[k]
  bool _in_order = true;               // _positions is 0, 1, 2, ...
  std::vector<std::string> _output_labels;
};

} // namespace neml2
