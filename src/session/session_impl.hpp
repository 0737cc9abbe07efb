#pragma once

// What a Session holds (Session::Impl), shared by the files that each do one of its jobs:
// loading (loading.cpp), binding a call (binding.cpp), running an explicit model's chunk
// (explicit_run.cpp), results as maps (result_maps.cpp) and the caller's tensors for them
// (destinations.cpp), the named surface (session.cpp).

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Tensor.h>

#include <neml2/session.hpp>

#include "graph/call.hpp"
#include "graph/graph.hpp"
#include "implicit/segment_chain.hpp"

namespace neml2 {

struct Session::Impl {
  std::shared_ptr<const Artifact> artifact;
  Device device;
  c10::Device torch_device = c10::kCPU;
  c10::ScalarType dtype;
  std::size_t runners = 1; // AOTI runners per graph: calls that may run at once
  std::filesystem::path leaf;
  const ForwardSegment* segment = nullptr;     // a single forward segment, called directly
  std::unique_ptr<detail::SegmentChain> chain; // anything else: segments in order, Newton
  detail::Graph value_graph, jvp_graph, param_jacobian_graph, param_vjp_graph;

  // Public names and shapes, master order.
  std::vector<std::string> input_names, output_names;
  std::vector<Shape> input_base_shapes, output_base_shapes, input_trailing_shapes;
  std::vector<Shape> output_shapes; // per row, sub-batch axes included: forward_slots' shapes
  std::map<std::string, Shape> parameter_base_shapes;
  std::map<std::string, std::size_t> input_index, output_index;
  TensorMap parameters;

  // Graph positions, resolved once: where each graph argument / result comes from.
  std::vector<std::size_t> graph_inputs, graph_params, graph_outputs;
  struct BlockPosition {
    std::size_t out, in;
  };
  std::vector<BlockPosition> jacobian_blocks;
  std::vector<std::size_t> vjp_params, vjp_cotangents; // -> parameter / output index

  // How results gather, per operation (param_vjp's depend on the call).
  std::vector<detail::ResultSlot> forward_slots, jvp_slots, jacobian_slots, param_jacobian_slots;

  bool outputs_in_master_order = true;  // the value graph returns outputs in master order
  bool graph_takes_inputs_as_is = true; // no reordering, no parameters

  // Loading (loading.cpp), in steps: the variables' names and shapes and the parameters'
  // values (returns each parameter's position by its name in metadata.json); a composed
  // model's chain, which runs its segments (Jacobian blocks: the `derivatives`); one forward
  // segment's outputs' shapes, its graphs' arguments and results in master positions, and
  // its graphs loaded and checked.
  std::map<std::string, std::size_t> index_variables();
  void make_chain();
  void forward_output_shapes();
  void place_forward_segment(const std::map<std::string, std::size_t>& param_index);
  void load_forward_graphs();

  // Binding (binding.cpp).
  struct Binder;
  // The inputs in input_names() order; a FatalError for a missing or unknown name.
  std::vector<at::Tensor> positional_inputs(const TensorMap& inputs) const;
  // The graphs `op` needs are there (checked before anything else of a call).
  void require_operation(Operation op) const;
  void require(bool has_graph, const char* op, const std::string& fix) const;

  // Running a model without a solve (explicit_run.cpp): `op` on one chunk
  // (CallProtocol::run).
  std::vector<at::Tensor> run_explicit(Operation op, detail::ChunkArgs& chunk) const;
  // Runs a graph that takes the structural inputs then the parameters.
  std::vector<at::Tensor> run_graph(const detail::Graph& graph, detail::ChunkArgs& chunk) const;
  std::vector<at::Tensor> graph_args(detail::ChunkArgs& chunk) const;
  static std::vector<at::Tensor> call(const detail::Graph& graph,
                                      const std::vector<at::Tensor>& args);
  // Value-graph outputs in master order, then the rest of what the graph returned.
  void put_outputs_in_master_order(std::vector<at::Tensor>& results) const;
  // A Jacobian block as the graph returned it (size-1 batch or sub-batch axes where it
  // does not vary) at its full shape: `(rows, *slot)`, or `(*slot)` when batch-independent.
  at::Tensor full_block(const at::Tensor& block, std::size_t k, std::int64_t rows) const;
};

namespace detail {
/// Names for a message: "a, b", or "none" (session.cpp).
[[nodiscard]] std::string names_text(const std::vector<std::string>& names);
} // namespace detail

} // namespace neml2
