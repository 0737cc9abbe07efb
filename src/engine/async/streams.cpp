// Staging chunks onto accelerators, and ordering the calling thread's streams before the
// workers' (see streams.hpp).

#include "engine/async/streams.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace neml2::detail {

namespace {
// This thread's pinned buffers, one per tensor position of a chunk, grown as needed.
at::Tensor staged_copy(const at::Tensor& host, std::size_t slot, c10::Device device) {
  thread_local std::vector<at::Tensor> buffers;
  if (buffers.size() <= slot)
    buffers.resize(slot + 1);
  auto& buffer = buffers[slot];
  const auto bytes = static_cast<std::int64_t>(host.numel() * host.element_size());
  if (!buffer.defined() || buffer.numel() < bytes)
    buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto staged = buffer.narrow(0, 0, bytes).view(host.scalar_type()).view(host.sizes());
  staged.copy_(host);
  auto on_device = at::empty(host.sizes(), host.options().device(device));
  on_device.copy_(staged, /*non_blocking=*/true);
  return on_device;
}
} // namespace

void take_rows_staged(const BoundCall& call, std::int64_t first, std::int64_t rows,
                      c10::Device device, ChunkArgs& chunk) {
  std::size_t slot = 0;
  const auto take = [&](const std::vector<at::Tensor>& from, std::vector<at::Tensor>& to) {
    to.clear();
    for (const auto& t : from) {
      if (t.defined() && t.is_cpu())
        to.push_back(staged_copy(take_rows(t, first, rows, c10::kCPU), slot++, device));
      else
        to.push_back(take_rows(t, first, rows, device));
    }
  };
  chunk.rows = rows;
  take(call.inputs, chunk.inputs);
  take(call.params, chunk.params);
  take(call.extras, chunk.extras);
}

CallerStreams::CallerStreams() = default;
CallerStreams::~CallerStreams() = default;

void CallerStreams::record(const BoundCall& call, const std::vector<at::Tensor>& targets) {
  std::vector<c10::Device> devices;
  const auto note = [&](c10::Device d) {
    if (!d.is_cpu() && std::find(devices.begin(), devices.end(), d) == devices.end())
      devices.push_back(d);
  };
  note(call.device);
  for (const auto* tensors : {&call.inputs, &call.params, &call.extras, &targets})
    for (const auto& t : *tensors)
      if (t.defined())
        note(t.device());
  for (const auto d : devices) {
    _events.emplace_back(d.type());
    _events.back().record(c10::impl::getDeviceGuardImpl(d.type())->getStream(d));
  }
}

void CallerStreams::wait() const {
  for (const auto& e : _events) {
    const c10::Device d(e.device_type(), e.device_index());
    e.block(c10::impl::getDeviceGuardImpl(d.type())->getStream(d));
  }
}

void own_on_this_stream(const at::Tensor& t) {
  if (t.defined() && t.is_cuda())
    t.record_stream(c10::impl::getDeviceGuardImpl(t.device().type())->getStream(t.device()));
}

} // namespace neml2::detail
