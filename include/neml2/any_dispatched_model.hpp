#pragma once

/// @file any_dispatched_model.hpp
/// @brief AnyDispatchedModel: a DispatchedModel of any policy, its calls compiled once
/// (src/engine/any_dispatched_model.cpp). at::Tensor is only declared: a file that calls a
/// model through it needs no ATen.
/// @code
/// #include <neml2/any_dispatched_model.hpp>
/// void step(const neml2::AnyDispatchedModel& model, const neml2::TensorMap& in,
///           const neml2::TensorMap& out) { model.forward_into(in, out); }
/// @endcode

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <neml2/artifact.hpp>
#include <neml2/dispatch_fwd.hpp>
#include <neml2/errors.hpp>
#include <neml2/newton_factors.hpp>
#include <neml2/observer.hpp>
#include <neml2/prepared_call.hpp>
#include <neml2/session.hpp>

namespace neml2 {

namespace detail {
class Dispatcher;   // the sessions, the policy and how calls run (<neml2/detail/dispatcher.hpp>)
struct ModelAccess; // the tests' hooks (<neml2/detail/testing.hpp>)
} // namespace detail

/// @brief A DispatchedModel of any policy: every call, with the policy's type erased.
///
/// DispatchedModel<Policy> is one: through it, a call runs the policy inline; through this
/// type, a call reaches the same code by one virtual call. A host that takes models of
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
  /// forward() with each point's Newton factors kept in `factors` from call to call: the
  /// chord (NewtonFactors).
  [[nodiscard]] TensorMap forward(const TensorMap& inputs, NewtonFactors& factors) const;
  /// jacobian() with the chord's `factors` (NewtonFactors).
  [[nodiscard]] std::pair<TensorMap, VariablePairJacobian> jacobian(const TensorMap& inputs,
                                                                    NewtonFactors& factors) const;
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
  /// forward_into() with the chord's `factors` (NewtonFactors).
  void forward_into(const TensorMap& inputs, const TensorMap& outputs,
                    NewtonFactors& factors) const;
  /// jacobian_into() with the chord's `factors` (NewtonFactors).
  void jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                     const VariablePairJacobian& J, NewtonFactors& factors) const;
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

  /// Asks `check` between chunks whether a call goes on (see InterruptCheck); an empty one
  /// turns it off. A check that throws stops the call: no chunk starts after it, the
  /// chunks already running finish, and the call throws what the check threw (anything
  /// outside the library's family as a FatalError). The rows of an `_into` call's
  /// destinations that no chunk reached keep what they held. Set it while no call is
  /// running.
  void set_interrupt_check(InterruptCheck check);

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
  /// Each output's shape per row, sub-batch axes included (Session::output_shapes()).
  [[nodiscard]] const std::vector<Shape>& output_shapes() const noexcept;
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

protected:
  /// Takes a DispatchedModel's dispatcher (its sessions and policy).
  explicit AnyDispatchedModel(std::unique_ptr<detail::Dispatcher> dispatcher) noexcept;
  /// The sessions and the policy, for DispatchedModel's inlined calls.
  [[nodiscard]] const detail::Dispatcher& dispatcher() const noexcept { return *_dispatcher; }

private:
  friend struct detail::ModelAccess;
  std::unique_ptr<detail::Dispatcher> _dispatcher; // the sessions and the policy, on the heap
};

} // namespace neml2
