// The compiled half of every DispatchedModel: its sessions and the policy-independent steps
// of a call (see include/neml2/detail/model_core.hpp).

#include "engine/model_core.hpp"

#include <algorithm>

#include <ATen/ATen.h>

#include "engine/placement.hpp"
#include "session/call_protocol.hpp"

namespace neml2::detail {

ModelCore::ModelCore(std::shared_ptr<const Artifact> artifact, std::vector<Device> devices,
                     const std::vector<std::size_t>& concurrency, c10::ScalarType dtype,
                     std::size_t cpu_lanes)
    : _state(std::make_unique<State>()) {
  if (devices.empty())
    throw FatalError("the dispatch policy lists no devices; list at least one");
  auto& s = *_state;
  s.devices = std::move(devices);
  s.chunks_in_flight = concurrency;
  s.cpu_lanes = cpu_lanes;
  for (std::size_t d = 0; d < s.devices.size(); ++d) {
    const auto lanes = s.devices[d].is_accelerator() ? 1 : cpu_lanes; // a runner for each lane
    s.sessions.emplace_back(artifact, s.devices[d], dtype, std::max(concurrency[d], lanes));
    s.compute.push_back(s.sessions.back().device().torch());
  }
}

ModelCore::~ModelCore() = default;

const Session& ModelCore::session() const noexcept {
  return _state->sessions.front();
}
Session& ModelCore::session() noexcept {
  return _state->sessions.front();
}
const std::vector<Session>& ModelCore::sessions() const noexcept {
  return _state->sessions;
}
std::vector<Session>& ModelCore::sessions() noexcept {
  return _state->sessions;
}
const std::vector<Device>& ModelCore::devices() const noexcept {
  return _state->devices;
}

void ModelCore::set_observer(ChunkObserver observer) {
  _state->observer = std::move(observer);
}

void ModelCore::set_interrupt_check(InterruptCheck check) {
  _state->interrupt_check = std::move(check);
}

std::int64_t ModelCore::batch_as_given(std::size_t d, const std::vector<at::Tensor>& inputs) const {
  const auto& s = *_state;
  if (s.observer || s.before_chunk || !session().named_parameters().empty())
    return 0;
  const auto batch = CallProtocol::batch_as_given(s.sessions[d], inputs);
  return batch <= max_direct_rows ? batch : 0;
}

std::vector<at::Tensor> ModelCore::forward_as_given(std::size_t d,
                                                    const std::vector<at::Tensor>& inputs) const {
  return CallProtocol::forward_as_given(_state->sessions[d], inputs);
}

} // namespace neml2::detail
