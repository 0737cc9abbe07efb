// One device's compiled graphs: loading them, checking calls, and calling them.

#include <algorithm>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/session.hpp>

#include "core/device_sync.hpp"
#include "core/shape_text.hpp"
#include "graph/graph.hpp"
#include "graph/landing.hpp"
#include "implicit/segment_chain.hpp"
#include "session/call_protocol.hpp"
#include "session/result_memory.hpp"

namespace fs = std::filesystem;

namespace neml2 {
namespace {

using detail::Graph;
using detail::numel;

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

struct Session::Impl {
  std::shared_ptr<const Artifact> artifact;
  Device device;
  c10::Device torch_device = c10::kCPU;
  c10::ScalarType dtype;
  std::size_t runners = 1; // AOTI runners per graph: calls that may run at once
  fs::path leaf;
  const ForwardSegment* segment = nullptr;     // a single forward segment, called directly
  std::unique_ptr<detail::SegmentChain> chain; // anything else: segments in order, Newton
  Graph value_graph, jvp_graph, param_jacobian_graph, param_vjp_graph;

  // Public names and shapes, master order.
  std::vector<std::string> input_names, output_names;
  std::vector<Shape> input_base_shapes, output_base_shapes, input_trailing_shapes;
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

  // Runs `op` of a model without a solve (CallProtocol::run).
  std::vector<at::Tensor> run_explicit(Operation op, detail::ChunkArgs& chunk) const;

  // Runs a graph that takes the structural inputs then the parameters.
  std::vector<at::Tensor> run_graph(const Graph& graph, detail::ChunkArgs& chunk) const {
    return graph_takes_inputs_as_is ? call(graph, chunk.inputs) : call(graph, graph_args(chunk));
  }

  std::vector<at::Tensor> graph_args(detail::ChunkArgs& chunk) const {
    std::vector<at::Tensor> args;
    args.reserve(graph_inputs.size() + graph_params.size() + vjp_cotangents.size());
    for (auto i : graph_inputs)
      args.push_back(chunk.inputs[i]);
    for (auto i : graph_params)
      args.push_back(chunk.params[i]);
    return args;
  }

  static std::vector<at::Tensor> call(const Graph& graph, const std::vector<at::Tensor>& args) {
    return graph.run(args);
  }

  // Value-graph outputs in master order, then the rest of what the graph returned.
  void put_outputs_in_master_order(std::vector<at::Tensor>& results) const {
    if (outputs_in_master_order)
      return;
    std::vector<at::Tensor> outputs(output_names.size());
    for (std::size_t i = 0; i < graph_outputs.size(); ++i)
      outputs[graph_outputs[i]] = std::move(results[i]);
    std::move(outputs.begin(), outputs.end(), results.begin());
  }

  struct Binder;

  // The inputs in input_names() order; a FatalError for a missing or unknown name.
  std::vector<at::Tensor> positional_inputs(const TensorMap& inputs) const;

  // A Jacobian block as the graph returned it (size-1 batch or sub-batch axes where it
  // does not vary) at its full shape: `(rows, *slot)`, or `(*slot)` when batch-independent.
  at::Tensor full_block(const at::Tensor& block, std::size_t k, std::int64_t rows) const {
    const auto& shape = jacobian_slots[output_names.size() + k].shape;
    if (segment->jacobian_pairs[k].batch_independent)
      return block.select(0, 0).expand(shape);
    if (block.size(0) == rows && block.sizes().slice(1) == c10::IntArrayRef(shape))
      return block;
    auto sizes = shape;
    sizes.insert(sizes.begin(), rows);
    return block.expand(sizes);
  }

