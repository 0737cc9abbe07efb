// Jacobians chained through a composed model's segments: forward segments by their jvp
// graphs, implicit ones by the implicit function theorem (du/dg = -A^{-1} B from their
// compiled graphs, or our row pass's solves); the blocks, tangents and gradients asked for.

#include <algorithm>
#include <map>

#include <ATen/ATen.h>

#include "implicit/chain_state.hpp"
#include "implicit/lapack_rows.hpp"
#include "implicit/row_ranges.hpp"
#include "implicit/row_system.hpp"
#include "implicit/segment_chain.hpp"

namespace neml2::detail {

// On the CPU in double one pass over the rows on the host:
// ATen's bmm runs many small products as a slow loop (most of jacobian()'s time on J2).
at::Tensor rows_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& addend) {
  const auto host = [](const at::Tensor& t) {
    return !t.defined() || (t.is_cpu() && t.scalar_type() == at::kDouble && t.dim() == 3);
  };
  const auto rows = std::max(a.size(0), b.size(0));
  if (!host(a) || !host(b) || !host(addend) || a.size(2) != b.size(1) ||
      (addend.defined() && addend.sizes() != c10::IntArrayRef{rows, a.size(1), b.size(2)})) {
    auto product = at::matmul(a, b);
    return addend.defined() ? addend + product : product;
  }
  const auto n = a.size(1), k = a.size(2), m = b.size(2);
  auto out = addend.defined() ? addend.clone(at::MemoryFormat::Contiguous)
                              : at::zeros({rows, n, m}, a.options());
  const auto* pa = a.data_ptr<double>();
  const auto* pb = b.data_ptr<double>();
  auto* po = out.data_ptr<double>();
  const auto as0 = a.size(0) == 1 ? 0 : a.stride(0), as1 = a.stride(1), as2 = a.stride(2);
  const auto bs0 = b.size(0) == 1 ? 0 : b.stride(0), bs1 = b.stride(1), bs2 = b.stride(2);
  for_row_ranges(rows, 256, [&](std::int64_t begin, std::int64_t end) {
    for (auto i = begin; i < end; ++i)
      for (std::int64_t r = 0; r < n; ++r) {
        double* o = po + (i * n + r) * m;
        for (std::int64_t x = 0; x < k; ++x) {
          const double air = pa[i * as0 + r * as1 + x * as2];
          for (std::int64_t c = 0; c < m; ++c)
            o[c] += air * pb[i * bs0 + x * bs1 + c * bs2];
        }
      }
  });
  return out;
}

void accumulate(std::vector<at::Tensor>& target, const at::Tensor& block,
                const std::vector<at::Tensor>& source) {
  for (std::size_t x = 0; x < source.size(); ++x)
    if (source[x].defined())
      target[x] = rows_matmul(block, source[x], target[x]);
}

namespace {

// -A^{-1} C on the CPU, where the plan says (DerivativeSolve::rows or lapack_rows).
at::Tensor minus_solve_on_host(const NewtonPlan& plan, const std::vector<at::Tensor>& a_blocks,
                               const std::vector<at::Tensor>& c_blocks,
                               std::size_t residual_groups) {
  return plan.derivatives == DerivativeSolve::lapack_rows
             ? minus_solve_lapack_rows(a_blocks, c_blocks, residual_groups)
             : minus_solve_rows(a_blocks, c_blocks, residual_groups);
}

} // namespace

std::vector<at::Tensor> ift_pairs(const ImplicitSegment& seg, const at::Tensor& du_dg) {
  const auto rows = du_dg.size(0);
  std::vector<at::Tensor> pairs;
  for (const auto& pair : seg.jacobian_pairs) {
    const auto nu = numel(pair.unknown_base_shape), ng = numel(pair.given_base_shape);
    pairs.push_back(
        du_dg.narrow(1, pair.row_offset, nu)
            .narrow(2, pair.col_offset, ng)
            .reshape(with_rows(rows, {&pair.unknown_base_shape, &pair.given_base_shape})));
  }
  return pairs;
}

