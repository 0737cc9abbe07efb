// Composed models: segments in order over one state of named tensors; Newton for the
// implicit ones (their derivatives: chain_derivatives.cpp); the rows that failed.

#include "implicit/segment_chain.hpp"

#include <cmath>
#include <limits>
#include <map>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <neml2/errors.hpp>

#include "core/finite_values.hpp"
#include "implicit/chain_state.hpp"
#include "implicit/row_ranges.hpp"

namespace neml2::detail {
namespace {

// Clears `finite[r]` where row r of the `(rows, n)` `t` has a value that is not finite: on
// the host instead of five tensor operations, and rows only when some value is not.
void host_finite_rows(const at::Tensor& t, bool* finite) {
  if (all_finite(t))
    return;
  const auto dense = t.contiguous();
  const auto* data = dense.data_ptr<double>();
  const auto width = dense.size(1);
  for_row_ranges(dense.size(0), 2048, [&](std::int64_t begin, std::int64_t end) {
    for (auto r = begin; r < end; ++r) {
      bool all = true;
      for (std::int64_t k = 0; k < width; ++k) // x - x is 0 unless x is inf or NaN
        all &= data[r * width + k] - data[r * width + k] == 0;
      finite[r] = finite[r] && all;
    }
  });
}

// A solve's reasons and norms into the chain's (SegmentChain::State's): a row keeps those
// of the first solve it failed in. While no row has failed, the solve's norms are only
// referred to.
void add_failures(at::Tensor& reasons, at::Tensor& norms, const NewtonResult& solved) {
  if (!reasons.defined()) {
    reasons = solved.reasons;
    norms = solved.norm;
    return;
  }
  const auto failed_before = reasons != static_cast<std::int8_t>(RowFailure::none);
  norms = at::where(failed_before, norms, solved.norm);
  if (solved.reasons.defined())
    reasons = at::where(failed_before, reasons, solved.reasons);
}

// Each row's norm as a ConvergenceError reports it: NaN where it was not finite (inf
// too), 0 where the row converged.
at::Tensor reported_norms(const at::Tensor& norms, const at::Tensor& converged) {
  if (!norms.defined())
    return {};
  return norms.masked_fill(~at::isfinite(norms), std::numeric_limits<double>::quiet_NaN())
      .masked_fill(converged, 0.0);
}

} // namespace

std::vector<at::Tensor> SegmentChain::run(Operation op, ChunkArgs& chunk,
                                          const at::Tensor& newton_factors) const {
  auto state = start(op, chunk);
  state.newton_factors = newton_factors;
  run_steps(chunk, state);
  auto results = results_of(op, chunk, state);
  const auto n_not_finite = fail_rows_not_finite(chunk, results, state);
  if (state.converged.defined() && !state.converged.all().item<bool>())
    throw_unconverged(op, state, n_not_finite, std::move(results));
  return results;
}

SegmentChain::State SegmentChain::start(Operation op, const ChunkArgs& chunk) const {
  const auto n_inputs = _input_sizes.size();
  State state;
  state.rows = chunk.rows;
  state.track = op != Operation::forward;
  // param_vjp: the parameter Jacobian, contracted with the cotangents at the end.
  state.params = op == Operation::param_jacobian || op == Operation::param_vjp;
  state.columns = n_inputs + (state.params ? _artifact.parameters.size() : 0);
  for (std::size_t i = 0; i < n_inputs; ++i) {
    const auto& name = _artifact.inputs[i].name;
    state.values[name] = chunk.inputs[i];
    if (state.track) {
      auto& d = state.derivative(name, state.columns);
      const auto n = _input_sizes[i];
      d[i] = at::eye(n, chunk.inputs[i].options()).expand({chunk.rows, n, n});
    }
  }
  return state;
}

void SegmentChain::run_steps(const ChunkArgs& chunk, State& state) const {
  for (const auto& step : _steps)
    std::visit(
        [&](const auto& s) {
          if constexpr (std::is_same_v<std::decay_t<decltype(s)>, ForwardStep>)
            run_forward(s, chunk, state);
          else
            run_implicit(s, chunk, state);
        },
        step);
}

std::vector<at::Tensor> SegmentChain::results_of(Operation op, const ChunkArgs& chunk,
                                                 const State& state) const {
  std::vector<at::Tensor> results;
  for (const auto& out : _artifact.outputs)
    results.push_back(state.value(out.name, "the model's outputs"));
  if (op == Operation::param_vjp)
    return param_vjp_gradients(chunk, state, results);
  if (op == Operation::param_jacobian || op == Operation::jacobian)
    append_blocks(op, state, results);
  else if (op == Operation::jvp)
    append_tangents(chunk, state, results);
  return results;
}

void SegmentChain::run_forward(const ForwardStep& step, const ChunkArgs& chunk,
                               State& state) const {
  const auto& seg = *step.segment;
  std::vector<at::Tensor> args;
  args.reserve(seg.inputs.size() + step.params.size());
  for (const auto& n : seg.inputs)
    args.push_back(state.value(n, "graph '" + seg.package + "'"));
  for (auto p : step.params)
    args.push_back(chunk.params[p]);
  auto results = state.track ? step.jvp(args) : step.value(args);

  auto derivatives = state.track ? forward_derivatives(step, args, results, state)
                                 : std::vector<std::vector<at::Tensor>>{};
  for (std::size_t o = 0; o < seg.outputs.size(); ++o) {
    state.values[seg.outputs[o]] = std::move(results[o]);
    if (state.track)
      state.derivatives[seg.outputs[o]] = std::move(derivatives[o]);
  }
}

void SegmentChain::run_implicit(const ImplicitStep& step, const ChunkArgs& chunk,
                                State& state) const {
  const auto& seg = *step.segment;
  const auto where = fmt::format("graph '{}'", seg.residual_package);
  const auto pack = [&](const std::vector<VariableGroup>& groups,
                        const std::map<std::string, at::Tensor>& overrides) {
    std::vector<at::Tensor> packed;
    for (const auto& group : groups) {
      std::vector<at::Tensor> parts;
      for (const auto& n : group.names) {
        const auto it = overrides.find(n);
        parts.push_back(it != overrides.end() ? it->second.reshape({state.rows, -1})
                                              : state.flat(n, where));
      }
      packed.push_back(parts.size() == 1 ? parts.front().contiguous() : at::cat(parts, 1));
    }
    return packed;
  };

  // The initial guess: the predictor's outputs, else the unknown's incoming value, else 0.
  std::map<std::string, at::Tensor> guess;
  if (step.predictor) {
    std::vector<at::Tensor> args;
    for (const auto& n : seg.predictor_inputs)
      args.push_back(state.value(n, "graph '" + seg.predictor_package + "'"));
    auto predicted = step.predictor(args);
    for (std::size_t k = 0; k < seg.predictor_outputs.size(); ++k)
      guess[seg.predictor_outputs[k]] = std::move(predicted[k]);
  }
  const auto options =
      chunk.inputs.empty() ? at::TensorOptions(at::kDouble) : chunk.inputs.front().options();
  for (const auto& u : seg.unknowns)
    if (!guess.count(u.name) && !state.values.count(u.name))
      guess[u.name] = at::zeros({state.rows, u.var_size}, options);

  // Parameters enter the solve graphs as stored (one value for every row).
  std::vector<at::Tensor> params;
  for (auto p : step.params)
    params.push_back(chunk.params[p].select(0, 0));

  const auto givens = pack(seg.given_groups, {});
  // Substepped rows chain their derivatives through their spans (dense_derivative).
  const auto layout = dense_layout(step, state.params && step.solve_param);
  DerivativeFn du_dg;
  if (state.track && step.substeps.max_level > 0)
    du_dg = [&](const std::vector<at::Tensor>& u, const std::vector<at::Tensor>& g) {
      return dense_derivative(step, chunk, params, layout, u, g);
    };
  // The chord's slots of these rows, where the caller keeps them (NewtonFactors).
  const auto u0 = pack(seg.unknown_groups, guess);
  const auto factors = state.newton_factors.defined() && step.plan.factor_column >= 0
                           ? state.newton_factors.narrow(1, step.plan.factor_column,
                                                         chord_slot_width(step.plan.unknowns))
                           : at::Tensor();
  auto solved = solve_with_substeps(step.newton, step.plan, u0, givens, params, _config,
                                    step.substeps, du_dg, layout.n_params, factors);

  // Unpack the unknowns into the state.
  std::map<std::string, const ImplicitVariable*> unknown_spec;
  for (const auto& u : seg.unknowns)
    unknown_spec[u.name] = &u;
  for (std::size_t g = 0; g < seg.unknown_groups.size(); ++g) {
    std::int64_t offset = 0;
    for (const auto& n : seg.unknown_groups[g].names) {
      const auto& spec = *unknown_spec.at(n);
      state.values[n] =
          solved.u[g]
              .narrow(1, offset, spec.var_size)
              .reshape(with_rows(state.rows, {&spec.sub_batch_shape, &spec.base_shape}));
      offset += spec.var_size;
    }
  }
  state.converged =
      state.converged.defined() ? state.converged & solved.converged : solved.converged;
  if (std::isnan(solved.worst_residual) || solved.worst_residual > state.worst_residual)
    state.worst_residual = solved.worst_residual;
  add_failures(state.reasons, state.norms, solved);

  if (state.track)
    chain_implicit(step, chunk, solved, givens, params, layout, state);
}

// A row whose inputs are finite but whose results are not (a derivative through a dR/du
// that is singular at its converged point) failed too: reported, never returned.
std::int64_t SegmentChain::fail_rows_not_finite(const ChunkArgs& chunk,
                                                const std::vector<at::Tensor>& results,
                                                State& state) const {
  const auto finite_rows = [&](const std::vector<at::Tensor>& tensors) {
    auto finite = at::ones({state.rows},
                           at::TensorOptions().dtype(at::kBool).device(results.front().device()));
    for (const auto& t : tensors)
      if (t.defined() && t.dim() > 0 && t.size(0) == state.rows && t.is_floating_point()) {
        if (t.is_cpu() && t.scalar_type() == at::kDouble && finite.is_cpu())
          host_finite_rows(t.reshape({state.rows, -1}), finite.data_ptr<bool>());
        else
          finite = finite & at::isfinite(t.reshape({state.rows, -1})).all(1);
      }
    return finite;
  };
  const auto not_finite =
      results.empty() ? at::Tensor() : finite_rows(chunk.inputs) & ~finite_rows(results);
  const auto n_not_finite = not_finite.defined() ? not_finite.sum().item<std::int64_t>() : 0;
  if (n_not_finite > 0) {
    state.converged = (state.converged.defined() ? state.converged : ~not_finite) & ~not_finite;
    // Rows that failed in a solve keep its reason; the others converged: singular there.
    constexpr auto none = static_cast<std::int8_t>(RowFailure::none);
    const auto reasons = state.reasons.defined()
                             ? state.reasons
                             : at::full({state.rows}, none, not_finite.options().dtype(at::kChar));
    state.reasons = reasons.masked_fill(not_finite & (reasons == none),
                                        static_cast<std::int8_t>(RowFailure::singular));
  }
  return n_not_finite;
}

void SegmentChain::throw_unconverged(Operation op, const State& state, std::int64_t n_not_finite,
                                     std::vector<at::Tensor> results) const {
  const auto failed = ~state.converged;
  if (op == Operation::param_vjp) // a sum over rows: one that failed spoils it
    throw ConvergenceError(fmt::format(
        "{}: param_vjp(): Newton did not converge for {} of {} rows (iteration cap miters = "
        "{}, or a residual that stopped being finite); worst residual norm {}. The gradient "
        "sums over rows, so it is not returned: forward() tells which rows fail",
        _artifact.root.string(), failed.sum().item<std::int64_t>(), state.rows, _config.miters,
        state.worst_residual));
  for (auto& r : results) {
    auto mask_shape = Shape(static_cast<std::size_t>(r.dim()), 1);
    mask_shape[0] = state.rows;
    r = r.masked_fill(failed.reshape(mask_shape), std::numeric_limits<double>::quiet_NaN());
  }
  const auto n_failed = failed.sum().item<std::int64_t>();
  const auto singular =
      n_not_finite == 0
          ? std::string()
          : fmt::format(" ({} of them converged to a point where the results are not finite: "
                        "dR/du singular there)",
                        n_not_finite);
  throw ConvergenceError(
      fmt::format("{}: Newton did not converge for {} of {} rows{} (iteration cap miters = {}, "
                  "or a residual that stopped being finite); worst residual norm {}. "
                  "converged_mask() says which rows converged (their results are kept, the "
                  "others are NaN): cut the step of the failed rows and retry",
                  _artifact.root.string(), n_failed, state.rows, singular, _config.miters,
                  state.worst_residual),
      state.converged, state.worst_residual, std::move(results), {}, state.reasons,
      reported_norms(state.norms, state.converged));
}

} // namespace neml2::detail
