#pragma once

/// @file material_state.hpp
/// @brief MaterialState: the history a finite-element host keeps for its material points,
/// kept by the library over any DispatchedModel. The start of the step and its trial end,
/// step / accept / reject, and the points that fail cut alone. See docs/hosts.md.

#include <atomic>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <neml2/dispatch_fwd.hpp>
#include <neml2/newton_factors.hpp>
#include <neml2/submitted.hpp>

namespace neml2 {
namespace detail {
struct PointsEvaluation; // a step's evaluation (src/host/step_cuts.hpp)
}

/// @brief How a model's inputs pair up over a time step, from their names (as NEML2's
/// drivers pair them): `x~1` is the value of `x` at the start of the step.
struct StateRoles {
  /// @var state
  /// `x`: an output whose old value `x~1` is an input (an input `x` too, when there is one,
  /// is Newton's initial guess, given the start value).
  /// @var forces
  /// `f`: an input whose old value `f~1` is an input too (the time `t` among them).
  /// @var given
  /// Inputs with no old value that are not outputs (a temperature): given at each step.
  /// @var fixed
  /// Old values `h~1` with no current partner: held at their initial value (0 unless given).
  std::vector<std::string> state, forces, given, fixed;
  /// How many old values of a state variable or force the model takes: `x~1` to `x~k`
  /// (NEML2's LinearExtrapolationPredictor takes `x~2` and `t~2`); 1 when it is absent.
  std::map<std::string, int> depth;
};

/// The roles of `model`'s inputs and outputs.
[[nodiscard]] StateRoles state_roles(const AnyDispatchedModel& model);

/// @brief Where a step writes its results: tensors the host owns, in its own layout.
/// @code
/// // An array of structures: per point, 6 stress values then the 36 of d(stress)/d(E).
/// auto records = at::empty({points, 42}, at::kDouble);
/// neml2::HostLayout into{.outputs = {{"stress", records.narrow(1, 0, 6)}},
///                        .derivatives = {{"stress", {{"E", records.narrow(1, 6, 36).view({points,
///                        6, 6})}}}}};
/// state.step(forces, t, {.derivatives = true, .into = into});
/// @endcode
struct HostLayout {
  /// Outputs by name: `(N, ...)`, or `(K, ...)` with `points`; in the model's dtype, on any
  /// device, with any strides whose elements are distinct (a column slice of records).
  TensorMap outputs;
  /// Derivative blocks `[out][in]`, `(N, *out_base, *in_base)` (or `(K, ...)`), the same way.
  VariablePairJacobian derivatives;
  /// Optional int64 `(K,)`: the state's points the rows hold, in order (a subset, or the
  /// host's own numbering); their results are copied in. Without it every point, in order,
  /// is written by the model's graphs themselves: no copy. No two destinations of a layout
  /// may share a byte of memory.
  at::Tensor points;
};

/// How MaterialState::step evaluates.
struct StepOptions {
  /// Also the derivatives `J[out][in]` of the whole step (jacobian()); for a cut point they
  /// are chained through its sub-steps.
  bool derivatives = false;
  /// A point whose step fails (Newton does not converge) retries it alone, its forces and
  /// time interpolated over spans bisected down to 2^-max_cuts of the step; 0: no retry.
  /// A given input (no old value in the model) is interpolated from its last accepted value
  /// (or its initial one); before the state has one it is held at the step's value.
  int max_cuts = 0;
  /// Results also (or only) in the host's storage; StepResult then refers to it.
  HostLayout into = {};
  /// Newton's guess for the state extrapolated linearly from the last accepted step
  /// (start + (start - the start before) * dt / dt before, per point), not the start: fewer
  /// iterations on a smooth history, results the same within Newton's tolerance. The state
  /// keeps the start before from the first step that asks on (that step starts from the
  /// start). A model with no input `x` for Newton's guess cannot use it: refused.
  bool extrapolate = false;
  /// Optional int64 `(K,)`, distinct: a step over these points only, in this order. The
  /// forces are theirs, `(K, ...)` (or broadcast); their start is gathered by the same
  /// indices, the results are `(K, ...)` (the host layout's rows too, which then takes no
  /// points of its own), and accept() moves the converged ones; the other points keep
  /// their start.
  at::Tensor points;
  /// Chord Newton (NewtonFactors): each point steps from the factored Newton matrix it
  /// took last, in an earlier step too (the state keeps one a point: 8 (1 + n + n^2) bytes
  /// for n unknowns), and takes A again only where its residual stops falling fast enough
  /// (SolverConfig::chord_rate). Results meet Newton's test, so they agree with the
  /// default's within its tolerance (docs/hosts.md). Cut points' spans run plain Newton.
  bool chord = false;
};

/// What a step found. The state never writes its tensors again (an accepted trial becomes
/// the start as it is): a handle keeps its values. Read them; do not write them.
struct StepResult {
  /// Every output at the trial end of the step, `(N, ...)` (`(K, ...)` over
  /// StepOptions::points); NaN for the points that failed.
  TensorMap outputs;
  /// With StepOptions::derivatives: `J[out][in]` per point, `(N, *out_base, *in_base)`
  /// (NaN for the points that failed).
  VariablePairJacobian derivatives;
  /// `(N,)` bool: the points whose step (or every sub-step) converged with finite outputs
  /// (an explicit model's point with a NaN or infinite output failed).
  at::Tensor converged;
  /// `(N,)` int8, a RowFailure per point: why it failed (its last try, when cut); `none`
  /// where it converged.
  at::Tensor reasons;
  /// `(N,)` double: each failed point's last residual norm (NaN where it was not finite,
  /// and for a non-finite output); 0 where the point converged.
  at::Tensor residuals;
  /// `(N,)` int64: the sub-steps each point took: 1 uncut, more when cut, 0 when failed.
  at::Tensor substeps;
  /// @var cut
  /// How many points took more than one sub-step.
  /// @var failed
  /// How many points failed (at the deepest cut, when cutting).
  std::int64_t cut = 0, failed = 0;
};

/// @brief The state of N material points over a model: the start of the step (state,
/// forces and time as last accepted) and, after step(), its trial end.
///
/// step() evaluates the model from the start for the forces given (a host calls it at
/// every residual evaluation of its solve; each call replaces the trial); accept() makes
/// the trial the new start (every converged point, or a subset), reject() keeps the start.
/// Accepting every point swaps tensors, nothing is copied.
/// @code
/// auto model = neml2::load_model("aoti/model_aoti.i", "model");
/// neml2::MaterialState state(model, points);
/// for (int n = 1; n <= steps; ++n) {
///   const auto& r = state.step({{"E", strain(n)}}, time(n), {.max_cuts = 4});
///   r.failed == 0 ? state.accept() : state.reject();
/// }
/// @endcode
/// The model must outlive the state. Not thread safe: one host thread steps it at a time.
class MaterialState {
public:
  /// N points, on the model's first device in its dtype. `initial` may set the start of
  /// any state variable (by its name `x`), force (`f`, its last value), fixed input
  /// (`h~1`), given input (`g`, a cut's start) or older value (`x~2`, ...): `(N, ...)` or
  /// broadcast to it; the rest start at 0 (older values at `x`'s start). Throws FatalError.
  MaterialState(const AnyDispatchedModel& model, std::int64_t points,
                const TensorMap& initial = {});
  /// Waits for a submitted step still running.
  ~MaterialState();
  /// Moves the state (not while a step of either is submitted).
  MaterialState(MaterialState&&) noexcept = default;
  /// Moves the state (not while a step of either is submitted).
  MaterialState& operator=(MaterialState&&) noexcept = default;