  // A composed model: the chain runs its segments; Jacobian blocks are the `derivatives`.
  void make_chain() {
    chain = std::make_unique<detail::SegmentChain>(
        *artifact,
        [this](const std::string& package, const char* listed_as,
               const std::vector<std::optional<Shape>>& arguments,
               std::size_t results) -> detail::GraphFn {
          if (package.empty())
            return {};
          auto graph =
              std::make_shared<Graph>(leaf, package, torch_device, dtype, runners, listed_as);
          graph->expect(arguments, results);
          return [graph](const std::vector<at::Tensor>& args) { return graph->run(args); };
        });
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

  // The graphs `op` needs are there (checked before anything else of a call).
  void require_operation(Operation op) const {
    switch (op) {
    case Operation::jvp:
    case Operation::jacobian:
      require(chain ? chain->has_input_derivatives() : bool(jvp_graph),
              op == Operation::jvp ? "jvp" : "jacobian", "-d OUT:IN (or -d : for every pair)");
      break;
    case Operation::param_jacobian:
      require(chain ? chain->has_param_derivatives() : bool(param_jacobian_graph), "param_jacobian",
              "-p PARAM -d OUT:PARAM (and -d : for the chain through segments)");
      break;
    case Operation::param_vjp:
      require(chain ? chain->has_param_derivatives() : bool(param_vjp_graph), "param_vjp",
              "-p PARAM -d OUT:PARAM");
      break;
    case Operation::forward:
      break;
    }
  }

  void require(bool has_graph, const char* op, const std::string& fix) const {
    if (!has_graph)
      throw FatalError(fmt::format("{}(): artifact '{}' was compiled without the graphs it "
                                   "needs; recompile with neml2-compile ... {}",
                                   op, artifact->root.string(), fix));
  }
};

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
  m.runners = std::max<std::size_t>(
      {concurrency, 1, m.device.is_accelerator() ? 1 : std::thread::hardware_concurrency()});
  const auto& a = *m.artifact;

  for (const auto& v : a.inputs) {
    m.input_index[v.name] = m.input_names.size();
    m.input_names.push_back(v.public_name);
    m.input_base_shapes.push_back(v.base_shape);
    m.input_trailing_shapes.push_back(concat({&v.sub_batch_shape, &v.base_shape}));
  }
  for (const auto& v : a.outputs) {
    m.output_index[v.name] = m.output_names.size();
    m.output_names.push_back(v.public_name);
    m.output_base_shapes.push_back(v.base_shape);
  }
  std::map<std::string, std::size_t> param_index;
  for (const auto& p : a.parameters) {
    param_index[p.name] = param_index.size();
    m.parameter_base_shapes[p.public_name] = p.base_shape;
    const auto values = at::tensor(p.values, at::kDouble).reshape(p.shape);
    m.parameters[p.public_name] = values.to(m.torch_device, p.dtype.value_or(dtype));
  }

  // Outputs carry the inputs' sub-batch axes (metadata.json does not record them there),
  // which must broadcast together.
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
  for (const auto& s : m.output_base_shapes)
    m.forward_slots.push_back({detail::Gather::rows, concat({&sub_batch, &s})});
  m.jvp_slots = m.forward_slots;
  m.jvp_slots.insert(m.jvp_slots.end(), m.forward_slots.begin(), m.forward_slots.end());
  m.jacobian_slots = m.forward_slots;
  if (!a.single_forward()) {
    m.make_chain();
    return;
  }
  m.segment = &std::get<ForwardSegment>(a.segments.front());
  const auto& seg = *m.segment;

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
    m.graph_inputs.push_back(position(m.input_index, n, "input"));
  for (const auto& n : seg.param_inputs)
    m.graph_params.push_back(position(param_index, n, "parameter"));
  for (const auto& n : seg.outputs)
    m.graph_outputs.push_back(position(m.output_index, n, "output"));
  const auto is_identity = [](const std::vector<std::size_t>& positions) {
    for (std::size_t i = 0; i < positions.size(); ++i)
      if (positions[i] != i)
        return false;
    return true;
  };
  m.outputs_in_master_order =
      is_identity(m.graph_outputs) && m.graph_outputs.size() == m.output_names.size();
  m.graph_takes_inputs_as_is = is_identity(m.graph_inputs) &&
                               m.graph_inputs.size() == m.input_names.size() &&
                               m.graph_params.empty();
  for (const auto& p : seg.jacobian_pairs)
    m.jacobian_blocks.push_back(
        {position(m.output_index, p.out, "output"), position(m.input_index, p.in, "input")});
  for (const auto& n : seg.param_vjp_params)
    m.vjp_params.push_back(position(param_index, n, "parameter"));
  for (const auto& n : seg.param_vjp_outputs)
    m.vjp_cotangents.push_back(position(m.output_index, n, "output"));

