// The worker threads of asynchronous policies, and staging chunks onto accelerators.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "chunking.hpp"
#include "worker_pool.hpp"

namespace neml2::detail {
namespace {
std::atomic<std::size_t> live_workers{0};

struct LaneQueue {
  c10::Device device = c10::kCPU;
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<std::function<void()>> tasks;
  bool stopping = false;
  std::size_t workers = 0;
};

void serve(LaneQueue& lane) {
  std::optional<c10::DeviceGuard> device_guard;
  std::optional<c10::StreamGuard> stream_guard;
  if (!lane.device.is_cpu()) {
    device_guard.emplace(lane.device);
    stream_guard.emplace(
        c10::impl::getDeviceGuardImpl(lane.device.type())->getStreamFromGlobalPool(lane.device));
  }
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(lane.mutex);
      lane.ready.wait(lock, [&] { return lane.stopping || !lane.tasks.empty(); });
      if (lane.tasks.empty())
        break;
      task = std::move(lane.tasks.front());
      lane.tasks.pop_front();
    }
    try {
      task();
    } catch (...) { // tasks report their own errors; never let one end the process
    }
  }
}
} // namespace

struct WorkerPool::Impl {
  std::vector<std::unique_ptr<LaneQueue>> lanes;
  std::vector<std::thread> threads;
};

WorkerPool::WorkerPool(const std::vector<Lane>& lanes)
    : _impl(std::make_unique<Impl>()) {
  for (const auto& spec : lanes) {
    auto lane = std::make_unique<LaneQueue>();
    lane->device = spec.device;
    lane->workers = spec.workers;
    for (std::size_t w = 0; w < spec.workers; ++w) {
      _impl->threads.emplace_back(serve, std::ref(*lane));
      ++live_workers;
    }
    _impl->lanes.push_back(std::move(lane));
  }
}

WorkerPool::~WorkerPool() {
  for (auto& lane : _impl->lanes) {
    std::lock_guard lock(lane->mutex);
    lane->stopping = true;
    lane->ready.notify_all();
  }
  for (auto& t : _impl->threads) {
    t.join();
    --live_workers;
  }
}

void WorkerPool::submit(std::size_t lane, std::function<void()> task) {
  auto& q = *_impl->lanes.at(lane);
  if (q.workers == 0) // nobody would ever run it: the call would wait for ever
    throw FatalError("internal: a chunk was queued for the " + q.device.str() +
                     " lane, which the calling threads serve; report this as a bug");
  {
    std::lock_guard lock(q.mutex);
    q.tasks.push_back(std::move(task));
  }
  q.ready.notify_one();
}

std::size_t WorkerPool::live_threads() noexcept {
  return live_workers.load();
}

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

void synchronize_current_stream(c10::Device device) {
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  impl->getStream(device).synchronize();
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