  /// The roles of the model's variables.
  [[nodiscard]] const StateRoles& roles() const noexcept { return _roles; }
  /// N.
  [[nodiscard]] std::int64_t points() const noexcept { return _points; }
  /// The start of the step (never written in place: accept() replaces tensors, so a handle
  /// keeps its values): each state variable `x`, each force `f` (its last accepted
  /// value) and each fixed input `h~1`, `(N, ...)`.
  [[nodiscard]] const TensorMap& start() const noexcept { return _start; }
  /// True between a step() and its accept() or reject(), and from a submit() until its
  /// handle's wait().
  [[nodiscard]] bool pending() const noexcept;

  /// @brief Evaluates the step from the start to `forces`: a value for every force and
  /// given input, `(N, ...)` or broadcast to it. Replaces any trial not yet accepted. Every
  /// input is checked before anything runs: a refused step leaves the state as it was.
  /// Past the checks the trial before is let go (two steps' results are never held at
  /// once), so a step that fails later leaves the start as it was and no trial.
  const StepResult& step(const TensorMap& forces, const StepOptions& options = {});
  /// The same with the time `t` (the force named "t") given apart.
  const StepResult& step(const TensorMap& forces, const at::Tensor& t,
                         const StepOptions& options = {});

  /// @brief step() on the library's worker thread (submitted.hpp): returns at once, and
  /// the handle's wait() gives the step's result or throws what step() would past its
  /// checks. Every input is checked here, and the forces and given inputs copied: the host
  /// may reuse its buffers at once. Until the handle's wait() (or its destruction), however
  /// far the worker has got, the state takes no other step, submission, accept or reject
  /// (a FatalError), so the handle's result is its step's.
  Submitted<const StepResult&> submit(const TensorMap& forces, const StepOptions& options = {});
  /// The same with the time `t` given apart.
  Submitted<const StepResult&> submit(const TensorMap& forces, const at::Tensor& t,
                                      const StepOptions& options = {});