  for (const auto& p : seg.jacobian_pairs)
    m.jacobian_slots.push_back(
        {p.batch_independent ? detail::Gather::shared : detail::Gather::rows,
         concat({&p.in_sub_batch_shape, &p.out_base_shape, &p.in_base_shape})});
  m.param_jacobian_slots = m.forward_slots;
  for (const auto& p : seg.param_jacobian_pairs)
    m.param_jacobian_slots.push_back(
        {detail::Gather::rows, concat({&p.out_base_shape, &p.param_base_shape})});

  // Each graph checked against what metadata.json says it takes and returns.
  std::vector<std::optional<Shape>> arguments; // (B, *trailing) each
  const auto batched = [](const Shape& trailing) {
    auto shape = trailing;
    shape.insert(shape.begin(), -1);
    return shape;
  };
  for (auto i : m.graph_inputs)
    arguments.emplace_back(batched(m.input_trailing_shapes[i]));
  for (auto p : m.graph_params)
    arguments.emplace_back(batched(a.parameters[p].base_shape));
  using Result = Graph::Result;
  std::vector<Result> outputs;
  for (auto o : m.graph_outputs)
    outputs.push_back({m.forward_slots[o].shape, false});
  const auto load = [&](const std::string& package, const char* listed_as,
                        const std::vector<std::optional<Shape>>& takes,
                        std::vector<Result> results) {
    if (package.empty())
      return Graph{};
    Graph graph(m.leaf, package, m.torch_device, dtype, m.runners, listed_as);
    graph.expect(takes, std::move(results), dtype);
    return graph;
  };
  m.value_graph = load(seg.package, "package", arguments, outputs);
  auto jvp_results = outputs;
  for (const auto& p : seg.jacobian_pairs) // blocks that do not vary come back with size 1
    jvp_results.push_back(
        {concat({&p.in_sub_batch_shape, &p.out_base_shape, &p.in_base_shape}), true});
  m.jvp_graph = load(seg.jvp_package, "jvp_package", arguments, jvp_results);
  std::vector<Result> param_blocks;
  for (const auto& p : seg.param_jacobian_pairs)
    param_blocks.push_back({concat({&p.out_base_shape, &p.param_base_shape}), true});
  m.param_jacobian_graph =
      load(seg.param_jacobian_package, "param_jacobian_package", arguments, param_blocks);
  auto vjp_arguments = arguments;
  for (auto o : m.vjp_cotangents)
    vjp_arguments.emplace_back(batched(m.forward_slots[o].shape));
  std::vector<Result> gradients;
  for (auto p : m.vjp_params)
    gradients.push_back({a.parameters[p].base_shape, false});
  m.param_vjp_graph = load(seg.param_vjp_package, "param_vjp_package", vjp_arguments, gradients);
} catch (const Exception&) {
  throw;
} catch (const std::exception& e) { // what the checks above did not foresee, as one of ours
  throw detail::foreign(fmt::format("loading the artifact '{}' for {}",
                                    artifact ? artifact->root.string() : "?", device.str()),
                        e);
}

Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

// ------------------------------------------------------------------ binding a call

struct Session::Impl::Binder {
  const Session::Impl& m;
  std::optional<c10::Device> required_device;
  detail::BoundCall& call;
  const std::string* first = nullptr; // the tensor that fixed the device
  c10::SmallVector<std::pair<const std::string*, std::int64_t>, 8> batch_sizes;