std::vector<std::vector<at::Tensor>>
SegmentChain::forward_derivatives(const ForwardStep& step, const std::vector<at::Tensor>& args,
                                  const std::vector<at::Tensor>& results,
                                  const State& state) const {
  const auto& seg = *step.segment;
  std::vector<std::vector<at::Tensor>> derivatives(seg.outputs.size());
  const auto column = [&](const std::string& param) {
    return _input_sizes.size() + _param_index.at(param);
  };
  if (state.params && step.param_jacobian) {
    const auto blocks = step.param_jacobian(args);
    for (std::size_t k = 0; k < seg.param_jacobian_pairs.size(); ++k) {
      const auto& pair = seg.param_jacobian_pairs[k];
      const auto o = static_cast<std::size_t>(
          std::find(seg.outputs.begin(), seg.outputs.end(), pair.out) - seg.outputs.begin());
      derivatives[o].resize(state.columns);
      derivatives[o][column(pair.param)] =
          blocks[k].reshape({state.rows, numel(pair.out_base_shape), numel(pair.param_base_shape)});
    }
  }
  {
    const auto n_inputs = state.columns;
    for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
      const auto& pair = seg.jacobian_pairs[k];
      const auto o = static_cast<std::size_t>(
          std::find(seg.outputs.begin(), seg.outputs.end(), pair.out) - seg.outputs.begin());
      const auto source = state.derivatives.find(pair.in);
      if (source == state.derivatives.end())
        continue;
      const auto& block = results[seg.outputs.size() + k];
      derivatives[o].resize(n_inputs);
      accumulate(
          derivatives[o],
          block.reshape({block.size(0), numel(pair.out_base_shape), numel(pair.in_base_shape)}),
          source->second);
    }
  }
  return derivatives;
}

void SegmentChain::chain_implicit(const ImplicitStep& step, const ChunkArgs& chunk,
                                  const NewtonResult& solved, const std::vector<at::Tensor>& givens,
                                  const std::vector<at::Tensor>& params, const DenseLayout& layout,
                                  State& state) const {
  const auto& seg = *step.segment;
  // du/dg = -A^{-1} B at the solution, then chained to the model's inputs.
  auto pairs = input_sensitivity(step, solved.u, givens, params);
  if (solved.substepped.defined()) {
    // Rows solved in substeps: their derivatives chained through the substeps.
    for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
      const auto& pair = seg.jacobian_pairs[k];
      const auto nu = numel(pair.unknown_base_shape), ng = numel(pair.given_base_shape);
      pairs[k] = pairs[k]
                     .reshape({state.rows, nu, ng})
                     .index_copy(0, solved.substepped,
                                 solved.substepped_du_dg.narrow(1, pair.row_offset, nu)
                                     .narrow(2, pair.col_offset, ng));
    }
  }
  const auto n_columns = state.columns;
  std::map<std::string, std::vector<at::Tensor>> derivatives;
  if (state.params && step.solve_param) {
    // du/dparam = -A^{-1} dr/dparam, the parameters given per row.
    std::vector<at::Tensor> per_row = solved.u;
    per_row.insert(per_row.end(), givens.begin(), givens.end());
    for (auto p : step.params)
      per_row.push_back(chunk.params[p]);
    const auto blocks = param_sensitivity(step, per_row, layout);
    for (std::size_t k = 0; k < seg.param_jacobian_pairs.size(); ++k) {
      const auto& pair = seg.param_jacobian_pairs[k];
      auto& target = derivatives[pair.out];
      target.resize(n_columns);
      const auto nu = numel(pair.out_base_shape), np = numel(pair.param_base_shape);
      auto block = blocks[k].reshape({state.rows, nu, np});
      if (solved.substepped.defined()) // chained through the substeps
        block =
            block.index_copy(0, solved.substepped,
                             solved.substepped_du_dg.narrow(1, layout.unknown_row.at(pair.out), nu)
                                 .narrow(2,
                                         solved.substepped_du_dg.size(2) - layout.n_params +
                                             layout.param_column.at(pair.param),
                                         np));
      target[_input_sizes.size() + _param_index.at(pair.param)] = block;
    }
  }
  for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
    const auto& pair = seg.jacobian_pairs[k];
    const auto source = state.derivatives.find(pair.given);
    auto& target = derivatives[pair.unknown];
    target.resize(n_columns);
    if (source != state.derivatives.end())
      accumulate(target,
                 pairs[k].reshape(
                     {state.rows, numel(pair.unknown_base_shape), numel(pair.given_base_shape)}),
                 source->second);
  }
  for (const auto& u : seg.unknowns) {
    auto& d = derivatives[u.name];
    d.resize(n_columns);
    state.derivatives[u.name] = std::move(d);
  }
}

