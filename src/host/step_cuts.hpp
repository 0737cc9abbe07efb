#pragma once

// A step's evaluation over some points, and the retry of the points whose step failed in
// bisected spans, their derivatives chained through the spans. Private to the library.

#include <neml2/material_state.hpp>

namespace neml2::detail {

/// One evaluation: the results by name and which points converged (undefined: all), why
/// the others failed and their last residual norms (StepResult's reasons and residuals).
struct PointsEvaluation {
  TensorMap outputs;
  VariablePairJacobian derivatives;
  at::Tensor converged, reasons, residuals;
  /// Some converged point had a non-finite output (its results not yet NaN: fill_failed).
  bool non_finite = false;
};

/// forward() (or jacobian(), with `derivatives`) of `inputs`, with the chord's `factors`
/// when given; a per-row ConvergenceError becomes its results (failed rows NaN) and its
/// mask. Any other error propagates.
[[nodiscard]] PointsEvaluation evaluate_points(const AnyDispatchedModel& model,
                                               const TensorMap& inputs, bool derivatives,
                                               NewtonFactors* factors = nullptr);

/// The points of `e` (its outputs `(N, ...)`) that a per-row ConvergenceError (`error`, or
/// none) names failed; for an explicit model (no Newton to judge), those with a non-finite
/// output, which fail as non-finite.
void flag_failures(const AnyDispatchedModel& model, PointsEvaluation& e,
                   const ConvergenceError* error);

/// NaN into the rows `failed` of `result`'s outputs and derivatives.
void fill_failed(StepResult& result, const at::Tensor& failed);

/// Older values by state variable or force `x`: `x~2`, `x~3`, ... (StateRoles::depth).
using OlderValues = std::map<std::string, std::vector<at::Tensor>>;

/// The older values `model` takes as inputs into `in` (rows `rows` of them; all when
/// undefined).
void add_older_inputs(TensorMap& in, const AnyDispatchedModel& model, const OlderValues& older,
                      const at::Tensor& rows = {});

/// What the points of a step start from and go to.
struct StepEnds {
  const AnyDispatchedModel& model;
  const StateRoles& roles;
  const StepOptions& options;
  const TensorMap& start;       // the state's start(), (N, ...)
  const TensorMap& forces;      // the step's forces and given inputs, (N, ...)
  const TensorMap& given_start; // given inputs as last accepted (those the state keeps)
  const OlderValues& older;     // x~2, ... by x
};

/// Retries `points` (int64 indices of points whose step failed) over spans of their step
/// bisected recursively, down to 2^-max_cuts of it: after a span converges, the next is the
/// rest of its parent span, each point on its own. Writes their outputs (and derivatives,
/// chained through the spans) into `result`'s rows (which must be batched and writable),
/// their sub-step counts into `result.substeps` and their end into `result.converged`.
void cut_points(const StepEnds& step, const at::Tensor& points, StepResult& result);

} // namespace neml2::detail
