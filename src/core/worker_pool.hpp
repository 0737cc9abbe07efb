#pragma once

// Worker threads on FIFO lanes, one lane per device (src/core/worker_pool.cpp): the threads
// behind asynchronous policies (engine/async/) and the one behind submitted calls (host/).
// Linked only by programs that make a pool.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

namespace neml2::detail {

/// @brief One lane per device, each a FIFO queue served by its own worker threads.
/// A worker on an accelerator holds a device guard and a stream of its own for life, so
/// a lane with several workers keeps that many chunks in flight on its device. A lane
/// with none is served by the threads that make calls, and takes no task.
class WorkerPool {
public:
  struct Lane {
    c10::Device device = c10::kCPU;
    std::size_t workers = 1;
  };

  explicit WorkerPool(const std::vector<Lane>& lanes);
  /// Runs what was submitted, then joins every worker.
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Runs `task` on a worker of `lane`. A task reports its own errors; one that throws
  /// anyway is swallowed rather than terminating the process.
  void submit(std::size_t lane, std::function<void()> task);

  /// Worker threads alive in this process, across pools (for tests: synchronous models
  /// start none).
  [[nodiscard]] static std::size_t live_threads() noexcept;

private:
  struct Impl;
  std::unique_ptr<Impl> _impl;
};

} // namespace neml2::detail
