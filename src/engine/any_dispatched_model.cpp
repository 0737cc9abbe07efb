// AnyDispatchedModel: the calls of every DispatchedModel<Policy>, reaching the policy by
// one virtual call per call; PreparedCall.

#include <algorithm>

#include <neml2/detail/testing.hpp>
#include <neml2/dispatched_model.hpp>

#include "engine/model_core.hpp"

namespace neml2 {

using Calls = detail::EvaluationCalls<detail::Dispatcher>;

AnyDispatchedModel::AnyDispatchedModel(std::unique_ptr<detail::Dispatcher> dispatcher) noexcept
    : _dispatcher(std::move(dispatcher)) {}
AnyDispatchedModel::~AnyDispatchedModel() = default;
AnyDispatchedModel::AnyDispatchedModel(AnyDispatchedModel&&) noexcept = default;
AnyDispatchedModel& AnyDispatchedModel::operator=(AnyDispatchedModel&&) noexcept = default;

TensorMap AnyDispatchedModel::forward(const TensorMap& inputs) const {
  return Calls::forward(*_dispatcher, inputs);
}

TensorMap AnyDispatchedModel::forward(const TensorMap& inputs, NewtonFactors& factors) const {
  return Calls::forward(*_dispatcher, inputs, &factors);
}

std::pair<TensorMap, VariablePairJacobian>
AnyDispatchedModel::jacobian(const TensorMap& inputs, NewtonFactors& factors) const {
  return Calls::jacobian(*_dispatcher, inputs, &factors);
}
std::pair<TensorMap, TensorMap> AnyDispatchedModel::jvp(const TensorMap& inputs,
                                                        const TensorMap& tangents) const {
  return Calls::jvp(*_dispatcher, inputs, tangents);
}
std::pair<TensorMap, VariablePairJacobian>
AnyDispatchedModel::jacobian(const TensorMap& inputs) const {
  return Calls::jacobian(*_dispatcher, inputs);
}
std::pair<TensorMap, VariablePairJacobian>
AnyDispatchedModel::param_jacobian(const TensorMap& inputs) const {
  return Calls::param_jacobian(*_dispatcher, inputs);
}
TensorMap AnyDispatchedModel::param_vjp(const TensorMap& inputs,
                                        const TensorMap& cotangents) const {
  return Calls::param_vjp(*_dispatcher, inputs, cotangents);
}
void AnyDispatchedModel::forward_into(const TensorMap& inputs, const TensorMap& outputs) const {
  Calls::into(*_dispatcher, Operation::forward, inputs, nullptr, outputs, {}, {});
}
void AnyDispatchedModel::jvp_into(const TensorMap& inputs, const TensorMap& tangents,
                                  const TensorMap& outputs,
                                  const TensorMap& output_tangents) const {
  Calls::into(*_dispatcher, Operation::jvp, inputs, &tangents, outputs, output_tangents, {});
}
void AnyDispatchedModel::forward_into(const TensorMap& inputs, const TensorMap& outputs,
                                      NewtonFactors& factors) const {
  Calls::into(*_dispatcher, Operation::forward, inputs, nullptr, outputs, {}, {}, &factors);
}

void AnyDispatchedModel::jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                                       const VariablePairJacobian& J,
                                       NewtonFactors& factors) const {
  Calls::into(*_dispatcher, Operation::jacobian, inputs, nullptr, outputs, {}, J, &factors);
}

void AnyDispatchedModel::jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                                       const VariablePairJacobian& J) const {
  Calls::into(*_dispatcher, Operation::jacobian, inputs, nullptr, outputs, {}, J);
}
void AnyDispatchedModel::param_jacobian_into(const TensorMap& inputs, const TensorMap& outputs,
                                             const VariablePairJacobian& P) const {
  Calls::into(*_dispatcher, Operation::param_jacobian, inputs, nullptr, outputs, {}, P);
}
void AnyDispatchedModel::param_vjp_into(const TensorMap& inputs, const TensorMap& cotangents,
                                        const TensorMap& gradients) const {
  Calls::into(*_dispatcher, Operation::param_vjp, inputs, &cotangents, gradients, {}, {});
}

PreparedCall AnyDispatchedModel::prepare(std::vector<std::string> names) const {
  return {*_dispatcher, std::move(names)};
}

void AnyDispatchedModel::set_observer(ChunkObserver observer) {
  _dispatcher->core.set_observer(std::move(observer));
}

void AnyDispatchedModel::set_interrupt_check(InterruptCheck check) {
  _dispatcher->core.set_interrupt_check(std::move(check));
}

TensorMap& AnyDispatchedModel::named_parameters() noexcept {
  return _dispatcher->core.session().named_parameters();
}
const TensorMap& AnyDispatchedModel::named_parameters() const noexcept {
  return _dispatcher->core.session().named_parameters();
}
void AnyDispatchedModel::set_parameter(const std::string& name, const at::Tensor& value) {
  _dispatcher->core.session().set_parameter(name, value);
}

