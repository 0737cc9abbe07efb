// A session's named surface: the calls by name run as one chunk, the promoted parameters,
// the Newton settings, and what the artifact declares.

#include <algorithm>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <neml2/detail/call_names.hpp>

#include "core/device_sync.hpp"
#include "core/shape_text.hpp"
#include "session/call_protocol.hpp"
#include "session/session_impl.hpp"

namespace neml2 {

Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

std::string detail::names_text(const std::vector<std::string>& names) {
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

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
      detail::CallNames(*this).rethrow_with_outputs(e, detail::finish_whole(call, e.results()));
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
  return detail::CallNames(*this).forward(run_whole(Operation::forward, inputs, {}));
}

std::pair<TensorMap, TensorMap> Session::jvp(const TensorMap& inputs,
                                             const TensorMap& tangents) const {
  return detail::CallNames(*this).jvp(run_whole(Operation::jvp, inputs, tangents));
}

std::pair<TensorMap, VariablePairJacobian> Session::jacobian(const TensorMap& inputs) const {
  return detail::CallNames(*this).jacobian(run_whole(Operation::jacobian, inputs, {}));
}

std::pair<TensorMap, VariablePairJacobian> Session::param_jacobian(const TensorMap& inputs) const {
  return detail::CallNames(*this).param_jacobian(run_whole(Operation::param_jacobian, inputs, {}));
}

TensorMap Session::param_vjp(const TensorMap& inputs, const TensorMap& cotangents) const {
  return detail::CallNames(*this).param_vjp(run_whole(Operation::param_vjp, inputs, cotangents));
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
                                 name, detail::names_text(names), name));
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

const std::vector<Shape>& Session::output_shapes() const noexcept {
  return _impl->output_shapes;
}
const std::map<std::string, Shape>& Session::parameter_base_shapes() const noexcept {
  return _impl->parameter_base_shapes;
}
std::vector<std::pair<std::string, std::string>> Session::jacobian_pairs() const {
  std::vector<std::pair<std::string, std::string>> pairs;
  for (const auto& b : _impl->jacobian_blocks)
    pairs.emplace_back(_impl->output_names[b.out], _impl->input_names[b.in]);
  return pairs;
}
const Device& Session::device() const noexcept {
  return _impl->device;
}
c10::ScalarType Session::dtype() const noexcept {
  return _impl->dtype;
}

} // namespace neml2
