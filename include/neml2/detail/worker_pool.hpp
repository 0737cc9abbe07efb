#pragma once

/// @file detail/worker_pool.hpp
/// @brief The threads behind asynchronous policies (compiled in src/worker_pool.cpp, so
/// no model that stays synchronous pays for them, not even in compile time).

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <c10/core/Device.h>

#include <neml2/detail/call.hpp>

namespace neml2::detail {

/// @brief One lane per device, each a FIFO queue served by its own worker threads.
/// A worker on an accelerator holds a device guard and a stream of its own for life, so
/// a lane with several workers keeps that many chunks in flight on its device.
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

/// Rows [first, first + rows) of a call as one chunk on accelerator `device`: host tensors
/// go through this thread's pinned staging buffers (kept and reused across calls) and are
/// copied without blocking, on the current stream.
void take_rows_staged(const BoundCall& call, std::int64_t first, std::int64_t rows,
                      c10::Device device, ChunkArgs& chunk);

/// Waits until the work queued on this thread's current stream of `device` is done.
void synchronize_current_stream(c10::Device device);

} // namespace neml2::detail