  /// Makes the trial the start of the next step for every point that converged (the
  /// others keep their start). A FatalError when no step is pending.
  void accept();
  /// The same for `points` only: an `(N,)` bool mask or int64 indices, each a point that
  /// converged (checked before anything is written).
  void accept(const at::Tensor& points);
  /// Drops the trial: the start stays as it was. A FatalError when no step is pending.
  void reject();

private:
  [[nodiscard]] TensorMap checked_forces(const TensorMap& forces, const StepOptions& options,
                                         bool copy_given) const;
  [[nodiscard]] at::Tensor selected_points(const at::Tensor& points) const;
  [[nodiscard]] TensorMap with_time(const TensorMap& forces, const at::Tensor& t) const;
  const StepResult& run_step(TensorMap values, const StepOptions& options);
  // The start as it is (at `points`, the trial's `rows`; all when undefined) as the start
  // before the next: the older values x~k, given inputs for cuts, extrapolate's start before.
  void keep_before(const at::Tensor& points, const at::Tensor& rows);
  void accept_rows(const at::Tensor& points, const at::Tensor& rows);
  [[nodiscard]] std::int64_t step_rows(const StepOptions& options) const;
  void check_step_points(const StepOptions& options) const;
  void refuse_while_submitted(const char* what) const;
  void check_layout(const HostLayout& into, const StepOptions& options) const;
  [[nodiscard]] detail::PointsEvaluation
  evaluate_into(const TensorMap& inputs, const StepOptions& options, NewtonFactors* factors) const;

  const AnyDispatchedModel* _model;
  StateRoles _roles;
  std::int64_t _points;
  at::TensorOptions _options;           // the model's first device and dtype
  std::map<std::string, Shape> _shapes; // each variable's value per point (sub-batch, base)
  TensorMap _start;                     // state x, forces f, fixed h~1
  TensorMap _forces; // the pending step's forces and given inputs, copied (what accept() takes)
  TensorMap _before; // the start before the last accept (state x and t)
  TensorMap _given_start; // given inputs as last accepted (cut interpolation)
  std::map<std::string, std::vector<at::Tensor>> _older; // x~2, x~3, ... by x (depth > 1)
  bool _extrapolating = false; // a step asked for StepOptions::extrapolate
  bool _cutting = false;       // a step asked for max_cuts > 0
  StepResult _result;          // the pending step's
  at::Tensor _subset;          // its StepOptions::points (undefined: every point)
  bool _pending = false;
  std::shared_future<void> _submitted;          // ready once the last submitted step has ended
  std::shared_ptr<std::atomic<bool>> _unwaited; // true until the submitted step's wait()
  at::Tensor _all_converged, _one_substep;      // a step's flags when every point converged
  at::Tensor _no_failures, _no_residuals;       // and its reasons and residuals
  bool _has_jacobian = false;
  std::set<std::string> _host_owned; // outputs of the pending trial that live in host storage
  std::map<std::string, Shape> _input_shapes, _output_shapes; // per point, by public name
  std::vector<std::pair<std::string, std::string>> _pairs;    // (out, in) with derivatives
  std::string _missing_block; // a derivative block cut steps need and the artifact lacks
  NewtonFactors _factors;     // the chord's, per point (StepOptions::chord)
};

} // namespace neml2
