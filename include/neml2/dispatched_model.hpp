#pragma once

/// @file dispatched_model.hpp
/// @brief DispatchedModel<Policy>: a compiled model whose batched calls are cut into
/// chunks and run where the policy says, with results gathered on the input device.
/// Declarations only (the engine is compiled once, in src/dispatched_model.cpp), and
/// at::Tensor is only declared: include ATen to make and read tensors.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <neml2/artifact.hpp>
#include <neml2/errors.hpp>
#include <neml2/observer.hpp>
#include <neml2/policies/sync_chunking.hpp>
#include <neml2/policy.hpp>
#include <neml2/session.hpp>

namespace neml2 {

class AnyDispatchedModel;
class PreparedCall;
template <class Policy>
class DispatchedModel;

namespace detail {
/// What the engine asks of a dispatch policy: DispatchedModel<Policy> wraps its copy of
/// the policy, and the policy's state, in one (PolicyCallsOf).
class PolicyCalls {
public:
  virtual ~PolicyCalls() = default;
  [[nodiscard]] virtual bool asynchronous() const noexcept = 0;
  [[nodiscard]] virtual std::vector<Device> devices() const = 0;
  /// The policy's chunks_in_flight(device), or 1 when it has none.
  [[nodiscard]] virtual std::int64_t chunks_in_flight(std::size_t device) const = 0;
  /// Synchronous policies: where and in what chunks a call runs.
  [[nodiscard]] virtual Device compute_device() const = 0;
  [[nodiscard]] virtual std::int64_t chunk_rows(std::int64_t batch) const = 0;
  /// Asynchronous policies, under the model's lock, with the policy's state.
  [[nodiscard]] virtual std::optional<ChunkChoice>
  next_chunk(std::span<const std::int64_t> rows_in_flight, std::int64_t remaining) = 0;
  virtual void on_dispatched(std::size_t device, std::int64_t rows) = 0;
  virtual void on_completed(std::size_t device, std::int64_t rows, double seconds) = 0;
};

template <class Policy>
class PolicyCallsOf final : public PolicyCalls {
public:
  explicit PolicyCallsOf(Policy p)
      : policy(std::move(p)) {}
  [[nodiscard]] bool asynchronous() const noexcept override { return is_asynchronous<Policy>; }
  [[nodiscard]] std::vector<Device> devices() const override { return listed_devices(policy); }
  [[nodiscard]] std::int64_t chunks_in_flight(std::size_t device) const override {
    if constexpr (requires { policy.chunks_in_flight(device); })
      return static_cast<std::int64_t>(policy.chunks_in_flight(device));
    else
      return 1;
  }
  [[nodiscard]] Device compute_device() const override {
    if constexpr (is_synchronous<Policy>)
      return policy.compute_device();
    else
      return devices().front();
  }
  [[nodiscard]] std::int64_t chunk_rows(std::int64_t batch) const override {
    if constexpr (is_synchronous<Policy>)
      return static_cast<std::int64_t>(policy.chunk_rows(batch));
    else
      return batch;
  }
  [[nodiscard]] std::optional<ChunkChoice> next_chunk(std::span<const std::int64_t> rows_in_flight,
                                                      std::int64_t remaining) override {
    if constexpr (is_asynchronous<Policy>)
      return policy.next_chunk(rows_in_flight, remaining, state);
    else
      return std::nullopt;
  }
  void on_dispatched(std::size_t device, std::int64_t rows) override {
    if constexpr (is_asynchronous<Policy>)
      policy.on_dispatched(device, rows, state);
  }
  void on_completed(std::size_t device, std::int64_t rows, double seconds) override {
    if constexpr (is_asynchronous<Policy>)
      policy.on_completed(device, rows, seconds, state);
  }