  // Checks one tensor against `(B, *trailing)` / `(*trailing)` and gives an unbatched one
  // a leading axis of 1; returns whether it had a batch axis.
  bool check(const std::string& what, const std::string& name, at::Tensor& t, const Shape& trailing,
             c10::ScalarType dtype, bool on_input_device) {
    const auto expected = [&] {
      return fmt::format("(B, {0}) or ({0})", fmt::join(trailing, ", "));
    };
    if (!t.defined())
      throw FatalError(
          fmt::format("{} '{}' is an undefined tensor; expected shape {}", what, name, expected()));
    if (t.scalar_type() != dtype)
      throw FatalError(fmt::format("{} '{}' has dtype {}, but the artifact at '{}' runs {}: "
                                   "convert it with .to({})",
                                   what, name, c10::toString(t.scalar_type()), m.leaf.string(),
                                   c10::toString(dtype), c10::toString(dtype)));
    if (t.is_meta())
      throw FatalError(fmt::format("{} '{}' is on meta, a device that holds no data: pass a "
                                   "tensor with values, on cpu or an accelerator",
                                   what, name));
    if (on_input_device) {
      if (required_device && t.device() != *required_device)
        throw FatalError(fmt::format("{} '{}' is on {}, but this session runs on {}: move it "
                                     "with .to(\"{}\") or use a DispatchedModel",
                                     what, name, t.device().str(), required_device->str(),
                                     required_device->str()));
      if (!first) {
        first = &name;
        call.device = t.device();
      } else if (t.device() != call.device)
        throw FatalError(fmt::format("{} '{}' is on {} but '{}' is on {}: all inputs of a call "
                                     "must be on one device",
                                     what, name, t.device().str(), *first, call.device.str()));
    }
    const auto sizes = t.sizes();
    const auto rank = static_cast<std::int64_t>(trailing.size());
    const bool batched = t.dim() == rank + 1;
    if ((t.dim() != rank && !batched) ||
        !std::equal(trailing.begin(), trailing.end(), sizes.end() - rank))
      throw FatalError(fmt::format("{} '{}' has shape {}; expected {}: one leading batch axis "
                                   "(flatten several with reshape) or none",
                                   what, name, detail::shape_text(sizes), expected()));
    if (!batched)
      t = t.unsqueeze(0);
    else if (t.size(0) != 1)
      batch_sizes.emplace_back(&name, t.size(0));
    call.batched = call.batched || batched;
    return batched;
  }

