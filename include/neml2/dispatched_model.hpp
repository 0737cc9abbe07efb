#pragma once

/// @file dispatched_model.hpp
/// @brief DispatchedModel<Policy>: a compiled model whose batched calls are cut into
/// chunks and run where the policy says, with results gathered on the input device. The
/// policy is held by value and its calls are inlined (detail/dispatcher.hpp); the tensor
/// work is compiled once (src/engine/). A file that only holds or passes models needs no
/// more than <neml2/dispatch_fwd.hpp>, one that calls them through AnyDispatchedModel no
/// more than <neml2/any_dispatched_model.hpp>.

#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/detail/dispatcher.hpp>
#include <neml2/policies/sync_chunking.hpp>
#include <neml2/policy.hpp>

namespace neml2 {

/// @brief A compiled model dispatched by `Policy`: AnyDispatchedModel's calls, with the
/// policy's type known, so a call runs the policy's chunk loop inline (no virtual call).
/// @code
/// auto model = neml2::load_model("aoti/model_aoti.i", "model",
///                                neml2::SyncChunking{.device = "cpu", .batch_size = 16384});
/// auto out = model.forward({{"strain", strain}});
/// @endcode
/// Thread safety: see AnyDispatchedModel.
/// @see SyncChunking, GreedyPriorityCapacity, load_model
template <class Policy>
class DispatchedModel : public AnyDispatchedModel {
  static_assert(detail::check_policy<Policy>());
  using Dispatcher = detail::DispatcherOf<Policy>;
  using Calls = detail::EvaluationCalls<Dispatcher>;

public:
  /// Loads one session of `artifact` per device `policy` lists, in `dtype`; the policy is
  /// validated first (its `validate()`, when it has one). Throws FatalError.
  DispatchedModel(std::shared_ptr<const Artifact> artifact, Policy policy,
                  c10::ScalarType dtype = c10::kDouble)
      : AnyDispatchedModel(std::make_unique<Dispatcher>(std::move(artifact),
                                                        validated(std::move(policy)), dtype)) {}

  /// The model's copy of the policy.
  [[nodiscard]] const Policy& policy() const noexcept { return dispatch().policy; }

