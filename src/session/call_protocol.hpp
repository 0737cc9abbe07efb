#pragma once

// The call protocol between a Session and the engine: a call bound once, then run chunk
// by chunk. Its names (inputs in position, results as the public maps) are
// <neml2/detail/call_names.hpp>'s.

#include <optional>
#include <span>
#include <utility>
#include <vector>

#include <neml2/session.hpp>

#include "graph/call.hpp"
#include "implicit/newton_plan.hpp"
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
  /// Whether a call runs a segment chain (a solve, or several segments: its rows cost
  /// far more than one graph call's) rather than one forward segment's graphs.
  [[nodiscard]] static bool runs_chain(const Session& s) noexcept;
  /// Each implicit segment's Newton plan, in order (none for a model without a solve).
  [[nodiscard]] static std::vector<NewtonPlan> newton_plans(const Session& s);
  /// How many calls may run the session's graphs at once (its AOTI runners per graph).
  [[nodiscard]] static std::size_t runners(const Session& s) noexcept;
  /// Runs `op` on one chunk (see ChunkArgs); results in slot order. `places`: where each
  /// result will be written (slot order; undefined: not by rows), which a result of an
  /// explicit model on the CPU may be computed in directly (see Landing). `newton_factors`:
  /// the chord's slots of the chunk's rows (NewtonFactors', `(rows, width)` on the CPU), or
  /// undefined.
  [[nodiscard]] static std::vector<at::Tensor> run(const Session& s, Operation op, ChunkArgs& chunk,
                                                   std::span<const Place> places = {},
                                                   const at::Tensor& newton_factors = {});
};

} // namespace neml2::detail
