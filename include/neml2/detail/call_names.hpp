#pragma once

/// @file detail/call_names.hpp
/// @brief What a session's calls are by name: the inputs put in position, the results in
/// slot order as the public maps, and the caller's tensors for them (`_into`), compiled in
/// src/session/. The one place that maps a call's names, for the session's own named calls,
/// the engine's (detail/dispatcher.hpp) and the host's.

#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include <neml2/detail/destinations.hpp>
#include <neml2/errors.hpp>
#include <neml2/session.hpp>

namespace neml2::detail {

/// @brief A session's names for its calls' tensors. A view: the session must outlive it
/// (a model's first session names every device's calls: they are the same).
class CallNames {
public:
  explicit CallNames(const Session& session) noexcept
      : _session(&session) {}

  /// The inputs by name in input_names() order; a FatalError for a missing or unknown name.
  [[nodiscard]] std::vector<at::Tensor> positional(const TensorMap& inputs) const;
  /// The caller's tensors for `op`'s results in slot order. `values` are the outputs (the
  /// gradients for param_vjp), `tangents` the output tangents (jvp), `blocks` the Jacobian
  /// (jacobian) or parameter Jacobian (param_jacobian) blocks. Every result must be given,
  /// and nothing else: a FatalError names what is missing or unknown.
  [[nodiscard]] Destinations destinations(Operation op, const TensorMap& values,
                                          const TensorMap& tangents,
                                          const VariablePairJacobian& blocks) const;

  /// @name A call's results in slot order as the public maps.
  ///@{
  [[nodiscard]] TensorMap forward(std::vector<at::Tensor>&& results) const;
  [[nodiscard]] std::pair<TensorMap, TensorMap> jvp(std::vector<at::Tensor>&& results) const;
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  jacobian(std::vector<at::Tensor>&& results) const;
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  param_jacobian(std::vector<at::Tensor>&& results) const;
  [[nodiscard]] TensorMap param_vjp(std::vector<at::Tensor>&& results) const;
  ///@}

  /// Throws `error` (a per-row failure) again with `results`, its outputs by name among them.
  [[noreturn]] void rethrow_with_outputs(const ConvergenceError& error,
                                         std::vector<at::Tensor> results) const;

private:
  const Session* _session;
};

} // namespace neml2::detail