  /// @name Evaluation: AnyDispatchedModel's, with the policy inlined.
  ///@{
  /// @copydoc AnyDispatchedModel::forward
  [[nodiscard]] TensorMap forward(const TensorMap& inputs) const {
    return Calls::forward(dispatch(), inputs);
  }
  /// @copydoc AnyDispatchedModel::jvp
  [[nodiscard]] std::pair<TensorMap, TensorMap> jvp(const TensorMap& inputs,
                                                    const TensorMap& tangents) const {
    return Calls::jvp(dispatch(), inputs, tangents);
  }
  /// @copydoc AnyDispatchedModel::jacobian
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs) const {
    return Calls::jacobian(dispatch(), inputs);
  }
  /// @copydoc AnyDispatchedModel::param_jacobian
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  param_jacobian(const TensorMap& inputs) const {
    return Calls::param_jacobian(dispatch(), inputs);
  }
  /// @copydoc AnyDispatchedModel::param_vjp
  [[nodiscard]] TensorMap param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const {
    return Calls::param_vjp(dispatch(), inputs, cotangents);
  }
  /// @copydoc AnyDispatchedModel::forward(const TensorMap&, NewtonFactors&) const
  [[nodiscard]] TensorMap forward(const TensorMap& inputs, NewtonFactors& factors) const {
    return Calls::forward(dispatch(), inputs, &factors);
  }
  /// @copydoc AnyDispatchedModel::jacobian(const TensorMap&, NewtonFactors&) const
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs,
                                                                    NewtonFactors& factors) const {
    return Calls::jacobian(dispatch(), inputs, &factors);
  }
  /// @copydoc AnyDispatchedModel::forward_into
  void forward_into(const TensorMap& inputs, const TensorMap& outputs) const {
    Calls::into(dispatch(), Operation::forward, inputs, nullptr, outputs, {}, {});
  }
  /// forward_into() with the chord's `factors` (NewtonFactors).
  void forward_into(const TensorMap& inputs, const TensorMap& outputs,
                    NewtonFactors& factors) const {
    Calls::into(dispatch(), Operation::forward, inputs, nullptr, outputs, {}, {}, &factors);
  }
  /// @copydoc AnyDispatchedModel::jvp_into
  void jvp_into(const TensorMap& inputs, const TensorMap& tangents, const TensorMap& outputs,
                const TensorMap& output_tangents) const {
    Calls::into(dispatch(), Operation::jvp, inputs, &tangents, outputs, output_tangents, {});
  }
  /// @copydoc AnyDispatchedModel::jacobian_into
  void jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                     const VariablePairJacobian& J) const {
    Calls::into(dispatch(), Operation::jacobian, inputs, nullptr, outputs, {}, J);
  }
  /// jacobian_into() with the chord's `factors` (NewtonFactors).
  void jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                     const VariablePairJacobian& J, NewtonFactors& factors) const {
    Calls::into(dispatch(), Operation::jacobian, inputs, nullptr, outputs, {}, J, &factors);
  }
  /// @copydoc AnyDispatchedModel::param_jacobian_into
  void param_jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                           const VariablePairJacobian& P) const {
    Calls::into(dispatch(), Operation::param_jacobian, inputs, nullptr, outputs, {}, P);
  }
  /// @copydoc AnyDispatchedModel::param_vjp_into
  void param_vjp_into(const TensorMap& inputs, const TensorMap& cotangents,
                      const TensorMap& gradients) const {
    Calls::into(dispatch(), Operation::param_vjp, inputs, &cotangents, gradients, {}, {});
  }
  ///@}

private:
  [[nodiscard]] const Dispatcher& dispatch() const noexcept {
    return static_cast<const Dispatcher&>(dispatcher());
  }

  static Policy validated(Policy policy) {
    detail::validate_policy(policy);
    return policy;
  }
};

/// @name Loading a model
/// A stub (`<name>_aoti.i`) or an artifact root folder -> a DispatchedModel. The model name
/// may be left out when the stub holds one model (a FatalError lists the names when it
/// holds several); a folder is the root itself and needs none.
/// @code
/// auto model = neml2::load_model("aoti/elasticity_aoti.i");            // CPU, whole batches
/// auto chunked = neml2::load_model("aoti/elasticity_aoti.i", neml2::SyncChunking{.batch_size =
/// 4096});
/// @endcode
/// @{

/// @brief Loads `name` from a stub (or an artifact root) and runs whole batches on the CPU.
inline DispatchedModel<SyncChunking> load_model(const std::filesystem::path& path,
                                                const std::string& name,
                                                c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path, name))),
          SyncChunking{}, dtype};
}

/// @brief Loads `name` from a stub (or an artifact root), dispatched by `policy`.
template <class Policy>
DispatchedModel<Policy> load_model(const std::filesystem::path& path, const std::string& name,
                                   Policy policy, c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path, name))),
          std::move(policy), dtype};
}

/// @brief Loads the one model of a stub (or an artifact root) and runs whole batches on
/// the CPU.
inline DispatchedModel<SyncChunking> load_model(const std::filesystem::path& path,
                                                c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path))),
          SyncChunking{}, dtype};
}

/// @brief Loads the one model of a stub (or an artifact root), dispatched by `policy`.
/// (A name in the second place is the overload above that takes one.)
template <class Policy>
requires(!std::convertible_to<Policy, std::string>) DispatchedModel<Policy> load_model(
    const std::filesystem::path& path, Policy policy, c10::ScalarType dtype = c10::kDouble) {
  return {std::make_shared<const Artifact>(read_artifact(resolve_artifact_root(path))),
          std::move(policy), dtype};
}

/// @}

} // namespace neml2