  Policy policy;
  policy_state_t<Policy> state;
};

/// For tests: run `hook` as each chunk starts (it may throw to fail that chunk).
struct ModelAccess {
  static void before_chunk(AnyDispatchedModel& model, std::function<void(const ChunkEvent&)> hook);
};
} // namespace detail

/// @brief A DispatchedModel of any policy: every call, with the policy's type erased.
///
/// DispatchedModel<Policy> is one (it adds only policy()); a host that takes models of
/// several policies holds a reference to this, or moves a DispatchedModel into one.
///
/// One session per device the policy lists, loaded at construction. Inputs may live on
/// any one device; each chunk is moved to its compute device, run, and written into
/// outputs preallocated on the input device. When one chunk covers the batch on the
/// input device, the session is called directly: no slicing, no copy, no thread.
///
/// A synchronous policy runs on the calling thread and costs no thread, queue or lock.
/// An asynchronous one runs chunks on a worker per accelerator, and its CPU chunks on the
/// calling thread while it waits (its own OpenMP team); several host threads may call
/// one model at once: each call gets its own results, and the devices' loads and the
/// policy's state are shared by all calls (one model-wide lock).
///
/// Thread safety: any number of threads may call the evaluation functions (and their
/// `*_into` forms) on one model at once; each call gets its own results. Configuration
/// (`set_parameter`, writes through `named_parameters()`, `set_solver_config`,
/// `set_observer`) must not overlap a call or another configuration. See
/// docs/thread-safety.md. A moved-from model may only be destroyed or assigned.
/// @see DispatchedModel, SyncChunking, GreedyPriorityCapacity, load_model
class AnyDispatchedModel {
public:
  ~AnyDispatchedModel();
  /// Moves the sessions and the engine; prepared calls stay valid.
  AnyDispatchedModel(AnyDispatchedModel&&) noexcept;
  /// Moves the sessions and the engine (see the move constructor).
  AnyDispatchedModel& operator=(AnyDispatchedModel&&) noexcept;
  AnyDispatchedModel(const AnyDispatchedModel&) = delete;
  AnyDispatchedModel& operator=(const AnyDispatchedModel&) = delete;

  /// @name Evaluation (see Session for the shapes).
  ///@{
  /// The outputs by name.
  [[nodiscard]] TensorMap forward(const TensorMap& inputs) const;
  /// {outputs, d(outputs)} along `tangents` (missing = 0).
  [[nodiscard]] std::pair<TensorMap, TensorMap> jvp(const TensorMap& inputs,
                                                    const TensorMap& tangents) const;
  /// {outputs, J}, `J[out][in]` of shape `(B, *out_base, *in_base)`.
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs) const;
  /// {outputs, P}, `P[out][parameter]` of shape `(B, *out_base, *param_base)`.
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian>
  param_jacobian(const TensorMap& inputs) const;
  /// dL/d(parameter) for L = sum of <cotangent, output>, summed over the batch (per row
  /// for a batched parameter).
  [[nodiscard]] TensorMap param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const;
  ///@}

