#pragma once

/// @file session.hpp
/// @brief One device's compiled graphs of one artifact: the thin layer that calls them.
/// No AOTI header is visible here, and at::Tensor is only declared (include ATen to make
/// and read tensors); the implementation lives in src/session/.

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <neml2/artifact.hpp>
#include <neml2/tensor_map.hpp>

namespace neml2 {
namespace detail {
struct CallProtocol;
class CallNames;
} // namespace detail

/// @brief The compiled graphs of one artifact on one device, called by name.
///
/// Inputs are `(B, *base)` (one leading batch axis) or `(*base)` (broadcast to the
/// batch), on the session's device, in the artifact's dtype; everything is checked before
/// a graph runs. Promoted parameters live in named_parameters().
/// @code
/// neml2::Session s(std::make_shared<neml2::Artifact>(neml2::read_artifact("aoti/model")),
///                  "cpu");
/// auto out = s.forward({{"strain", at::zeros({8, 6}, at::kDouble)}});
/// @endcode
///
/// Thread safety: const use from several threads runs the graphs concurrently up to the
/// session's `concurrency` (on the CPU, at least the hardware threads), blocking beyond;
/// `set_parameter`, writes through `named_parameters()` and `set_solver_config` must not overlap a
/// call. Each thread that has run a CPU graph call keeps the small blocks (at most 1 MiB
/// each) it frees, up to 8 MiB, for its next calls; they are freed when it ends.
/// @see DispatchedModel, which chunks a batch over sessions.
class Session {
public:
  /// `concurrency`: how many calls may run the graphs at once (AOTI runners; on an
  /// accelerator, the chunks a dispatcher keeps in flight). On the CPU there are at least as
  /// many as hardware threads, so that calls from several threads run side by side.
  Session(std::shared_ptr<const Artifact> artifact, const Device& device,
          c10::ScalarType dtype = c10::kDouble, std::size_t concurrency = 1);
  ~Session();
  /// Moves the loaded graphs; the moved-from session may only be destroyed or assigned.
  Session(Session&&) noexcept;
  /// Moves the loaded graphs (see the move constructor).
  Session& operator=(Session&&) noexcept;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  /// @name Evaluation, by name (validated, on this session's device).
  ///@{
  [[nodiscard]] TensorMap forward(const TensorMap& inputs) const;
  /// {outputs, d(outputs)}: the directional derivative along `tangents` (missing = 0).
  [[nodiscard]] std::pair<TensorMap, TensorMap> jvp(const TensorMap& inputs,
                                                    const TensorMap& tangents) const;
  /// {outputs, J}: blocks `(B, *out_base, *in_base)`; batch-independent ones unbatched.
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs) const;
  /// {outputs, P}: blocks `(B, *out_base, *param_base)` keyed [output][parameter].
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  param_jacobian(const TensorMap& inputs) const;
  /// dL/d(parameter) for L = sum over outputs of <cotangent, output> (missing = 0):
  /// summed over the batch, or per row for a batched parameter.
  [[nodiscard]] TensorMap param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const;
  ///@}

  /// @name Promoted parameters (`neml2-compile -p NAME`), keyed by public name.
  /// A value is `(*param_base)` or batched `(B, *param_base)`; in-place changes are seen
  /// by the next call.
  ///@{
  /// The parameters by public name, for reading or changing in place.
  [[nodiscard]] TensorMap& named_parameters() noexcept;
  /// The parameters by public name.
  [[nodiscard]] const TensorMap& named_parameters() const noexcept;
  /// Replaces parameter `name`, checked against its base shape, dtype and device.
  void set_parameter(const std::string& name, const at::Tensor& value);
  ///@}

  /// @name The Newton settings of an implicit model (metadata.json `solver_config`).
  /// A FatalError for a model without an implicit segment. Not while calls are running.
  ///@{
  /// The settings in force.
  [[nodiscard]] const SolverConfig& solver_config() const;
  /// Replaces them, checked first (a FatalError names a bad field).
  void set_solver_config(const SolverConfig& config);
  ///@}

  /// @name What the artifact declares (public names, master order).
  ///@{
  /// The artifact this session loaded.
  [[nodiscard]] const Artifact& artifact() const noexcept;
  /// The inputs' public names, in master order.
  [[nodiscard]] const std::vector<std::string>& input_names() const noexcept;
  /// The outputs' public names, in master order.
  [[nodiscard]] const std::vector<std::string>& output_names() const noexcept;
  /// Each input's base shape (without the batch axis), as input_names().
  [[nodiscard]] const std::vector<Shape>& input_base_shapes() const noexcept;
  /// Each output's base shape, as output_names().
  [[nodiscard]] const std::vector<Shape>& output_base_shapes() const noexcept;
  /// Each output's shape per row, `(*sub_batch, *base)`, as output_names(): metadata.json
  /// gives only the base; the sub-batch axes are the inputs', an unknown's, or what the
  /// forward graph that makes the output returns (it may keep, add or average them away).
  [[nodiscard]] const std::vector<Shape>& output_shapes() const noexcept;
  /// Each promoted parameter's base shape, by public name.
  [[nodiscard]] const std::map<std::string, Shape>& parameter_base_shapes() const noexcept;
  /// The blocks jacobian() returns, as (output, input) public names in the graphs' order;
  /// none without Jacobian graphs.
  [[nodiscard]] std::vector<std::pair<std::string, std::string>> jacobian_pairs() const;
  /// The device the graphs run on, resolved (a bare `cuda` pinned to an index).
  [[nodiscard]] const Device& device() const noexcept;
  /// The dtype the graphs compute in.
  [[nodiscard]] c10::ScalarType dtype() const noexcept;
  ///@}

private:
  friend struct detail::CallProtocol; // the engine's surface: src/session/call_protocol.hpp
  friend class detail::CallNames;     // a call's tensors by name: <neml2/detail/call_names.hpp>

  [[nodiscard]] std::vector<at::Tensor> run_whole(Operation op, const TensorMap& inputs,
                                                  const TensorMap& extras) const;

  struct Impl;
  std::unique_ptr<Impl> _impl;
};

} // namespace neml2