  void settle_batch() {
    call.batch = batch_sizes.empty() ? 1 : 0;
    for (const auto& [name, size] : batch_sizes)
      call.batch = std::max(call.batch, size);
    for (const auto& [name, size] : batch_sizes)
      if (size != call.batch) {
        std::vector<std::string> all;
        for (const auto& [n, s] : batch_sizes)
          all.push_back(fmt::format("'{}' has {}", *n, s));
        throw FatalError(fmt::format("batch sizes do not agree ({}); give every batched tensor "
                                     "the same leading size, or 1 to broadcast",
                                     fmt::join(all, ", ")));
      }
  }
};

namespace {

std::string names_text(const std::vector<std::string>& names) {
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

void reject_unknown(const TensorMap& given, const std::vector<std::string>& public_names,
                    const char* what) {
  for (const auto& [name, t] : given)
    if (std::find(public_names.begin(), public_names.end(), name) == public_names.end())
      throw FatalError(fmt::format("unknown {} '{}'; this model takes: {}", what, name,
                                   names_text(public_names)));
}

} // namespace

std::vector<at::Tensor> Session::Impl::positional_inputs(const TensorMap& inputs) const {
  const auto& m = *this;
  if (inputs.size() > m.input_names.size()) // else every name found means none is unknown
    reject_unknown(inputs, m.input_names, "input");
  std::vector<at::Tensor> positional(m.input_names.size());
  for (std::size_t i = 0; i < m.input_names.size(); ++i) {
    const auto it = inputs.find(m.input_names[i]);
    if (it == inputs.end()) {
      reject_unknown(inputs, m.input_names, "input"); // a misspelt name says more
      throw FatalError(fmt::format("missing input '{}' (expected shape (B, {}) or ({})); this "
                                   "model takes: {}",
                                   m.input_names[i], fmt::join(m.input_trailing_shapes[i], ", "),
                                   fmt::join(m.input_trailing_shapes[i], ", "),
                                   names_text(m.input_names)));
    }
    positional[i] = it->second;
  }
  return positional;
}

detail::BoundCall detail::CallProtocol::bind(const Session& s, Operation op,
                                             const TensorMap& inputs, const TensorMap& extras,
                                             const TensorMap& params,
                                             std::optional<c10::Device> required_device) {
  return bind(s, op, s._impl->positional_inputs(inputs), extras, params, required_device);
}

detail::BoundCall detail::CallProtocol::bind(const Session& s, Operation op,
                                             std::vector<at::Tensor> inputs,
                                             const TensorMap& extras, const TensorMap& params,
                                             std::optional<c10::Device> required_device) {
  const auto& m = *s._impl;
  m.require_operation(op);
  detail::BoundCall call;
  Session::Impl::Binder b{m, required_device, call, nullptr, {}};
  if (inputs.size() != m.input_names.size())
    throw FatalError(fmt::format("{} input tensors given, but this model takes {}, in this "
                                 "order: {}",
                                 inputs.size(), m.input_names.size(), names_text(m.input_names)));
  call.inputs = std::move(inputs);
  for (std::size_t i = 0; i < m.input_names.size(); ++i)
    b.check("input", m.input_names[i], call.inputs[i], m.input_trailing_shapes[i], m.dtype, true);

  const auto& specs = m.artifact->parameters;
  call.params.resize(specs.size());
  c10::SmallVector<bool, 8> params_batched(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto it = params.find(specs[i].public_name);
    if (it == params.end())
      throw FatalError(fmt::format("promoted parameter '{}' was removed from "
                                   "named_parameters(); put it back or use set_parameter()",
                                   specs[i].public_name));
    call.params[i] = it->second;
    params_batched[i] = b.check("parameter", specs[i].public_name, call.params[i],
                                specs[i].base_shape, specs[i].dtype.value_or(m.dtype), false);
    if (m.chain && params_batched[i] && m.chain->solves_with_parameter(i))
      throw FatalError(fmt::format("parameter '{}' has one value per row, but an implicit "
                                   "segment of '{}' takes it as one value for every row; give it "
                                   "shape ({}) or load an artifact where it stays outside the "
                                   "solve",
                                   specs[i].public_name, m.artifact->root.string(),
                                   fmt::join(specs[i].base_shape, ", ")));
  }
  if (params.size() != specs.size())
    for (const auto& [name, t] : params)
      if (!m.parameter_base_shapes.count(name))
        throw FatalError(fmt::format("named_parameters() has '{}', which is not a promoted "
                                     "parameter of this artifact; remove it, or compile with "
                                     "neml2-compile -p {} to make it one",
                                     name, name));

  if (op == Operation::jvp) {
    reject_unknown(extras, m.input_names, "tangent (tangents are keyed by input)");
    call.extras.resize(m.input_names.size());
    for (std::size_t i = 0; i < m.input_names.size(); ++i)
      if (const auto it = extras.find(m.input_names[i]); it != extras.end()) {
        call.extras[i] = it->second;
        b.check("tangent", m.input_names[i], call.extras[i], m.input_trailing_shapes[i], m.dtype,
                true);
      }
  } else if (op == Operation::param_vjp) {
    std::vector<std::string> covered;
    for (auto o : m.vjp_cotangents)
      covered.push_back(m.output_names[o]);
    for (const auto& [name, t] : extras)
      if (std::find(covered.begin(), covered.end(), name) == covered.end())
        throw FatalError(fmt::format("cotangent '{}' is not an output the param_vjp graph was "
                                     "compiled for ({}); recompile with -d {}:PARAM",
                                     name, names_text(covered), name));
    call.extras.resize(covered.size());
    for (std::size_t i = 0; i < covered.size(); ++i)
      if (const auto it = extras.find(covered[i]); it != extras.end()) {
        call.extras[i] = it->second;
        b.check("cotangent", covered[i], call.extras[i], m.output_base_shapes[m.vjp_cotangents[i]],
                m.dtype, true);
      }
  } else if (!extras.empty())
    throw FatalError("extra tensors given to an operation that takes none (only jvp takes "
                     "tangents, only param_vjp cotangents): pass an empty map");

  b.settle_batch();

  switch (op) {
  case Operation::forward:
    call.shared_slots = &m.forward_slots;
    break;
  case Operation::jvp:
    call.shared_slots = &m.jvp_slots;
    break;
  case Operation::jacobian:
    call.shared_slots = &m.jacobian_slots;
    break;
  case Operation::param_jacobian:
    call.shared_slots = &m.param_jacobian_slots;
    break;
  case Operation::param_vjp:
    for (auto p : m.vjp_params)
      call.own_slots.push_back(
          {params_batched[p] ? detail::Gather::rows : detail::Gather::sum, specs[p].base_shape});
    break;
  }
  return call;
}

std::vector<at::Tensor> detail::CallProtocol::positional(const Session& s,
                                                         const TensorMap& inputs) {
  return s._impl->positional_inputs(inputs);
}

std::int64_t detail::CallProtocol::batch_as_given(const Session& s,
                                                  const std::vector<at::Tensor>& inputs) {
  const auto& m = *s._impl;
  if (m.chain || !m.graph_takes_inputs_as_is || !m.outputs_in_master_order ||
      !m.torch_device.is_cpu() || inputs.size() != m.input_names.size() ||
      !m.artifact->parameters.empty() || !m.value_graph)
    return 0;
  std::int64_t batch = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    const auto& base = m.input_trailing_shapes[i];
    if (!t.defined() || t.scalar_type() != m.dtype || !t.is_cpu() ||
        t.dim() != static_cast<std::int64_t>(base.size()) + 1 || !t.is_contiguous())
      return 0;
    const auto sizes = t.sizes();
    if (!std::equal(base.begin(), base.end(), sizes.begin() + 1) || sizes[0] < 1 ||
        (batch != 0 && sizes[0] != batch))
      return 0;
    batch = sizes[0];
  }
  return batch;
}

std::vector<at::Tensor>
detail::CallProtocol::forward_as_given(const Session& s, const std::vector<at::Tensor>& inputs) {
  return s._impl->value_graph.run(inputs);
}

// ------------------------------------------------------------------ running a chunk

std::vector<at::Tensor> detail::CallProtocol::run(const Session& s, Operation op,
                                                  detail::ChunkArgs& chunk,
                                                  std::span<const detail::Place> places) {
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
    return m.chain->run(op, chunk);
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

// ------------------------------------------------------------------ results as maps

TensorMap detail::CallProtocol::forward_result(const Session& s,
                                               std::vector<at::Tensor>&& results) {
  TensorMap out;
  for (std::size_t o = 0; o < s._impl->output_names.size(); ++o)
    out.emplace(s._impl->output_names[o], std::move(results[o]));
  return out;
}

std::pair<TensorMap, TensorMap>
detail::CallProtocol::jvp_result(const Session& s, std::vector<at::Tensor>&& results) {
  const auto n_out = s._impl->output_names.size();
  TensorMap tangents;
  for (std::size_t o = 0; o < n_out; ++o)
    tangents.emplace(s._impl->output_names[o], std::move(results[n_out + o]));
  return {forward_result(s, std::move(results)), std::move(tangents)};
}

std::pair<TensorMap, VariablePairJacobian>
detail::CallProtocol::jacobian_result(const Session& s, std::vector<at::Tensor>&& results) {
  const auto& m = *s._impl;
  const auto n_out = m.output_names.size();
  VariablePairJacobian J;
  for (std::size_t k = 0; k < m.jacobian_blocks.size(); ++k)
    J[m.output_names[m.jacobian_blocks[k].out]][m.input_names[m.jacobian_blocks[k].in]] =
        std::move(results[n_out + k]);
  return {forward_result(s, std::move(results)), std::move(J)};
}

std::pair<TensorMap, VariablePairJacobian>
detail::CallProtocol::param_jacobian_result(const Session& s, std::vector<at::Tensor>&& results) {
  const auto& m = *s._impl;
  const auto n_out = m.output_names.size();
  std::map<std::string, std::string> public_param;
  for (const auto& p : m.artifact->parameters)
    public_param[p.name] = p.public_name;
  VariablePairJacobian P;
  if (m.chain) {
    const auto& blocks = m.chain->param_jacobian_blocks();
    for (std::size_t k = 0; k < blocks.size(); ++k)
      P[m.output_names[blocks[k].first]][m.artifact->parameters[blocks[k].second].public_name] =
          std::move(results[n_out + k]);
    return {forward_result(s, std::move(results)), std::move(P)};
  }
  const auto& pairs = m.segment->param_jacobian_pairs;
  for (std::size_t k = 0; k < pairs.size(); ++k)
    P[m.output_names[m.output_index.at(pairs[k].out)]][public_param.at(pairs[k].param)] =
        std::move(results[n_out + k]);
  return {forward_result(s, std::move(results)), std::move(P)};
}

TensorMap detail::CallProtocol::param_vjp_result(const Session& s,
                                                 std::vector<at::Tensor>&& results) {
  TensorMap grads;
  for (std::size_t k = 0; k < s._impl->vjp_params.size(); ++k)
    grads.emplace(s._impl->artifact->parameters[s._impl->vjp_params[k]].public_name,
                  std::move(results[k]));
  return grads;
}

// ------------------------------------------------------------------ results into the caller's
// tensors

namespace {
// Takes the tensors of `given` in `names` order, refusing a missing or an unknown name.
void take_named(const TensorMap& given, const std::vector<std::string>& names, const char* what,
                const std::string& label_format, detail::Destinations& into) {
  for (const auto& [name, t] : given)
    if (std::find(names.begin(), names.end(), name) == names.end())
      throw FatalError(fmt::format("{} '{}' is not a result of this call; it has: {}", what, name,
                                   names_text(names)));
  for (const auto& name : names) {
    const auto it = given.find(name);
    if (it == given.end())
      throw FatalError(fmt::format("no tensor given for {} '{}': pass one for every result ({})",
                                   what, name, names_text(names)));
    into.tensors.push_back(it->second);
    into.labels.push_back(fmt::format(fmt::runtime(label_format), name));
  }
}
} // namespace

detail::Destinations detail::CallProtocol::destinations(const Session& s, Operation op,
                                                        const TensorMap& values,
                                                        const TensorMap& tangents,
                                                        const VariablePairJacobian& blocks) {
  const auto& m = *s._impl;
  m.require_operation(op);
  detail::Destinations into;
  if (op == Operation::param_vjp) {
    std::vector<std::string> grads;
    for (auto p : m.vjp_params)
      grads.push_back(m.artifact->parameters[p].public_name);
    take_named(values, grads, "gradient", "gradient '{}'", into);
    return into;
  }
  take_named(values, m.output_names, "output", "output '{}'", into);
  if (op == Operation::jvp)
    take_named(tangents, m.output_names, "output tangent", "tangent of output '{}'", into);
  // Blocks keyed [output][input or parameter], in the graph's pair order.
  std::vector<std::pair<std::string, std::string>> pairs;
  if (op == Operation::jacobian)
    for (const auto& b : m.jacobian_blocks)
      pairs.emplace_back(m.output_names[b.out], m.input_names[b.in]);
  if (op == Operation::param_jacobian && m.chain)
    for (const auto& [o, p] : m.chain->param_jacobian_blocks())
      pairs.emplace_back(m.output_names[o], m.artifact->parameters[p].public_name);
  else if (op == Operation::param_jacobian) {
    std::map<std::string, std::string> public_param;
    for (const auto& p : m.artifact->parameters)
      public_param[p.name] = p.public_name;
    for (const auto& p : m.segment->param_jacobian_pairs)
      pairs.emplace_back(m.output_names[m.output_index.at(p.out)], public_param.at(p.param));
  }
  std::size_t given = 0;
  for (const auto& [out, row] : blocks)
    given += row.size();
  for (const auto& [out, in] : pairs) {
    const auto row = blocks.find(out);
    if (row == blocks.end() || !row->second.count(in))
      throw FatalError(fmt::format("no tensor given for the block ['{}']['{}']: pass one for "
                                   "every block the artifact has",
                                   out, in));
    into.tensors.push_back(row->second.at(in));
    into.labels.push_back(fmt::format("block ['{}']['{}']", out, in));
  }
  if (given != pairs.size())
    throw FatalError(fmt::format("{} blocks given, but this call has {}: pass exactly the blocks "
                                 "the artifact has (see jacobian() / param_jacobian())",
                                 given, pairs.size()));
  return into;
}

// ------------------------------------------------------------------ the named surface

std::vector<at::Tensor> Session::run_whole(Operation op, const TensorMap& inputs,
                                           const TensorMap& extras) const {
  return detail::translate_foreign_errors("neml2::Session", [&] {
    using Access = detail::CallProtocol;
    auto call = Access::bind(*this, op, inputs, extras, _impl->parameters, _impl->torch_device);
    if (call.batch == 0)
      return detail::empty_results(call, _impl->dtype);
    detail::ChunkArgs chunk;
    detail::take_all(call, _impl->torch_device, chunk);
    try {
      return detail::finish_whole(call, Access::run(*this, op, chunk));
    } catch (const ConvergenceError& e) {
      if (!e.per_row())
        throw;
      auto results = detail::finish_whole(call, e.results());
      auto outputs = Access::forward_result(
          *this, std::vector<at::Tensor>(results.begin(),
                                         results.begin() +
                                             static_cast<std::ptrdiff_t>(output_names().size())));
      throw ConvergenceError(e.what(), e.converged_mask(), e.worst_residual(), std::move(results),
                             std::move(outputs));
    }
  });
}

const SolverConfig& Session::solver_config() const {
  if (!_impl->chain || !_impl->artifact->solver_config)
    throw FatalError(fmt::format("solver_config(): artifact '{}' has no implicit segment, so "
                                 "no Newton solve to configure",
                                 _impl->artifact->root.string()));
  return _impl->chain->solver_config();
}

void Session::set_solver_config(const SolverConfig& config) {
  static_cast<void>(solver_config()); // the same error for a model without a solve
  _impl->chain->set_solver_config(config);
}

TensorMap Session::forward(const TensorMap& inputs) const {
  return detail::CallProtocol::forward_result(*this, run_whole(Operation::forward, inputs, {}));
}

std::pair<TensorMap, TensorMap> Session::jvp(const TensorMap& inputs,
                                             const TensorMap& tangents) const {
  return detail::CallProtocol::jvp_result(*this, run_whole(Operation::jvp, inputs, tangents));
}

std::pair<TensorMap, VariablePairJacobian> Session::jacobian(const TensorMap& inputs) const {
  return detail::CallProtocol::jacobian_result(*this, run_whole(Operation::jacobian, inputs, {}));
}

std::pair<TensorMap, VariablePairJacobian> Session::param_jacobian(const TensorMap& inputs) const {
  return detail::CallProtocol::param_jacobian_result(
      *this, run_whole(Operation::param_jacobian, inputs, {}));
}

TensorMap Session::param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const {
  return detail::CallProtocol::param_vjp_result(
      *this, run_whole(Operation::param_vjp, inputs, cotangents));
}

TensorMap& Session::named_parameters() noexcept {
  return _impl->parameters;
}
const TensorMap& Session::named_parameters() const noexcept {
  return _impl->parameters;
}

void Session::set_parameter(const std::string& name, const at::Tensor& value) {
  auto& m = *_impl;
  const auto it = m.parameter_base_shapes.find(name);
  if (it == m.parameter_base_shapes.end()) {
    std::vector<std::string> names;
    for (const auto& [n, s] : m.parameter_base_shapes)
      names.push_back(n);
    throw FatalError(fmt::format("set_parameter: '{}' is not a promoted parameter (promoted: "
                                 "{}); promote it with neml2-compile -p {}",
                                 name, names_text(names), name));
  }
  const auto& base = it->second;
  const auto rank = static_cast<std::int64_t>(base.size());
  if (!value.defined() || (value.dim() != rank && value.dim() != rank + 1) ||
      !std::equal(base.begin(), base.end(), value.sizes().end() - rank))
    throw FatalError(
        fmt::format("set_parameter: '{}' takes shape ({}) or batched (B, {}); "
                    "got {}",
                    name, fmt::join(base, ", "), fmt::join(base, ", "),
                    value.defined() ? detail::shape_text(value.sizes()) : "undefined"));
  auto& stored = m.parameters[name];
  stored = detail::translate_foreign_errors("set_parameter", [&] {
    return value.detach().to(m.torch_device, stored.scalar_type(), false, /*copy=*/true);
  });
  // A copy on an accelerator is only queued on this thread's stream, which the workers of an
  // asynchronous policy (and a later call from another stream) do not follow: it ends here.
  for (const auto& d : {value.device(), m.torch_device})
    if (!d.is_cpu())
      detail::synchronize_current_stream(d);
}

const Artifact& Session::artifact() const noexcept {
  return *_impl->artifact;
}
const std::vector<std::string>& Session::input_names() const noexcept {
  return _impl->input_names;
}
const std::vector<std::string>& Session::output_names() const noexcept {
  return _impl->output_names;
}
const std::vector<Shape>& Session::input_base_shapes() const noexcept {
  return _impl->input_base_shapes;
}
const std::vector<Shape>& Session::output_base_shapes() const noexcept {
  return _impl->output_base_shapes;
}
const std::map<std::string, Shape>& Session::parameter_base_shapes() const noexcept {
  return _impl->parameter_base_shapes;
}
const Device& Session::device() const noexcept {
  return _impl->device;
}
c10::ScalarType Session::dtype() const noexcept {
  return _impl->dtype;
}

} // namespace neml2
