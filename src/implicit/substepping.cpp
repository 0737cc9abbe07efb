// Adaptive substepping of the rows Newton failed on: each row bisects its failed spans of
// the step, recursively, and chains its derivatives through the spans it solved.

#include "implicit/substepping.hpp"

#include <ATen/ATen.h>

#include <neml2/errors.hpp>

#include "implicit/host_reads.hpp"

namespace neml2::detail {
namespace {

at::Tensor slice(const std::vector<at::Tensor>& groups, const GroupSlice& s) {
  return groups[s.group].narrow(1, s.offset, s.size);
}

// Column of a slice in the flattened groups (sizes: each group's width).
std::int64_t column(const std::vector<std::int64_t>& offsets, const GroupSlice& s) {
  return offsets[s.group] + s.offset;
}

std::vector<std::int64_t> group_offsets(const std::vector<at::Tensor>& groups) {
  std::vector<std::int64_t> offsets{0};
  for (const auto& g : groups)
    offsets.push_back(offsets.back() + g.size(1));
  return offsets;
}

std::vector<at::Tensor> rows_of(const std::vector<at::Tensor>& groups, const at::Tensor& index) {
  std::vector<at::Tensor> out;
  for (const auto& g : groups)
    out.push_back(g.index_select(0, index));
  return out;
}

// d(span givens)/d(step givens), `(rows, n_g, n_g)`: identity for what stays, the
// interpolation weights of [begin, end] `(rows, 1)` for forces, the derivative carried from
// the previous span for old states (`chained_dg`, per chain `(rows, size, n_g)`).
at::Tensor span_weights(const SubstepPlan& plan, const std::vector<std::int64_t>& given_offsets,
                        std::int64_t n_g, const at::Tensor& begin, const at::Tensor& end,
                        const std::vector<at::Tensor>& chained_dg) {
  const auto rows = begin.size(0);
  const auto options = begin.options();
  auto weights = at::eye(n_g, options).expand({rows, n_g, n_g}).clone();
  const auto b = begin.unsqueeze(2), e = end.unsqueeze(2);
  for (const auto& r : plan.ramps) {
    const auto cur = column(given_offsets, r.current), old = column(given_offsets, r.old);
    const auto len = r.current.size;
    const auto eye = at::eye(len, options).expand({rows, len, len});
    auto cur_rows = weights.narrow(1, cur, len);
    auto old_rows = weights.narrow(1, old, len);
    cur_rows.zero_();
    old_rows.zero_();
    cur_rows.narrow(2, cur, len).copy_(e * eye);
    cur_rows.narrow(2, old, len).copy_((1 - e) * eye);
    old_rows.narrow(2, cur, len).copy_(b * eye);
    old_rows.narrow(2, old, len).copy_((1 - b) * eye);
  }
  for (std::size_t c = 0; c < plan.chains.size(); ++c)
    weights
        .narrow(1, column(given_offsets, plan.chains[c].old_state), plan.chains[c].old_state.size)
        .copy_(chained_dg[c]);
  return weights;
}

// The substepping state of the rows that failed in one step (all tensors over those rows).
// A row works through its step in spans [pos, pos + size) of 2^max_level units: the span
// it tries next, the depth of that span in the bisection tree, and what it carries from
// its last converged span (the solution, also the next initial guess, and the old states).
struct Substeps {
  at::Tensor rows;                    // indices into the batch
  std::vector<at::Tensor> full;       // the step's given groups
  std::vector<at::Tensor> u;          // last converged solution (or the initial guess)
  std::vector<at::Tensor> chained;    // per SubstepPlan::Chain: the old state
  at::Tensor pos, size, depth;        // int64
  at::Tensor done, dead, norm;        // converged through the step; failed at the bottom
  at::Tensor reasons;                 // why the last span failed (RowFailure), int8
  at::Tensor du_dg;                   // d(u)/d(full givens, extra) (rows, n_u, n_g), tracked
  std::vector<at::Tensor> chained_dg; // per chain: d(old state)/d(full givens)
};

} // namespace

NewtonResult solve_with_substeps(const NewtonGraphs& graphs, const NewtonPlan& newton,
                                 std::vector<at::Tensor> u0, const std::vector<at::Tensor>& givens,
                                 const std::vector<at::Tensor>& params, const SolverConfig& config,
                                 const SubstepPlan& plan, const DerivativeFn& du_dg,
                                 std::int64_t extra_columns, const at::Tensor& factors) {
  if (plan.max_level <= 0)
    return newton_solve(graphs, newton, std::move(u0), givens, params, config, false, factors);
  const auto guesses = u0;
  auto result = newton_solve(graphs, newton, std::move(u0), givens, params, config, true, factors);
  const auto failed = rows_where(~result.converged);
  if (failed.numel() == 0)
    return result;

  const std::int64_t units = std::int64_t{1} << plan.max_level;
  const auto index_options = failed.options();
  Substeps s;
  s.rows = failed;
  const auto n = failed.numel();
  s.full = rows_of(givens, failed);
  s.u = rows_of(guesses, failed);
  for (auto& t : s.u) // a row of the guess may be a view of the caller's input
    t = t.contiguous();
  for (const auto& c : plan.chains)
    s.chained.push_back(slice(s.full, c.old_state).clone());
  s.pos = at::zeros({n}, index_options);
  s.size = at::full({n}, units / 2, index_options);
  s.depth = at::ones({n}, index_options);
  s.done = at::zeros({n}, index_options.dtype(at::kBool));
  s.dead = s.done.clone();
  s.norm = result.norm.index_select(0, failed);
  s.reasons = result.reasons.index_select(0, failed);

  const auto given_offsets = group_offsets(s.full);
  const auto n_g = given_offsets.back() + extra_columns; // extra columns: static
  const auto unknown_offsets = group_offsets(s.u);
  const auto n_u = unknown_offsets.back();
  const bool track = static_cast<bool>(du_dg);
  if (track) {
    const auto eye = at::eye(n_g, s.full.front().options());
    s.du_dg = at::zeros({n, n_u, n_g}, eye.options());
    for (const auto& c : plan.chains)
      s.chained_dg.push_back(
          eye.narrow(0, column(given_offsets, c.old_state), c.old_state.size).expand({n, -1, -1}));
  }

  while (true) {
    const auto active = rows_where(~(s.done | s.dead));
    if (active.numel() == 0)
      break;
    const auto pos = s.pos.index_select(0, active);
    const auto size = s.size.index_select(0, active);
    const auto begin = (pos.to(s.norm.scalar_type()) / static_cast<double>(units)).unsqueeze(1);
    const auto end =
        ((pos + size).to(s.norm.scalar_type()) / static_cast<double>(units)).unsqueeze(1);

    // The span's givens: forces interpolated, old states chained, the rest as in the step.
    const auto full = rows_of(s.full, active);
    std::vector<at::Tensor> span;
    for (const auto& g : full)
      span.push_back(g.clone());
    for (const auto& r : plan.ramps) {
      const auto old = slice(full, r.old), current = slice(full, r.current);
      slice(span, r.current).copy_(at::lerp(old, current, end));
      slice(span, r.old).copy_(at::lerp(old, current, begin));
    }
    for (std::size_t c = 0; c < plan.chains.size(); ++c)
      slice(span, plan.chains[c].old_state).copy_(s.chained[c].index_select(0, active));

    auto solved = newton_solve(graphs, newton, rows_of(s.u, active), span, params, config, true);
    const auto ok = solved.converged;
    const auto ok_index = rows_where(ok), bad_index = rows_where(~ok);
    const auto ok_rows = active.index_select(0, ok_index);
    const auto bad_rows = active.index_select(0, bad_index);

    // Converged spans: carry the solution, move on, climb back up the tree.
    if (ok_rows.numel() > 0) {
      const auto solution = rows_of(solved.u, ok_index);
      if (track) {
        std::vector<at::Tensor> chained_dg;
        for (const auto& c : s.chained_dg)
          chained_dg.push_back(c.index_select(0, ok_rows));
        const auto weights = span_weights(plan, given_offsets, n_g, begin.index_select(0, ok_index),
                                          end.index_select(0, ok_index), chained_dg);
        const auto d = at::matmul(du_dg(solution, rows_of(span, ok_index)), weights);
        s.du_dg.index_copy_(0, ok_rows, d);
        for (std::size_t c = 0; c < plan.chains.size(); ++c) {
          const auto& u = plan.chains[c].unknown;
          s.chained_dg[c] = s.chained_dg[c].index_copy(
              0, ok_rows, d.narrow(1, column(unknown_offsets, u), u.size));
        }
      }
      for (std::size_t k = 0; k < s.u.size(); ++k)
        s.u[k].index_copy_(0, ok_rows, solution[k]);
      for (std::size_t c = 0; c < plan.chains.size(); ++c)
        s.chained[c].index_copy_(0, ok_rows, slice(solution, plan.chains[c].unknown));
      s.norm.index_copy_(0, ok_rows, solved.norm.index_select(0, ok_index));
      auto p = s.pos.index_select(0, ok_rows) + s.size.index_select(0, ok_rows);
      auto z = s.size.index_select(0, ok_rows);
      auto d = s.depth.index_select(0, ok_rows);
      for (std::int64_t level = 0; level < plan.max_level; ++level) {
        const auto up = (d > 0) & (p.remainder(2 * z) == 0);
        z = at::where(up, 2 * z, z);
        d = at::where(up, d - 1, d);
      }
      s.pos.index_copy_(0, ok_rows, p);
      s.size.index_copy_(0, ok_rows, z);
      s.depth.index_copy_(0, ok_rows, d);
      s.done.index_copy_(0, ok_rows, p == units);
    }
    // Failed spans: bisect, or fail the row at the deepest level.
    if (bad_rows.numel() > 0) {
      s.norm.index_copy_(0, bad_rows, solved.norm.index_select(0, bad_index));
      s.reasons.index_copy_(0, bad_rows, solved.reasons.index_select(0, bad_index));
      const auto d = s.depth.index_select(0, bad_rows);
      const auto bottom = d >= plan.max_level;
      s.dead.index_copy_(0, bad_rows, bottom);
      s.size.index_copy_(0, bad_rows,
                         at::where(bottom, s.size.index_select(0, bad_rows),
                                   s.size.index_select(0, bad_rows).div(2, "floor")));
      s.depth.index_copy_(0, bad_rows, at::where(bottom, d, d + 1));
    }
  }

  // Back into the batch; the caller's tensors are never written.
  for (std::size_t k = 0; k < result.u.size(); ++k)
    result.u[k] = result.u[k].index_copy(0, s.rows, s.u[k]);
  result.converged = result.converged.index_copy(0, s.rows, s.done);
  result.norm = result.norm.index_copy(0, s.rows, s.norm);
  const auto still_failed = failed_rows(result.converged, result.norm);
  result.worst_residual = still_failed.worst_residual;
  result.reasons =
      still_failed.any
          ? result.reasons.index_copy(
                0, s.rows,
                s.reasons.masked_fill(s.done, static_cast<std::int8_t>(RowFailure::none)))
          : at::Tensor();
  const auto settled = rows_where(s.done);
  if (settled.numel() > 0) {
    result.substepped = s.rows.index_select(0, settled);
    if (track)
      result.substepped_du_dg = s.du_dg.index_select(0, settled);
  }
  return result;
}

} // namespace neml2::detail