const std::vector<std::string>& AnyDispatchedModel::input_names() const noexcept {
  return _dispatcher->core.session().input_names();
}
const std::vector<std::string>& AnyDispatchedModel::output_names() const noexcept {
  return _dispatcher->core.session().output_names();
}
const std::vector<Shape>& AnyDispatchedModel::input_base_shapes() const noexcept {
  return _dispatcher->core.session().input_base_shapes();
}
const std::vector<Shape>& AnyDispatchedModel::output_base_shapes() const noexcept {
  return _dispatcher->core.session().output_base_shapes();
}

const std::vector<Shape>& AnyDispatchedModel::output_shapes() const noexcept {
  return _dispatcher->core.session().output_shapes();
}
const std::map<std::string, Shape>& AnyDispatchedModel::parameter_base_shapes() const noexcept {
  return _dispatcher->core.session().parameter_base_shapes();
}
const Device& AnyDispatchedModel::device() const noexcept {
  return _dispatcher->core.session().device();
}
const std::vector<Session>& AnyDispatchedModel::sessions() const noexcept {
  return _dispatcher->core.sessions();
}
c10::ScalarType AnyDispatchedModel::dtype() const noexcept {
  return _dispatcher->core.session().dtype();
}
const Artifact& AnyDispatchedModel::artifact() const noexcept {
  return _dispatcher->core.session().artifact();
}

const SolverConfig& AnyDispatchedModel::solver_config() const {
  return _dispatcher->core.session().solver_config();
}
void AnyDispatchedModel::set_solver_config(const SolverConfig& config) {
  for (auto& s : _dispatcher->core.sessions())
    s.set_solver_config(config);
}

void detail::ModelAccess::before_chunk(AnyDispatchedModel& model,
                                       std::function<void(const ChunkEvent&)> hook) {
  model._dispatcher->core.state().before_chunk = std::move(hook);
}

// ------------------------------------------------------------------------ PreparedCall

PreparedCall::PreparedCall(const detail::Dispatcher& dispatcher, std::vector<std::string> names)
    : _dispatcher(&dispatcher)
    , _names(names.empty() ? dispatcher.core.session().input_names() : std::move(names)) {
  const auto& all = dispatcher.core.session().input_names();
  if (_names.size() != all.size())
    throw FatalError("prepare(): " + std::to_string(_names.size()) + " names given, but the " +
                     "model takes " + std::to_string(all.size()) + " inputs; name each once");
  for (const auto& name : _names) {
    const auto it = std::find(all.begin(), all.end(), name);
    if (it == all.end() || std::count(_names.begin(), _names.end(), name) > 1)
      throw FatalError("prepare(): '" + name + "' is " +
                       (it == all.end() ? "not an input of this model" : "named twice") +
                       "; name each input once");
    _positions.push_back(static_cast<std::size_t>(it - all.begin()));
  }
  for (std::size_t i = 0; i < _positions.size(); ++i)
    _in_order = _in_order && _positions[i] == i;
  for (const auto& name : dispatcher.core.session().output_names())
    _output_labels.push_back("output '" + name + "'");
}

namespace {
std::vector<at::Tensor> in_model_order(std::span<const at::Tensor> inputs,
                                       const std::vector<std::size_t>& positions, bool in_order) {
  if (inputs.size() != positions.size())
    throw FatalError(std::to_string(inputs.size()) + " input tensors given, but this call " +
                     "was prepared for " + std::to_string(positions.size()) +
                     "; pass them in the order given to prepare()");
  if (in_order)
    return {inputs.begin(), inputs.end()};
  std::vector<at::Tensor> ordered(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k)
    ordered[positions[k]] = inputs[k];
  return ordered;
}
} // namespace

std::vector<at::Tensor> PreparedCall::forward(std::span<const at::Tensor> inputs) const {
  return Calls::guarded(*_dispatcher, Operation::forward, [&] {
    detail::Request request{Operation::forward, in_model_order(inputs, _positions, _in_order)};
    return _dispatcher->run(request);
  });
}

void PreparedCall::forward_into(std::span<const at::Tensor> inputs,
                                std::span<const at::Tensor> outputs) const {
  if (outputs.size() != _output_labels.size())
    throw FatalError(std::to_string(outputs.size()) + " output tensors given, but the model " +
                     "has " + std::to_string(_output_labels.size()) +
                     " outputs; pass one per output, in output_names() order");
  const detail::Destinations into{{outputs.begin(), outputs.end()}, _output_labels};
  Calls::guarded(*_dispatcher, Operation::forward, [&] {
    detail::Request request{Operation::forward, in_model_order(inputs, _positions, _in_order),
                            nullptr, &into};
    (void)_dispatcher->run(request);
    return 0;
  });
}

} // namespace neml2
