// Binding a call: names checked against the artifact's, then every tensor's dtype, device
// and shape, and the batch sizes; the tensors put in positional order without a copy.

#include <algorithm>
#include <optional>
#include <variant>

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/detail/call_names.hpp>

#include "core/shape_text.hpp"
#include "session/call_protocol.hpp"
#include "session/session_impl.hpp"

namespace neml2 {

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
    // Graphs and the row pass read raw memory: a lazy view is read as its values (a
    // negated or conjugated view resolved, a zero tensor without memory made real).
    if (t.is_neg() || t.is_conj())
      t = t.resolve_conj().resolve_neg();
    else if (t._is_zerotensor())
      t = at::zeros(t.sizes(), t.options());
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

void reject_unknown(const TensorMap& given, const std::vector<std::string>& public_names,
                    const char* what) {
  for (const auto& [name, t] : given)
    if (std::find(public_names.begin(), public_names.end(), name) == public_names.end())
      throw FatalError(fmt::format("unknown {} '{}'; this model takes: {}", what, name,
                                   detail::names_text(public_names)));
}

// An implicit variable with a sub-batch axis, if the artifact has one: neml2-compile 3.1
// compiles no derivative graph for such a segment, whatever -d asks.
const ImplicitVariable* sub_batched_implicit(const Artifact& a) {
  for (const auto& segment : a.segments)
    if (const auto* s = std::get_if<ImplicitSegment>(&segment))
      for (const auto* vars : {&s->unknowns, &s->residuals, &s->givens})
        for (const auto& v : *vars)
          if (!v.sub_batch_shape.empty())
            return &v;
  return nullptr;
}

} // namespace

void Session::Impl::require_operation(Operation op) const {
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

void Session::Impl::require(bool has_graph, const char* op, const std::string& fix) const {
  if (has_graph)
    return;
  if (const auto* v = chain ? sub_batched_implicit(*artifact) : nullptr)
    throw FatalError(fmt::format(
        "{}(): artifact '{}' was compiled without the graphs it needs: implicit variable "
        "'{}' has sub-batch shape {}, and neml2-compile 3.1 compiles no derivative of a "
        "sub-batched implicit variable; only forward() runs on this artifact",
        op, artifact->root.string(), v->name, detail::shape_text(v->sub_batch_shape)));
  throw FatalError(fmt::format("{}(): artifact '{}' was compiled without the graphs it "
                               "needs; recompile with neml2-compile ... {}",
                               op, artifact->root.string(), fix));
}

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
                                   detail::names_text(m.input_names)));
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
                                 inputs.size(), m.input_names.size(),
                                 detail::names_text(m.input_names)));
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
                                     name, detail::names_text(covered), name));
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

std::vector<at::Tensor> detail::CallNames::positional(const TensorMap& inputs) const {
  return _session->_impl->positional_inputs(inputs);
}

bool detail::CallProtocol::runs_chain(const Session& s) noexcept {
  return s._impl->chain != nullptr;
}

std::vector<detail::NewtonPlan> detail::CallProtocol::newton_plans(const Session& s) {
  return s._impl->chain ? s._impl->chain->newton_plans() : std::vector<NewtonPlan>{};
}

std::size_t detail::CallProtocol::runners(const Session& s) noexcept {
  return s._impl->runners;
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
    // A lazy view (negated, conjugated, a zero tensor without memory) is not its raw
    // memory: the bound path resolves it.
    if (!t.defined() || t.scalar_type() != m.dtype || !t.is_cpu() ||
        t.dim() != static_cast<std::int64_t>(base.size()) + 1 || !t.is_contiguous() || t.is_neg() ||
        t.is_conj() || t._is_zerotensor())
      return 0;
    const auto sizes = t.sizes();
    if (!std::equal(base.begin(), base.end(), sizes.begin() + 1) || sizes[0] < 1 ||
        (batch != 0 && sizes[0] != batch))
      return 0;
    batch = sizes[0];
  }
  return batch;
}

} // namespace neml2
