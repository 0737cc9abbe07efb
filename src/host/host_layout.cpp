// A step's results in the host's storage: the layout checked before anything runs, and
// the model's _into calls writing into it (the state's own tensors for what the host did
// not give).

#include <algorithm>
#include <tuple>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/any_dispatched_model.hpp>
#include <neml2/material_state.hpp>

#include "core/row_shape.hpp"
#include "engine/placement.hpp"
#include "host/step_cuts.hpp"

namespace neml2 {
using detail::with_rows;
namespace {

// Whether the k-th block jacobian() returns (Session::jacobian_pairs() order, the graph's)
// comes back without the batch axis: one block for every row, from an explicit model's graph.
bool batch_independent(const Artifact& a, std::size_t k) {
  return a.single_forward() &&
         std::get<ForwardSegment>(a.segments.front()).jacobian_pairs.at(k).batch_independent;
}

} // namespace

void MaterialState::check_layout(const HostLayout& into, const StepOptions& options) const {
  if (!into.derivatives.empty() && !options.derivatives)
    throw FatalError("MaterialState::step(): the host layout takes derivatives, but the step "
                     "computes none; step with derivatives = true");
  std::int64_t rows = step_rows(options);
  if (into.points.defined()) {
    if (into.points.scalar_type() != at::kLong || into.points.dim() != 1)
      throw FatalError(fmt::format("MaterialState::step(): the host layout's points have dtype "
                                   "{} and shape {}; pass 1-d int64 indices",
                                   c10::toString(into.points.scalar_type()), into.points.sizes()));
    rows = into.points.size(0);
    if (rows > 0 && (into.points.min().item<std::int64_t>() < 0 ||
                     into.points.max().item<std::int64_t>() >= _points))
      throw FatalError(fmt::format("MaterialState::step(): the host layout's points run from {} "
                                   "to {}; this state has points 0 to {}",
                                   into.points.min().item<std::int64_t>(),
                                   into.points.max().item<std::int64_t>(), _points - 1));
  }
  // The name, its tensor and the shape it must have.
  std::vector<std::tuple<std::string, at::Tensor, Shape>> given;
  for (const auto& [y, t] : into.outputs) {
    if (!_output_shapes.count(y))
      throw FatalError(fmt::format("MaterialState::step(): the host layout names output '{}', "
                                   "which this model does not have; it has {}",
                                   y, _model->output_names()));
    given.emplace_back(fmt::format("output '{}'", y), t, with_rows(rows, {&_output_shapes.at(y)}));
  }
  for (const auto& [y, blocks] : into.derivatives)
    for (const auto& [z, t] : blocks) {
      if (std::find(_pairs.begin(), _pairs.end(), std::pair{y, z}) == _pairs.end())
        throw FatalError(fmt::format("MaterialState::step(): the host layout names the block "
                                     "d({})/d({}), which the artifact does not have",
                                     y, z));
      auto shape = with_rows(rows, {&_output_shapes.at(y)});
      const auto& in = _input_shapes.at(z);
      shape.insert(shape.end(), in.begin(), in.end());
      given.emplace_back(fmt::format("block d({})/d({})", y, z), t, std::move(shape));
    }
  for (auto it = given.begin(); it != given.end(); ++it) {
    const auto& [label, t, shape] = *it;
    if (!t.defined() || t.sizes() != at::IntArrayRef(shape) || t.scalar_type() != _model->dtype())
      throw FatalError(fmt::format(
          "MaterialState::step(): the host layout's {} is {}; pass a {} tensor of shape {} "
          "(any strides, on any device)",
          label,
          t.defined() ? fmt::format("{} of shape {}", c10::toString(t.scalar_type()), t.sizes())
                      : std::string("undefined"),
          c10::toString(_model->dtype()), shape));
    detail::check_destination(t, "MaterialState::step(): the host layout's " + label);
    for (auto other = given.begin(); other != it; ++other)
      if (detail::share_memory(t, std::get<1>(*other)))
        throw FatalError(fmt::format("MaterialState::step(): the host layout's {} and {} share "
                                     "memory: one would overwrite the other; pass destinations "
                                     "that do not overlap",
                                     std::get<0>(*other), label));
    for (const auto& kept : {&_start, &_forces})
      for (const auto& [name, value] : *kept)
        if (detail::share_memory(t, value))
          throw FatalError(fmt::format("MaterialState::step(): the host layout's {} shares "
                                       "memory with the state's own '{}'; pass storage of the "
                                       "host's",
                                       label, name));
  }
}

detail::PointsEvaluation MaterialState::evaluate_into(const TensorMap& inputs,
                                                      const StepOptions& options,
                                                      NewtonFactors* factors) const {
  const auto& into = options.into;
  detail::PointsEvaluation e;
  for (const auto& [y, shape] : _output_shapes) {
    const auto it = into.outputs.find(y);
    e.outputs.emplace(y, it != into.outputs.end()
                             ? it->second
                             : at::empty(with_rows(step_rows(options), {&shape}), _options));
  }
  // A batch-independent block lands in one (out, in) tensor, then spreads over the host's rows.
  std::vector<std::pair<at::Tensor, at::Tensor>> spread;
  if (options.derivatives)
    for (std::size_t k = 0; k < _pairs.size(); ++k) {
      const auto& [y, z] = _pairs[k];
      auto shape = _output_shapes.at(y);
      shape.insert(shape.end(), _input_shapes.at(z).begin(), _input_shapes.at(z).end());
      at::Tensor host;
      if (const auto b = into.derivatives.find(y); b != into.derivatives.end())
        if (const auto t = b->second.find(z); t != b->second.end())
          host = t->second;
      if (batch_independent(_model->artifact(), k)) {
        auto one = at::empty(shape, _options);
        spread.emplace_back(one, host);
        e.derivatives[y][z] = one;
      } else
        e.derivatives[y][z] =
            host.defined() ? host : at::empty(with_rows(step_rows(options), {&shape}), _options);
    }
  try {
    if (factors)
      options.derivatives ? _model->jacobian_into(inputs, e.outputs, e.derivatives, *factors)
                          : _model->forward_into(inputs, e.outputs, *factors);
    else
      options.derivatives ? _model->jacobian_into(inputs, e.outputs, e.derivatives)
                          : _model->forward_into(inputs, e.outputs);
    detail::flag_failures(*_model, e, nullptr);
  } catch (const ConvergenceError& error) {
    if (!error.per_row())
      throw;
    detail::flag_failures(*_model, e, &error);
  }
  for (auto& [one, host] : spread) {
    const auto one_shape = one.sizes().vec();
    for (auto& [y, blocks] : e.derivatives)
      for (auto& [z, block] : blocks)
        if (block.is_same(one))
          block = host.defined() ? host : one.expand(with_rows(step_rows(options), {&one_shape}));
    if (host.defined())
      host.copy_(one.expand_as(host));
  }
  return e;
}

} // namespace neml2
