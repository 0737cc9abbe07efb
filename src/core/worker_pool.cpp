// Worker threads on FIFO lanes (see worker_pool.hpp).

#include "core/worker_pool.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>

#include <neml2/errors.hpp>

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
  // fmt, not std::string's operator+: this object is linked only when it is called, so
  // it must not be the first to define a string member that other objects need
  // (tests/check_sync_only_links.sh: a unity build's synchronous program linked it so).
  if (q.workers == 0) // nobody would ever run it: the call would wait for ever
    throw FatalError(fmt::format("internal: a chunk was queued for the {} lane, which the "
                                 "calling threads serve; report this as a bug",
                                 q.device.str()));
  {
    std::lock_guard lock(q.mutex);
    q.tasks.push_back(std::move(task));
  }
  q.ready.notify_one();
}

std::size_t WorkerPool::live_threads() noexcept {
  return live_workers.load();
}

} // namespace neml2::detail