  /// @name Evaluation into the caller's tensors: one per result, keyed as the results
  /// above are, of the result's shape, in the model's dtype, on any device, with any
  /// strides whose elements are distinct (a slice, a transposed view). Chunks write
  /// straight into the caller's rows; nothing of the outputs' size is allocated. Checked
  /// before anything runs: a wrong tensor is a FatalError and the caller's data is left
  /// as it was.
  /// @code
  /// auto stress = at::empty({batch, 6}, at::kDouble);   // allocated once, reused
  /// model.forward_into({{"strain", strain}}, {{"stress", stress}});
  /// @endcode
  ///@{
  /// forward(), into `outputs`.
  void forward_into(const TensorMap& inputs, const TensorMap& outputs) const;
  /// jvp(), into `outputs` and `output_tangents`.
  void jvp_into(const TensorMap& inputs, const TensorMap& tangents, const TensorMap& outputs,
                const TensorMap& output_tangents) const;
  /// jacobian(), into `outputs` and the blocks `J`.
  void jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                     const VariablePairJacobian& J) const;
  /// param_jacobian(), into `outputs` and the blocks `P`.
  void param_jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                           const VariablePairJacobian& P) const;
  /// param_vjp(), into `gradients`.
  void param_vjp_into(const TensorMap& inputs, const TensorMap& cotangents,
                      const TensorMap& gradients) const;
  ///@}

  /// A call bound once to `names` (default: input_names()), for hosts that call with the
  /// same inputs over and over: then tensors in that order, results in output_names()
  /// order, no name lookups and no maps. The model must outlive it.
  [[nodiscard]] PreparedCall prepare(std::vector<std::string> names = {}) const;

  /// Calls `observer` once per chunk (see ChunkEvent); an empty one turns it off. Set it
  /// while no call is running.
  void set_observer(ChunkObserver observer);

  /// @name Promoted parameters: one master map, used by every device's chunks.
  ///@{
  /// The master parameters by public name; an in-place change is seen by the next call.
  [[nodiscard]] TensorMap& named_parameters() noexcept;
  /// The master parameters by public name.
  [[nodiscard]] const TensorMap& named_parameters() const noexcept;
  /// Replaces parameter `name` (its base shape, or batched); a FatalError names a wrong one.
  void set_parameter(const std::string& name, const at::Tensor& value);
  ///@}

  /// @name Metadata (the first session's: every device's are the same).
  ///@{
  /// The inputs' public names, in master order.
  [[nodiscard]] const std::vector<std::string>& input_names() const noexcept;
  /// The outputs' public names, in master order.
  [[nodiscard]] const std::vector<std::string>& output_names() const noexcept;
  /// Each input's base shape, as input_names().
  [[nodiscard]] const std::vector<Shape>& input_base_shapes() const noexcept;
  /// Each output's base shape, as output_names().
  [[nodiscard]] const std::vector<Shape>& output_base_shapes() const noexcept;
  /// Each promoted parameter's base shape, by public name.
  [[nodiscard]] const std::map<std::string, Shape>& parameter_base_shapes() const noexcept;
  /// The first listed device, resolved (a bare `cuda` becomes the current CUDA device).
  [[nodiscard]] const Device& device() const noexcept;
  /// Every listed device's session, in the policy's order.
  [[nodiscard]] const std::vector<Session>& sessions() const noexcept;
  /// The dtype the graphs compute in.
  [[nodiscard]] c10::ScalarType dtype() const noexcept;
  /// The artifact the sessions loaded.
  [[nodiscard]] const Artifact& artifact() const noexcept;
  ///@}

  /// @name Newton settings of an implicit model (see Session::solver_config); a change
  /// reaches every device's session. Not while calls are running.
  ///@{
  /// The Newton settings in force.
  [[nodiscard]] const SolverConfig& solver_config() const;
  /// Replaces them on every device's session (checked first).
  void set_solver_config(const SolverConfig& config);
  ///@}

private:
  template <class Policy>
  friend class DispatchedModel;
  friend struct detail::ModelAccess;
  friend class PreparedCall;

  // One session per device `policy` lists; the policy validated already.
  AnyDispatchedModel(std::shared_ptr<const Artifact> artifact,
                     std::unique_ptr<detail::PolicyCalls> policy, c10::ScalarType dtype);
  [[nodiscard]] const detail::PolicyCalls& policy_calls() const noexcept;

  struct Impl;
  std::unique_ptr<Impl> _impl;
};

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
  PreparedCall(const AnyDispatchedModel::Impl& model, std::vector<std::string> names);

  const AnyDispatchedModel::Impl* _model;
  std::vector<std::string> _names;
  std::vector<std::size_t> _positions; // the k-th tensor given is input _positions[k]
  bool _in_order = true;               // _positions is 0, 1, 2, ...
  std::vector<std::string> _output_labels;
};

/// @brief A compiled model dispatched by `Policy`: AnyDispatchedModel's calls, with the
/// policy's type known.
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

public:
  /// Loads one session of `artifact` per device `policy` lists, in `dtype`; the policy is
  /// validated first (its `validate()`, when it has one). Throws FatalError.
  DispatchedModel(std::shared_ptr<const Artifact> artifact, Policy policy,
                  c10::ScalarType dtype = c10::kDouble)
      : AnyDispatchedModel(std::move(artifact),
                           std::make_unique<detail::PolicyCallsOf<Policy>>(validated(std::move(policy))),
                           dtype) {}

  /// The model's copy of the policy.
  [[nodiscard]] const Policy& policy() const noexcept {
    return static_cast<const detail::PolicyCallsOf<Policy>&>(policy_calls()).policy;
  }

private:
  static Policy validated(Policy policy) {
    if constexpr (requires { policy.validate(); })
      policy.validate();
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