std::vector<at::Tensor>
SegmentChain::input_sensitivity(const ImplicitStep& step, const std::vector<at::Tensor>& u,
                                const std::vector<at::Tensor>& g,
                                const std::vector<at::Tensor>& params) const {
  const auto args = graph_args(u, g, params);
  if (step.plan.derivatives != DerivativeSolve::graphs) {
    auto a_blocks = call_for_rows(step.newton.jacobian, args);
    a_blocks.resize(step.a_blocks);
    return ift_pairs(*step.segment, minus_solve_on_host(step.plan, a_blocks,
                                                        call_for_rows(step.jacobian_given, args),
                                                        step.segment->residual_groups.size()));
  }
  auto operators = step.newton.jacobian(args);
  operators.resize(step.a_blocks);
  const auto b_blocks = step.jacobian_given(args);
  operators.insert(operators.end(), b_blocks.begin(), b_blocks.end());
  return step.solve_ift(operators);
}

std::vector<at::Tensor> SegmentChain::param_sensitivity(const ImplicitStep& step,
                                                        const std::vector<at::Tensor>& per_row,
                                                        const DenseLayout& layout) const {
  if (step.plan.derivatives == DerivativeSolve::graphs)
    return step.solve_param(step.dr_dparam(per_row));
  const auto operators = call_for_rows(step.dr_dparam, per_row);
  const auto split = operators.begin() + static_cast<std::ptrdiff_t>(step.a_blocks);
  const auto du =
      minus_solve_on_host(step.plan, {operators.begin(), split}, {split, operators.end()},
                          step.segment->residual_groups.size());
  std::vector<at::Tensor> pairs;
  for (const auto& pair : step.segment->param_jacobian_pairs)
    pairs.push_back(
        du.narrow(1, layout.unknown_row.at(pair.out), numel(pair.out_base_shape))
            .narrow(2, layout.param_column.at(pair.param), numel(pair.param_base_shape)));
  return pairs;
}

SegmentChain::DenseLayout SegmentChain::dense_layout(const ImplicitStep& step,
                                                     bool with_params) const {
  DenseLayout layout;
  if (!with_params)
    return layout;
  const auto& seg = *step.segment;
  std::vector<std::int64_t> group_start{0};
  for (const auto& g : seg.unknown_groups) {
    std::int64_t width = 0;
    for (const auto& n : g.names)
      for (const auto& u : seg.unknowns)
        width += u.name == n ? u.var_size : 0;
    group_start.push_back(group_start.back() + width);
  }
  for (const auto& [name, at] : slices(seg.unknown_groups, seg.unknowns))
    layout.unknown_row[name] = group_start[at.group] + at.offset;
  for (auto p : step.params) {
    layout.param_column[_artifact.parameters[p].name] = layout.n_params;
    layout.n_params += numel(_artifact.parameters[p].base_shape);
  }
  return layout;
}

