#pragma once

// The call protocol between a Session and the engine: a call bound once,
// then run chunk by chunk, and its positional results turned into the public maps.

#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <neml2/session.hpp>

#include "graph/call.hpp"
#include "session/result_memory.hpp"

namespace neml2::detail {

struct CallProtocol {
  /// Checks names, shapes, dtype and batch sizes, and puts the tensors in positional
  /// order without copying. `extras` are the tangents (jvp) or cotangents (param_vjp).
  /// `params` are the parameters to use (named_parameters() or a dispatcher's master
  /// copy). With `required_device`, every tensor must live there.
  [[nodiscard]] static BoundCall bind(const Session& s, Operation op, const TensorMap& inputs,
                                      const TensorMap& extras, const TensorMap& params,
                                      std::optional<c10::Device> required_device);
  /// The same with the inputs already in input_names() order (no name lookups).
  [[nodiscard]] static BoundCall bind(const Session& s, Operation op,
                                      std::vector<at::Tensor> inputs, const TensorMap& extras,
                                      const TensorMap& params,
                                      std::optional<c10::Device> required_device);
  /// The inputs of a call by name, in input_names() order; a FatalError for a missing or
  /// unknown name.
  [[nodiscard]] static std::vector<at::Tensor> positional(const Session& s,
                                                          const TensorMap& inputs);
  /// The batch of a forward() call the value graph may take as it is (see
  /// forward_as_given), or 0 for any other call: a model with a solve or parameters, off the
  /// CPU, an input that is not dense `(B, *base)` in the model's dtype on the CPU, batches
  /// that differ or are empty. Checks what bind() would, without building a BoundCall.
  [[nodiscard]] static std::int64_t batch_as_given(const Session& s,
                                                   const std::vector<at::Tensor>& inputs);
  /// forward() of a call batch_as_given() accepted: the value graph on the inputs as given,
  /// results in output_names() order.
  [[nodiscard]] static std::vector<at::Tensor>
  forward_as_given(const Session& s, const std::vector<at::Tensor>& inputs);
  /// Runs `op` on one chunk (see ChunkArgs); results in slot order. `places`: where each
  /// result will be written (slot order; undefined: not by rows), which a result of an
  /// explicit model on the CPU may be computed in directly (see Landing).
  [[nodiscard]] static std::vector<at::Tensor> run(const Session& s, Operation op, ChunkArgs& chunk,
                                                   std::span<const Place> places = {});
  /// The positional results of each operation as the public maps.
  [[nodiscard]] static TensorMap forward_result(const Session& s,
                                                std::vector<at::Tensor>&& results);
  /// Throws `error` (a per-row failure) again with `results`, its outputs by name among them.
  [[noreturn]] static void rethrow_with_outputs(const Session& s, const ConvergenceError& error,
                                                std::vector<at::Tensor> results);
  [[nodiscard]] static std::pair<TensorMap, TensorMap>
  jvp_result(const Session& s, std::vector<at::Tensor>&& results);
  [[nodiscard]] static std::pair<TensorMap, VariablePairJacobian>
  jacobian_result(const Session& s, std::vector<at::Tensor>&& results);
  [[nodiscard]] static std::pair<TensorMap, VariablePairJacobian>
  param_jacobian_result(const Session& s, std::vector<at::Tensor>&& results);
  [[nodiscard]] static TensorMap param_vjp_result(const Session& s,
                                                  std::vector<at::Tensor>&& results);
  /// The inverse: the caller's tensors for `op`'s results in slot order. `values` are the
  /// outputs (the gradients for param_vjp), `tangents` the output tangents (jvp), `blocks`
  /// the Jacobian (jacobian) or parameter Jacobian (param_jacobian) blocks. Every result
  /// must be given, and nothing else: a FatalError names what is missing or unknown.
  [[nodiscard]] static Destinations destinations(const Session& s, Operation op,
                                                 const TensorMap& values, const TensorMap& tangents,
                                                 const VariablePairJacobian& blocks);
};

} // namespace neml2::detail
