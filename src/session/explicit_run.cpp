// Running one chunk: a composed model's chain, or an explicit model's graphs (their
// results landing in place on the CPU), their results put in slot order.

#include <optional>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include "graph/landing.hpp"
#include "graph/recycling.hpp"
#include "session/call_protocol.hpp"
#include "session/session_impl.hpp"

namespace neml2 {

using detail::numel;

std::vector<at::Tensor>
detail::CallProtocol::forward_as_given(const Session& s, const std::vector<at::Tensor>& inputs) {
  return s._impl->value_graph.run(inputs);
}

std::vector<at::Tensor> detail::CallProtocol::run(const Session& s, Operation op,
                                                  detail::ChunkArgs& chunk,
                                                  std::span<const detail::Place> places,
                                                  const at::Tensor& newton_factors) {
  const auto& m = *s._impl;
  // The chunk's work goes to the compute device whichever device is current on this thread
  // (put back after); nothing at all on the CPU.
  std::optional<c10::DeviceGuard> on_device;
  if (!m.torch_device.is_cpu())
    on_device.emplace(m.torch_device);
  if (m.chain) {
    // The tensors of an implicit step (its Newton's working set, its graphs' results) are
    // small blocks kept for this thread, as the graphs' intermediates are.
    const detail::Recycling small_blocks;
    return m.chain->run(op, chunk, newton_factors);
  }
  if (places.empty() || !m.torch_device.is_cpu())
    return m.run_explicit(op, chunk);
  // An explicit model's graphs keep nothing past the call, so their results may land in
  // place (a solve's state would outlive the memory it was given).
  detail::Landing landing(places, {&chunk.inputs, &chunk.params, &chunk.extras});
  auto results = m.run_explicit(op, chunk);
  landing.settle(results);
  return results;
}

std::vector<at::Tensor> Session::Impl::run_explicit(Operation op, detail::ChunkArgs& chunk) const {
  const auto& m = *this;
  switch (op) {
  case Operation::forward: {
    auto results = m.run_graph(m.value_graph, chunk);
    m.put_outputs_in_master_order(results);
    return results;
  }
  case Operation::jacobian: {
    auto results = m.run_graph(m.jvp_graph, chunk);
    m.put_outputs_in_master_order(results);
    const auto n_out = m.output_names.size();
    for (std::size_t k = 0; k < m.jacobian_blocks.size(); ++k)
      results[n_out + k] = m.full_block(results[n_out + k], k, chunk.rows);
    return results;
  }
  case Operation::jvp: {
    auto blocks = m.run_graph(m.jvp_graph, chunk);
    m.put_outputs_in_master_order(blocks);
    const auto n_out = m.output_names.size();
    std::vector<at::Tensor> results(2 * n_out);
    for (std::size_t o = 0; o < n_out; ++o)
      results[o] = blocks[o];
    for (std::size_t k = 0; k < m.jacobian_blocks.size(); ++k) {
      const auto [o, i] = m.jacobian_blocks[k];
      const auto& tangent = chunk.extras[i];
      if (!tangent.defined())
        continue;
      // block (R, *sub, *out, *in) . tangent (R, *sub, *in) -> (R, *sub, *out): each
      // sub-batch entry on its own; an output without the sub-batch axes sums over them.
      const auto& pair = m.segment->jacobian_pairs[k];
      const auto sub = numel(pair.in_sub_batch_shape), out = numel(pair.out_base_shape),
                 in = numel(pair.in_base_shape);
      const auto block = m.full_block(blocks[n_out + k], k, chunk.rows);
      auto term = at::matmul(block.reshape({pair.batch_independent ? 1 : chunk.rows, sub, out, in}),
                             tangent.reshape({chunk.rows, sub, in, 1}));
      const auto& output = blocks[o];
      const bool output_has_sub =
          output.dim() > 1 + static_cast<std::int64_t>(pair.out_base_shape.size());
      term = (output_has_sub ? term : term.sum(1)).reshape(output.sizes());
      results[n_out + o] = results[n_out + o].defined() ? results[n_out + o] + term : term;
    }
    for (std::size_t o = 0; o < n_out; ++o)
      if (!results[n_out + o].defined())
        results[n_out + o] = at::zeros_like(blocks[o]);
    return results;
  }
  case Operation::param_jacobian: {
    auto results = m.run_graph(m.value_graph, chunk);
    m.put_outputs_in_master_order(results);
    auto blocks = m.run_graph(m.param_jacobian_graph, chunk);
    results.insert(results.end(), std::make_move_iterator(blocks.begin()),
                   std::make_move_iterator(blocks.end()));
    return results;
  }
  case Operation::param_vjp: {
    auto args = m.graph_args(chunk);
    for (std::size_t c = 0; c < m.vjp_cotangents.size(); ++c) {
      if (chunk.extras[c].defined())
        args.push_back(chunk.extras[c]);
      else {
        auto shape = m.output_base_shapes[m.vjp_cotangents[c]];
        shape.insert(shape.begin(), chunk.rows);
        args.push_back(at::zeros(shape, at::TensorOptions().dtype(m.dtype).device(m.torch_device)));
      }
    }
    return m.call(m.param_vjp_graph, args);
  }
  }
  throw FatalError("internal: unknown operation");
}

std::vector<at::Tensor> Session::Impl::run_graph(const detail::Graph& graph,
                                                 detail::ChunkArgs& chunk) const {
  return graph_takes_inputs_as_is ? call(graph, chunk.inputs) : call(graph, graph_args(chunk));
}

std::vector<at::Tensor> Session::Impl::graph_args(detail::ChunkArgs& chunk) const {
  std::vector<at::Tensor> args;
  args.reserve(graph_inputs.size() + graph_params.size() + vjp_cotangents.size());
  for (auto i : graph_inputs)
    args.push_back(chunk.inputs[i]);
  for (auto i : graph_params)
    args.push_back(chunk.params[i]);
  return args;
}

std::vector<at::Tensor> Session::Impl::call(const detail::Graph& graph,
                                            const std::vector<at::Tensor>& args) {
  return graph.run(args);
}

void Session::Impl::put_outputs_in_master_order(std::vector<at::Tensor>& results) const {
  if (outputs_in_master_order)
    return;
  std::vector<at::Tensor> outputs(output_names.size());
  for (std::size_t i = 0; i < graph_outputs.size(); ++i)
    outputs[graph_outputs[i]] = std::move(results[i]);
  std::move(outputs.begin(), outputs.end(), results.begin());
}

at::Tensor Session::Impl::full_block(const at::Tensor& block, std::size_t k,
                                     std::int64_t rows) const {
  const auto& shape = jacobian_slots[output_names.size() + k].shape;
  if (segment->jacobian_pairs[k].batch_independent)
    return block.select(0, 0).expand(shape);
  if (block.size(0) == rows && block.sizes().slice(1) == c10::IntArrayRef(shape))
    return block;
  auto sizes = shape;
  sizes.insert(sizes.begin(), rows);
  return block.expand(sizes);
}

} // namespace neml2