at::Tensor SegmentChain::dense_derivative(const ImplicitStep& step, const ChunkArgs& chunk,
                                          const std::vector<at::Tensor>& params,
                                          const DenseLayout& layout,
                                          const std::vector<at::Tensor>& u,
                                          const std::vector<at::Tensor>& g) const {
  const auto& seg = *step.segment;
  // du/dg = -A^{-1} B, from the graphs, at the blocks' flat offsets.
  const auto blocks = input_sensitivity(step, u, g, params);
  std::int64_t n_u = 0, n_g = 0;
  for (const auto& t : u)
    n_u += t.size(1);
  for (const auto& t : g)
    n_g += t.size(1);
  const auto rows = u.front().size(0);
  auto dense = at::zeros({rows, n_u, n_g + layout.n_params}, u.front().options());
  for (std::size_t k = 0; k < seg.jacobian_pairs.size(); ++k) {
    const auto& pair = seg.jacobian_pairs[k];
    const auto nu = numel(pair.unknown_base_shape), ng = numel(pair.given_base_shape);
    dense.narrow(1, pair.row_offset, nu)
        .narrow(2, pair.col_offset, ng)
        .copy_(blocks[k].reshape({rows, nu, ng}));
  }
  if (layout.n_params == 0)
    return dense;
  // du/dparam = -A^{-1} dr/dparam, the parameters (one value for every row) per row.
  std::vector<at::Tensor> per_row = u;
  per_row.insert(per_row.end(), g.begin(), g.end());
  for (auto p : step.params) {
    auto shape = chunk.params[p].sizes().vec();
    shape[0] = rows;
    per_row.push_back(chunk.params[p].narrow(0, 0, 1).expand(shape).contiguous());
  }
  const auto by_param = param_sensitivity(step, per_row, layout);
  for (std::size_t k = 0; k < seg.param_jacobian_pairs.size(); ++k) {
    const auto& pair = seg.param_jacobian_pairs[k];
    const auto nu = numel(pair.out_base_shape), np = numel(pair.param_base_shape);
    dense.narrow(1, layout.unknown_row.at(pair.out), nu)
        .narrow(2, n_g + layout.param_column.at(pair.param), np)
        .copy_(by_param[k].reshape({rows, nu, np}));
  }
  return dense;
}

std::vector<at::Tensor>
SegmentChain::param_vjp_gradients(const ChunkArgs& chunk, const State& state,
                                  const std::vector<at::Tensor>& outputs) const {
  const auto n_inputs = _input_sizes.size();
  std::vector<at::Tensor> grads;
  for (auto p : _param_vjp_params) {
    const auto& param = _artifact.parameters[p];
    at::Tensor grad = at::zeros({state.rows, numel(param.base_shape)}, outputs.front().options());
    for (std::size_t o = 0; o < _artifact.outputs.size(); ++o) {
      const auto it = state.derivatives.find(_artifact.outputs[o].name);
      const auto column = n_inputs + p;
      if (it == state.derivatives.end() || it->second.size() <= column ||
          !it->second[column].defined() || !chunk.extras[o].defined())
        continue;
      // (rows, 1, n_out) x (rows, n_out, n_param)
      grad =
          grad +
          rows_matmul(chunk.extras[o].reshape({state.rows, 1, -1}), it->second[column]).squeeze(1);
    }
    grads.push_back(grad.reshape(with_rows(state.rows, {&param.base_shape})));
  }
  return grads;
}

void SegmentChain::append_blocks(Operation op, const State& state,
                                 std::vector<at::Tensor>& results) const {
  const auto n_inputs = _input_sizes.size();
  // d(out)/d(column) as (rows, *out_base, *in_base); zero where nothing depends on it.
  const auto block = [&](const VariableSpec& out, std::size_t column, const Shape& in_base) {
    const auto shape = with_rows(state.rows, {&out.base_shape, &in_base});
    const auto it = state.derivatives.find(out.name);
    const bool known =
        it != state.derivatives.end() && column < it->second.size() && it->second[column].defined();
    return known ? it->second[column].reshape(shape) : at::zeros(shape, results.front().options());
  };
  if (op == Operation::param_jacobian)
    for (const auto& [o, p] : _param_jacobian_blocks)
      results.push_back(
          block(_artifact.outputs[o], n_inputs + p, _artifact.parameters[p].base_shape));
  else
    for (const auto& [o, i] : _jacobian_blocks)
      results.push_back(block(_artifact.outputs[o], i, _artifact.inputs[i].base_shape));
}

void SegmentChain::append_tangents(const ChunkArgs& chunk, const State& state,
                                   std::vector<at::Tensor>& results) const {
  const auto n_inputs = _input_sizes.size();
  for (std::size_t o = 0; o < _artifact.outputs.size(); ++o) {
    const auto& out = _artifact.outputs[o];
    at::Tensor sum;
    const auto it = state.derivatives.find(out.name);
    if (it != state.derivatives.end())
      for (std::size_t i = 0; i < n_inputs; ++i)
        if (it->second[i].defined() && chunk.extras[i].defined()) {
          sum = rows_matmul(it->second[i], chunk.extras[i].reshape({state.rows, -1, 1}), sum);
        }
    results.push_back(sum.defined() ? sum.reshape(results[o].sizes()) : at::zeros_like(results[o]));
  }
}

} // namespace neml2::detail
