// Loading a session: the artifact's names and shapes, where each graph's arguments and
// results come from, and its graphs, each checked against metadata.json.

#include <algorithm>
#include <map>
#include <variant>

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include "core/cpu_lanes.hpp"
#include "core/shape_text.hpp"
#include "session/session_impl.hpp"

namespace neml2 {
namespace {

using detail::Graph;

Shape concat(std::initializer_list<const Shape*> parts) {
  Shape s;
  for (const auto* p : parts)
    s.insert(s.end(), p->begin(), p->end());
  return s;
}

// A bare accelerator family means the current device of that family: pin it now, so that
// inputs on that device are recognized as already in place. The CPU has no index worth
// keeping: "cpu:0" is "cpu", as CPU tensors report it.
c10::Device resolve(const Device& device) {
  auto d = device.torch();
  if (d.is_cpu())
    return c10::kCPU;
  if (d.has_index())
    return d;
  return c10::impl::getDeviceGuardImpl(d.type())->getDevice();
}

// Whether two shapes broadcast (aligned at the right, each pair of sizes equal or one 1).
bool broadcast_together(const Shape& a, const Shape& b) {
  for (auto i = a.rbegin(), j = b.rbegin(); i != a.rend() && j != b.rend(); ++i, ++j)
    if (*i != *j && *i != 1 && *j != 1)
      return false;
  return true;
}

} // namespace

void Session::Impl::make_chain() {
  chain = std::make_unique<detail::SegmentChain>(
      *artifact, torch_device, dtype,
      [this](const std::string& package, const char* listed_as,
             const std::vector<std::optional<Shape>>& arguments, std::size_t results,
             std::vector<Shape>* result_shapes) -> detail::GraphFn {
        if (package.empty())
          return {};
        auto graph =
            std::make_shared<Graph>(leaf, package, torch_device, dtype, runners, listed_as);
        graph->expect(arguments, results);
        graph->probe_one_row(dtype);
        if (result_shapes)
          *result_shapes = graph->result_shapes(dtype);
        return [graph](const std::vector<at::Tensor>& args) { return graph->run(args); };
      });
  output_shapes = chain->output_shapes();
  for (const auto& shape : output_shapes)
    forward_slots.push_back({detail::Gather::rows, shape});
  jvp_slots = forward_slots;
  jvp_slots.insert(jvp_slots.end(), forward_slots.begin(), forward_slots.end());
  jacobian_slots = forward_slots;
  for (const auto& [o, i] : chain->jacobian_blocks()) {
    jacobian_blocks.push_back({o, i});
    jacobian_slots.push_back(
        {detail::Gather::rows, concat({&output_base_shapes[o], &input_base_shapes[i]})});
  }
  param_jacobian_slots = forward_slots;
  for (const auto& [o, p] : chain->param_jacobian_blocks())
    param_jacobian_slots.push_back(
        {detail::Gather::rows,
         concat({&output_base_shapes[o], &artifact->parameters[p].base_shape})});
  vjp_params = chain->param_vjp_params(); // the chain contracts its parameter Jacobian
  for (std::size_t o = 0; o < output_names.size(); ++o)
    vjp_cotangents.push_back(o);
}

Session::Session(std::shared_ptr<const Artifact> artifact, const Device& device,
                 c10::ScalarType dtype, std::size_t concurrency) try
    : _impl(std::make_unique<Impl>()) {
  auto& m = *_impl;
  m.artifact = artifact;
  m.dtype = dtype;
  m.leaf = m.artifact->leaf(device, dtype);
  m.torch_device =
      detail::translate_foreign_errors("selecting the device", [&] { return resolve(device); });
  m.device = Device(m.torch_device);
  // On the CPU, calls from as many threads as the machine runs at once each get a runner
  // (runners share the graph's constants); elsewhere, the chunks kept in flight.
  m.runners = m.device.is_accelerator() ? std::max<std::size_t>(concurrency, 1)
                                        : detail::cpu_runners(concurrency);
  const auto param_index = m.index_variables();
  if (!m.artifact->single_forward()) { // the chain knows its outputs' shapes
    m.make_chain();
    return;
  }
  m.forward_output_shapes();
  m.place_forward_segment(param_index);
  m.load_forward_graphs();
} catch (const Exception&) {
  throw;
} catch (const std::exception& e) { // what the checks above did not foresee, as one of ours
  throw detail::foreign(fmt::format("loading the artifact '{}' for {}",
                                    artifact ? artifact->root.string() : "?", device.str()),
                        e);
}

std::map<std::string, std::size_t> Session::Impl::index_variables() {
  const auto& a = *artifact;
  for (const auto& v : a.inputs) {
    input_index[v.name] = input_names.size();
    input_names.push_back(v.public_name);
    input_base_shapes.push_back(v.base_shape);
    input_trailing_shapes.push_back(concat({&v.sub_batch_shape, &v.base_shape}));
  }
  for (const auto& v : a.outputs) {
    output_index[v.name] = output_names.size();
    output_names.push_back(v.public_name);
    output_base_shapes.push_back(v.base_shape);
  }
  std::map<std::string, std::size_t> param_index;
  for (const auto& p : a.parameters) {
    param_index[p.name] = param_index.size();
    parameter_base_shapes[p.public_name] = p.base_shape;
    const auto values = at::tensor(p.values, at::kDouble).reshape(p.shape);
    parameters[p.public_name] = values.to(torch_device, p.dtype.value_or(dtype));
  }
  return param_index;
}

void Session::Impl::forward_output_shapes() {
  const auto& a = *artifact;
  // One forward segment's outputs carry its inputs' sub-batch axes (metadata.json does not
  // record them there), which must broadcast together.
  for (auto v = a.inputs.begin(); v != a.inputs.end(); ++v)
    for (auto w = a.inputs.begin(); w != v; ++w)
      if (!broadcast_together(w->sub_batch_shape, v->sub_batch_shape))
        throw FatalError(fmt::format(
            "{}/metadata.json: inputs '{}' (sub-batch shape {}) and '{}' (sub-batch shape {}) "
            "do not broadcast together; the file is not what neml2-compile writes: regenerate "
            "the artifact with neml2-compile",
            a.root.string(), w->name, detail::shape_text(w->sub_batch_shape), v->name,
            detail::shape_text(v->sub_batch_shape)));
  std::vector<std::int64_t> sub_batch;
  for (const auto& v : a.inputs)
    sub_batch = at::infer_size(sub_batch, v.sub_batch_shape);
  for (std::size_t o = 0; o < a.outputs.size(); ++o) {
    output_shapes.push_back(concat({&sub_batch, &output_base_shapes[o]}));
    forward_slots.push_back({detail::Gather::rows, output_shapes.back()});
  }
  jvp_slots = forward_slots;
  jvp_slots.insert(jvp_slots.end(), forward_slots.begin(), forward_slots.end());
  jacobian_slots = forward_slots;
}

void Session::Impl::place_forward_segment(const std::map<std::string, std::size_t>& param_index) {
  const auto& a = *artifact;
  segment = &std::get<ForwardSegment>(a.segments.front());
  const auto& seg = *segment;

  const auto position = [&](const std::map<std::string, std::size_t>& index,
                            const std::string& name, const char* what) {
    const auto it = index.find(name);
    if (it == index.end())
      throw FatalError(fmt::format("{}/metadata.json: the segment names {} '{}', which is not "
                                   "declared at the top level; regenerate with neml2-compile",
                                   a.root.string(), what, name));
    return it->second;
  };
  for (const auto& n : seg.inputs)
    graph_inputs.push_back(position(input_index, n, "input"));
  for (const auto& n : seg.param_inputs)
    graph_params.push_back(position(param_index, n, "parameter"));
  for (const auto& n : seg.outputs)
    graph_outputs.push_back(position(output_index, n, "output"));
  const auto is_identity = [](const std::vector<std::size_t>& positions) {
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (positions[i] != i)
        return false;
    return true;
  };
  outputs_in_master_order =
      is_identity(graph_outputs) && graph_outputs.size() == output_names.size();
  graph_takes_inputs_as_is = is_identity(graph_inputs) &&
                             graph_inputs.size() == input_names.size() && graph_params.empty();
  for (const auto& p : seg.jacobian_pairs)
    jacobian_blocks.push_back(
        {position(output_index, p.out, "output"), position(input_index, p.in, "input")});
  for (const auto& n : seg.param_vjp_params)
    vjp_params.push_back(position(param_index, n, "parameter"));
  for (const auto& n : seg.param_vjp_outputs)
    vjp_cotangents.push_back(position(output_index, n, "output"));

  for (const auto& p : seg.jacobian_pairs)
    jacobian_slots.push_back(
        {p.batch_independent ? detail::Gather::shared : detail::Gather::rows,
         concat({&p.in_sub_batch_shape, &p.out_base_shape, &p.in_base_shape})});
  param_jacobian_slots = forward_slots;
  for (const auto& p : seg.param_jacobian_pairs)
    param_jacobian_slots.push_back(
        {detail::Gather::rows, concat({&p.out_base_shape, &p.param_base_shape})});
}

void Session::Impl::load_forward_graphs() {
  const auto& a = *artifact;
  const auto& seg = *segment;
  // Each graph checked against what metadata.json says it takes and returns.
  std::vector<std::optional<Shape>> arguments; // (B, *trailing) each
  const auto batched = [](const Shape& trailing) {
    auto shape = trailing;
    shape.insert(shape.begin(), -1);
    return shape;
  };
  for (auto i : graph_inputs)
    arguments.emplace_back(batched(input_trailing_shapes[i]));
  for (auto p : graph_params)
    arguments.emplace_back(batched(a.parameters[p].base_shape));
  using Result = Graph::Result;
  std::vector<Result> outputs;
  for (auto o : graph_outputs)
    outputs.push_back({forward_slots[o].shape, false});
  const auto load = [&](const std::string& package, const char* listed_as,
                        const std::vector<std::optional<Shape>>& takes,
                        std::vector<Result> results) {
    if (package.empty())
      return Graph{};
    Graph graph(leaf, package, torch_device, dtype, runners, listed_as);
    graph.expect(takes, std::move(results), dtype);
    graph.probe_one_row(dtype);
    return graph;
  };
  value_graph = load(seg.package, "package", arguments, outputs);
  auto jvp_results = outputs;
  for (const auto& p : seg.jacobian_pairs) // blocks that do not vary come back with size 1
    jvp_results.push_back(
        {concat({&p.in_sub_batch_shape, &p.out_base_shape, &p.in_base_shape}), true});
  jvp_graph = load(seg.jvp_package, "jvp_package", arguments, jvp_results);
  std::vector<Result> param_blocks;
  for (const auto& p : seg.param_jacobian_pairs)
    param_blocks.push_back({concat({&p.out_base_shape, &p.param_base_shape}), true});
  param_jacobian_graph =
      load(seg.param_jacobian_package, "param_jacobian_package", arguments, param_blocks);
  auto vjp_arguments = arguments;
  for (auto o : vjp_cotangents)
    vjp_arguments.emplace_back(batched(forward_slots[o].shape));
  std::vector<Result> gradients;
  for (auto p : vjp_params)
    gradients.push_back({a.parameters[p].base_shape, false});
  param_vjp_graph = load(seg.param_vjp_package, "param_vjp_package", vjp_arguments, gradients);
}

} // namespace neml2
