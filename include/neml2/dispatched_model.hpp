#pragma once

/// @file dispatched_model.hpp
/// @brief DispatchedModel<Policy>: a compiled model whose batched calls are cut into
/// chunks and run where the policy says, with results gathered on the input device.

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include <neml2/artifact.hpp>
#include <neml2/detail/chunking.hpp>
#include <neml2/errors.hpp>
#include <neml2/policies/sync_chunking.hpp>
#include <neml2/policy.hpp>
#include <neml2/session.hpp>

namespace neml2 {

/// @brief A compiled model dispatched by `Policy`: the Session surface, chunked.
///
/// Inputs may live on any one device; each chunk is moved to the compute device, run,
/// and written into outputs preallocated on the input device. When one chunk covers the
/// batch on the input device, the session is called directly: no slicing, no copy.
/// @code
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///                                neml2::SyncChunking{.device = "cpu", .batch_size = 16384});
/// auto out = model.forward({{"strain", strain}});
/// @endcode
/// @see SyncChunking, load_model
template <class Policy>
class DispatchedModel {
  static_assert(detail::check_policy<Policy>());

public:
  DispatchedModel(std::shared_ptr<const Artifact> artifact, Policy policy,
                  c10::ScalarType dtype = c10::kDouble)
      : _policy(validated(std::move(policy)))
      , _session(std::move(artifact), _policy.compute_device(), dtype)
      , _compute_device(_session.device().torch()) {}

  /// @name Evaluation (see Session for the shapes).
  ///@{
  [[nodiscard]] TensorMap forward(const TensorMap& inputs) const {
    return _session.forward_result(dispatch(Operation::forward, inputs, {}));
  }
  [[nodiscard]] std::pair<TensorMap, TensorMap> jvp(const TensorMap& inputs,
                                                    const TensorMap& tangents) const {
    return _session.jvp_result(dispatch(Operation::jvp, inputs, tangents));
  }
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs) const {
    return _session.jacobian_result(dispatch(Operation::jacobian, inputs, {}));
  }
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  param_jacobian(const TensorMap& inputs) const {
    return _session.param_jacobian_result(dispatch(Operation::param_jacobian, inputs, {}));
  }
  [[nodiscard]] TensorMap param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const {
    return _session.param_vjp_result(dispatch(Operation::param_vjp, inputs, cotangents));
  }
  ///@}

  /// @name Promoted parameters and metadata.
  ///@{
  [[nodiscard]] TensorMap& named_parameters() noexcept { return _session.named_parameters(); }
  [[nodiscard]] const TensorMap& named_parameters() const noexcept {
    return _session.named_parameters();
  }
  void set_parameter(const std::string& name, const at::Tensor& value) {
    _session.set_parameter(name, value);
  }
  [[nodiscard]] const std::vector<std::string>& input_names() const noexcept {
    return _session.input_names();
  }
  [[nodiscard]] const std::vector<std::string>& output_names() const noexcept {
    return _session.output_names();
  }
  [[nodiscard]] const std::vector<Shape>& input_base_shapes() const noexcept {
    return _session.input_base_shapes();
  }
  [[nodiscard]] const std::vector<Shape>& output_base_shapes() const noexcept {
    return _session.output_base_shapes();
  }
  [[nodiscard]] const std::map<std::string, Shape>& parameter_base_shapes() const noexcept {
    return _session.parameter_base_shapes();
  }
  [[nodiscard]] const Device& device() const noexcept { return _session.device(); }
  [[nodiscard]] c10::ScalarType dtype() const noexcept { return _session.dtype(); }
  [[nodiscard]] const Artifact& artifact() const noexcept { return _session.artifact(); }
  [[nodiscard]] const Policy& policy() const noexcept { return _policy; }
  ///@}

private:
  static Policy validated(Policy policy) {
    if constexpr (requires { policy.validate(); })
      policy.validate();
    return policy;
  }

  std::vector<at::Tensor> dispatch(Operation op, const TensorMap& inputs,
                                   const TensorMap& extras) const {
    return detail::translate_foreign_errors("neml2::DispatchedModel", [&] {
      auto call =
          _session.bind(op, inputs, extras, _session.named_parameters(), /*required_device=*/{});
      const auto batch = call.batch;
      auto rows = static_cast<std::int64_t>(_policy.chunk_rows(batch));
      if (rows < 0)
        throw FatalError("the dispatch policy's chunk_rows(" + std::to_string(batch) +
                         ") returned " + std::to_string(rows) +
                         "; chunk_rows() must return >= 0 (rows per chunk; 0 = the whole batch)");
      rows = rows == 0 ? batch : std::min(rows, batch);

      detail::ChunkArgs chunk;
      if (batch > 0 && rows == batch && call.device == _compute_device) {
        detail::take_all(call, _compute_device, chunk);
        return detail::finish_whole(call, _session.run(op, chunk));
      }
      detail::Gatherer results(call, _session.dtype());
      for (std::int64_t first = 0; first < batch; first += rows) {
        const auto n = std::min(rows, batch - first);
        detail::take_rows(call, first, n, _compute_device, chunk);
        results.add(first, n, _session.run(op, chunk));
      }
      return std::move(results).finish();
    });
  }

  Policy _policy;
  Session _session;
  c10::Device _compute_device; // _session.device(), converted once rather than per call

public:
  /// @name Newton settings of an implicit model (see Session::solver_config).
  ///@{
  [[nodiscard]] const SolverConfig& solver_config() const { return _session.solver_config(); }
  void set_solver_config(const SolverConfig& config) { _session.set_solver_config(config); }
  ///@}
};

/// Loads `name` from a stub (or an artifact root) and runs whole batches on the CPU.
inline DispatchedModel<SyncChunking> load_model(const std::filesystem::path& path,
                                                const std::string& name,
                                                c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path, name))),
          SyncChunking{}, dtype};
}

/// Loads `name` from a stub (or an artifact root), dispatched by `policy`.
template <class Policy>
DispatchedModel<Policy> load_model(const std::filesystem::path& path, const std::string& name,
                                   Policy policy, c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path, name))),
          std::move(policy), dtype};
}

} // namespace neml2
